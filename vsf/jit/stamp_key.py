"""What must match for two calls to share a trace (:mod:`vsf.jit.stamp`): a block call's key and
its tensors, and whether a trace may stand for a call made now.

The key holds each module's class and training flag, the parameters' and buffers' names, shapes,
strides, dtypes, devices and ``requires_grad``, the call's argument structure, its tensors'
metadata and its other arguments' values, and grad mode; the attributes of its modules the
traced code read are compared apart (:func:`recording_reads`, :func:`read_values`).

Example::

    >>> key, call = block_key(model.blocks[0], (x,), {}, tracer)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from vsf import _compat, tree
from vsf.ops import recording

__all__ = [
    "Call",
    "all_held",
    "args_key",
    "block_key",
    "call_key",
    "exact",
    "read_values",
    "rebuild",
    "recording_reads",
    "restored",
    "row_keys",
    "stampable_now",
]

_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
_HELD = (torch.Tensor, *_PLAIN)  # what a trace holds as it is: a tensor (by its node), a plain value
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_MISSING = object()


@dataclasses.dataclass
class Call:
    """One call of a block: its modules (itself first, each once), the slots of their tensors, its operands (those tensors, then the
    arguments' tensors), the node of each operand in the trace and whether it requires grad, and how to put the arguments back
    together from tensors."""

    modules: list[torch.nn.Module]
    slots: list[tuple[dict[str, Any], str]]
    operands: list[torch.Tensor]
    nodes: list[torch.fx.Node]
    grads: list[bool]
    leaves: list[Any]
    treedef: tree.PyTreeSpec


def block_key(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tracer: Any
) -> tuple[Any, Call] | None:
    """The key of a block call (the module docstring says what it holds) and the call's tensors,
    or ``None`` where the call is not to be stamped (a hook on one of its modules, or where
    :func:`call_key` says so).

    Example::

        >>> key, call = block_key(model.blocks[0], (x,), {}, tracer)
        >>> call.operands[: len(call.slots)]  # the block's parameters and buffers, then x
    """
    modules = list(module.named_modules(remove_duplicate=False))
    slots: list[tuple[dict[str, Any], str]] = []
    key: list[Any] = []
    with _compat.metadata_reads():
        for prefix, m in modules:
            if any(getattr(m, h, None) for h in _HOOKS):
                return None
            key.append((prefix, type(m), m.training))
            params, buffers, _ = _compat.module_tables(m)
            for table in (params, buffers):
                for name, t in table.items():
                    if t is not None:
                        slots.append((table, name))
                        key.append((prefix, name, _meta(t)))
    keyed = call_key(args, kwargs, tracer, [table[name] for table, name in slots])
    if keyed is None or _compat.global_module_hooks():
        return None
    arguments, call = keyed
    unique = list({id(m): m for _, m in modules}.values())
    return (*key, arguments), dataclasses.replace(call, modules=unique, slots=slots)


def call_key(
    args: tuple[Any, ...], kwargs: dict[str, Any], tracer: Any, held: Sequence[torch.Tensor] = ()
) -> tuple[Any, Call] | None:
    """The key of a call's arguments (grad mode, structure, each tensor's metadata, each other
    value) and the call (its operands: the ``held`` tensors, then the arguments'), or ``None``
    where no trace may stand for it (the module docstring says when).

    Example::

        >>> key, call = call_key((grad, mu, nu), {}, tracer)
    """
    return args_key(args, kwargs, tracer, held) if stampable_now() else None


def stampable_now() -> bool:
    """May a trace stand for a call made now: no hooks on saved tensors, no dispatch mode but the
    trace's, no nested differentiation, no autocast (the module docstring says why)?

    Example::

        >>> with torch.autocast("cpu"):
        ...     assert not stampable_now()
    """
    if _compat.saved_tensor_hooks() or not _compat.only_tracing_modes():
        return False
    if recording.grad_depth() > 1:  # its backward will be differentiated again, which copied ops cannot record
        return False
    return not any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def all_held(leaves: Sequence[Any]) -> bool:
    """Is each of a pytree's ``leaves`` a tensor or a plain value (a number, a string, ``None``, a
    dtype, a device): what a block's call may take, and a stamped block may give back, as it is?

    Example::

        >>> all_held([x, 2, None]), all_held([x, Intermediates(x)])
        (True, False)
    """
    return all(isinstance(x, _HELD) for x in leaves)


def unkeyed_kind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The name of the type of the first argument of a call that is neither a tensor nor a plain
    value (no key holds it: the call is traced by itself), else ``None``.

    Example::

        >>> unkeyed_kind((x,), {"past_key_values": DynamicCache()})
        'DynamicCache'
    """
    leaves, _ = tree.flatten((args, kwargs))
    return next((type(x).__name__ for x in leaves if not isinstance(x, _HELD)), None)


def args_key(
    args: tuple[Any, ...], kwargs: dict[str, Any], tracer: Any, held: Sequence[torch.Tensor] = ()
) -> tuple[Any, Call] | None:
    """:func:`call_key` where :func:`stampable_now` holds (asked once for many calls).

    Example::

        >>> key, call = args_key((grad, mu, nu), {}, tracer)
    """
    leaves, treedef = tree.flatten((args, kwargs))
    with _compat.metadata_reads():
        return _keyed(leaves, treedef, tracer, held, {})


def row_keys(rows: Sequence[tuple[Any, ...]], tracer: Any) -> list[tuple[Any, Call] | None]:
    """:func:`args_key` of each row (the positional arguments of one call), asked once for all of
    them: a row of tensors and plain values is keyed without flattening it (its structure found
    once per place of its Nones), and a tensor that several rows hold (an optimizer's step
    count, its learning rate) has its metadata and node read once.

    Example::

        >>> keys = row_keys(rows, tracer) if stampable_now() else None
    """
    specs: dict[tuple[bool, ...], tree.PyTreeSpec] = {}  # (None is a node of no leaves)
    seen: dict[int, tuple[Any, torch.fx.Node | None, bool]] = {}
    out = []
    with _compat.metadata_reads():
        for row in rows:
            if all_held(row):
                nones = tuple([x is None for x in row])
                if nones not in specs:
                    specs[nones] = tree.flatten((row, {}))[1]
                leaves, treedef = [x for x in row if x is not None], specs[nones]
            else:
                leaves, treedef = tree.flatten((row, {}))
            out.append(_keyed(leaves, treedef, tracer, (), seen))
    return out


def _keyed(
    leaves: list[Any],
    treedef: tree.PyTreeSpec,
    tracer: Any,
    held: Sequence[torch.Tensor],
    seen: dict[int, tuple[Any, torch.fx.Node | None, bool]],
) -> tuple[Any, Call] | None:
    """The key of a call of the arguments ``leaves`` (of structure ``treedef``) with the tensors
    ``held`` before them, and the call, or ``None`` (the module docstring says when); read under
    ``_compat.metadata_reads``. ``seen``: each tensor's metadata, node and ``requires_grad`` by id,
    read once for the calls that share it."""
    if not all_held(leaves):
        return None
    operands = [*held, *(x for x in leaves if isinstance(x, torch.Tensor))]
    for t in operands:
        if id(t) not in seen:
            seen[id(t)] = (_meta(t), _compat.traced_node(t, tracer), t.requires_grad)
    key = (
        torch.is_grad_enabled(),
        treedef,
        *(seen[id(x)][0] if isinstance(x, torch.Tensor) else exact(x) for x in leaves),
    )
    known = [seen[id(t)] for t in operands]
    if len({id(t) for t in operands}) != len(operands) or any(node is None for _, node, _ in known):
        return None
    try:
        hash(key)
    except TypeError:
        return None
    return key, Call([], [], operands, [node for _, node, _ in known], [grad for _, _, grad in known], leaves, treedef)


@contextlib.contextmanager
def recording_reads(modules: list[torch.nn.Module]) -> Iterator[set[tuple[int, str]]]:
    """Record which attributes of their own (not nn.Module's tables, hooks or training flag) the
    code running now reads from ``modules`` by name, as (index in ``modules``, name); a read
    through ``vars(module)`` is not seen (torch reads every module's ``__dict__`` on each call).
    Each module runs as a subclass of its class that records them while the context is open.

    Example::

        >>> with recording_reads([block]) as reads:
        ...     block(x)
        >>> reads
        {(0, 'scale')}
    """
    reads: set[tuple[int, str]] = set()
    classes = [type(m) for m in modules]
    for i, m in enumerate(modules):
        m.__class__ = _recording(type(m), i, reads)
    try:
        yield reads
    finally:
        for m, cls in zip(modules, classes):
            m.__class__ = cls


def _recording(cls: type, index: int, reads: set[tuple[int, str]]) -> type:
    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
        if name not in _compat.MODULE_STATE and name in object.__getattribute__(self, "__dict__"):
            reads.add((index, name))
        return super(recorder, self).__getattribute__(name)

    recorder = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__module__": cls.__module__})
    return recorder


def restored(modules: list[torch.nn.Module], attributes: list[dict[str, Any]]) -> bool:
    """Whether a block's trace beside the step assigned an attribute of one of its ``modules`` (a
    cache's length, as rotary-embedding-torch's ``cached_freqs_seq_len``), each module's attributes
    put back as they were (``attributes``: each one's ``vars`` before). Such a block is not stamped:
    a copy would skip the assignment, and the call run as the step runs it must find the state the
    trace found (left assigned, it read the cache the trace filled on its own inputs as filled: a
    wrong attention, silently).

    Example::

        >>> before = [dict(vars(m)) for m in call.modules]
        >>> gm = trace_aside(...)
        >>> restored(call.modules, before)   # True: the block cannot stand for another
    """
    pairs = [(vars(m), before) for m, before in zip(modules, attributes)]
    assigned = any(
        now.keys() != before.keys() or any(now[k] is not v for k, v in before.items()) for now, before in pairs
    )
    for now, before in pairs:
        now.clear()
        now.update(before)
    return assigned


def read_values(modules: list[torch.nn.Module], reads: frozenset[tuple[int, str]]) -> tuple[Any, ...]:
    """The values of the attributes ``reads`` names, in ``modules``, as the key holds them.

    Example::

        >>> read_values([attention], frozenset({(0, "head_dim")}))
        ((0, 'head_dim', (<class 'int'>, 64)),)
    """
    return tuple((i, name, _plain(vars(modules[i]).get(name, _MISSING))) for i, name in sorted(reads))


def _plain(v: Any) -> Any:
    """An attribute's value as the key holds it: itself where plain; an instance of a class written
    in Python whose state is plain values (:func:`_plain_state`: a diffusers ``Attention``'s
    ``processor``, one object per block) as its class and that state; else its identity.

    Example::

        >>> _plain(AttnProcessor2_0()) == _plain(AttnProcessor2_0())   # two blocks' processors
        True
        >>> _plain(torch.nn.functional.gelu) == _plain(torch.nn.functional.relu)
        False
    """
    if isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)):
        return exact(v)
    state = _plain_state(v)
    return ("id", id(v)) if state is None else (type(v), state)


class _Bare:
    """A class whose instances hold nothing but their ``__dict__`` (and weak references)."""


def _plain_state(v: Any) -> tuple[tuple[str, Any], ...] | None:
    """The state of ``v``, sorted by name, where it holds nothing but a ``__dict__`` of plain
    values: no slots, no C fields (a function's code, a ``functools.partial``'s function and
    arguments, a tensor's data: such an object is larger than :class:`_Bare`'s); else ``None``.
    Two such objects of one class behave alike: their methods are their class's, the rest is that
    state."""
    cls = type(v)
    if cls.__basicsize__ != _Bare.__basicsize__ or cls.__itemsize__ or not hasattr(v, "__dict__"):
        return None
    state = vars(v)
    if not all(isinstance(x, _PLAIN) for x in state.values()):
        return None
    return tuple(sorted((name, exact(x)) for name, x in state.items()))


def exact(x: Any) -> Any:
    """``x`` as a key compares it: with its type, a float by its bits, a tuple element by element
    (``1``, ``1.0`` and ``True`` differ, as do ``0.0`` and ``-0.0``, which ``==`` holds equal: a
    trace made for one would give the other's results the wrong sign).

    Example::

        >>> exact(0.0) == exact(-0.0), exact(1) == exact(True), exact((2, 0.5)) == exact((2, 0.5))
        (False, False, True)
    """
    if type(x) is float:
        return (float, x.hex())
    if type(x) is tuple:
        return (tuple, tuple(exact(e) for e in x))
    return (type(x), x)


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    """The metadata of ``t`` a key holds (read under ``_compat.metadata_reads``)."""
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def rebuild(call: Call, tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's ``(args, kwargs)`` with ``tensors`` in its tensors' places.

    Example::

        >>> args, kwargs = rebuild(call, call.operands[len(call.slots) :])
    """
    it = iter(tensors)
    args, kwargs = tree.unflatten(call.treedef, [next(it) if isinstance(x, torch.Tensor) else x for x in call.leaves])
    return tuple(args), dict(kwargs)
