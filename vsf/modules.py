"""Modules as functions of their tensors: :func:`from_module` reads a module's parameters (and
buffers) as a flat dict, :func:`apply` runs the module with the tensors of such a dict in place of
its own (``torch.func.functional_call``, with the checks a pure step needs). Both are public as
``vsf.tree.from_module`` and ``vsf.tree.apply``.

Example::

    >>> params = vsf.tree.from_module(model)
    >>> y = vsf.tree.apply(model, params, x)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import types
import warnings
from typing import Any

import torch

from vsf import _compat
from vsf.errors import ApplyError

__all__ = ["apply", "from_module"]


def from_module(
    module: torch.nn.Module, *, params: bool = True, buffers: bool = False, trainable: bool | None = None
) -> dict[str, torch.Tensor]:
    """A module's parameters (and, with ``buffers=True``, its buffers) as a flat dict; with
    ``params=False`` its buffers alone.

    Keys are the module's own names (``"blocks.0.attn.qkv.weight"``); values are detached
    tensors, so the pytree is plain data that :func:`apply` feeds back to the module.

    ``trainable`` picks parameters by ``requires_grad``: ``True`` those that require grad,
    ``False`` the frozen ones (a sinusoidal position table: Whisper's, Pegasus's; a LoRA base
    weight), ``None`` (the default) all. A step that differentiates a frozen parameter trains it,
    where torch's optimizer leaves it as it is (no gradient): so with ``None``, a module holding
    frozen parameters warns, naming them. Differentiate the trainable ones and pass the frozen
    ones to :func:`apply` beside them.

    Example::

        >>> model = torch.nn.BatchNorm1d(2)
        >>> sorted(vsf.tree.from_module(model))
        ['bias', 'weight']
        >>> sorted(vsf.tree.from_module(model, params=False, buffers=True))
        ['num_batches_tracked', 'running_mean', 'running_var']
        >>> params = vsf.tree.from_module(whisper, trainable=True)
        >>> frozen = vsf.tree.from_module(whisper, trainable=False)   # the encoder's position table
        >>> grads = vsf.grad(lambda p: vsf.tree.apply(whisper, {**p, **frozen}, **batch).loss)(params)
    """
    named = dict(module.named_parameters()) if params else {}
    frozen = [k for k, v in named.items() if not v.requires_grad]
    if trainable is None and frozen:
        warnings.warn(
            f"{type(module).__name__} holds {len(frozen)} frozen parameter(s) (requires_grad=False: "
            f"{', '.join(repr(k) for k in frozen[:3])}{', ...' if len(frozen) > 3 else ''}): vsf.tree.from_module returns "
            "them with the others, and a step that differentiates them trains them, where torch's optimizer leaves "
            "them as they are. Differentiate vsf.tree.from_module(module, trainable=True) and pass "
            "vsf.tree.from_module(module, trainable=False) to vsf.tree.apply beside them.",
            stacklevel=2,
        )
    if trainable is not None:
        named = {k: v for k, v in named.items() if v.requires_grad == trainable}
    if buffers:
        named.update(module.named_buffers())
    return {k: v.detach() for k, v in named.items()}


def apply(
    module: torch.nn.Module, state: dict[str, torch.Tensor], *args: Any, mutable: bool = False, **kwargs: Any
) -> Any:
    """Run ``module(*args, **kwargs)`` with the tensors of ``state`` in place of its own.

    ``state`` maps the module's names to tensors, as :func:`from_module` returns them: every
    parameter (a missing or unknown name is an error, so a typo never silently uses the module's
    own weight), and any of its buffers (those left out are read from the module). The module
    runs as a copy of its tree of modules that holds these tensors for as long as anything refers
    to it (with copies of the plain objects its modules hold that refer to modules of the tree, up
    to two attributes deep: torchtune's ``TiedLinear``, whose output layer reads the embedding's
    weight; an attribute that is another name of one of its tensors, as Hugging Face's rotary
    embedding's ``original_inv_freq``, names the tensor given; a forward that reaches one of the
    module's own tensors that ``state`` replaces another way, through a closure, is an
    :class:`~vsf.errors.ApplyError`; a conversion in forward, ``module.to(x.device)`` as st-moe's
    experts do, leaves the tensors given as they are, and one that would change them is an
    ``ApplyError``), so activation checkpointing (``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``, Hugging Face's ``gradient_checkpointing_enable()``) recomputes with
    them in the backward too.
    Reentrant checkpointing (``use_reentrant=True``) is refused: its backward cannot run under
    ``torch.autograd.grad``, and a block whose input needs no gradient would silently give its
    weights none.

    Forward may write buffers (BatchNorm's running statistics, a router's token counts) only with
    ``mutable=True``: then the call returns ``(out, updated)``, ``updated`` the new values of the
    buffers of ``state`` that forward wrote (in place or by assignment), so that a pure step
    carries them like optimizer state (Flax's ``apply(..., mutable=...)``). Without it, a buffer
    write is an :class:`~vsf.errors.ApplyError` naming the buffer, as is a write to a buffer
    ``state`` does not hold, or to a parameter. Forward writes copies of the buffers: neither
    ``state``'s nor the module's own change (a parameter written in place is written before the
    error). Inside :func:`vsf.jit` and eagerly alike.

    Example::

        >>> y = vsf.tree.apply(model, params, torch.randn(3, 4))
        >>> cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> params = vsf.tree.from_module(cnn)
        >>> stats = vsf.tree.from_module(cnn, params=False, buffers=True)
        >>> def loss_fn(params, stats, x):
        ...     y, stats = vsf.tree.apply(cnn, {**params, **stats}, x, mutable=True)
        ...     return y.square().mean(), stats     # stats: BatchNorm's three buffers, updated
        >>> (loss, stats), grads = vsf.value_and_grad(loss_fn, has_aux=True)(params, stats, x)
    """
    slots = _slots(module)
    _check_names(module, slots, state)
    bound, placed = _bind(module, slots, state)
    replaced: dict[int, str] = {}  # the module's own tensors that state replaces, by id: their names
    for s in slots:
        if s.key in state and state[s.key] is not s.tensor:
            replaced.setdefault(id(s.tensor), s.key)
    with _Watch(type(module).__name__, replaced) as watch:
        out = bound(*args, **kwargs)
    updated = _written(module, placed, state, mutable, watch.written)
    return (out, updated) if mutable else out


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where a module tree holds a tensor: ``key`` its name from the root, ``owner`` the module
    holding it as ``local`` in its parameters (``param``) or buffers table."""

    key: str
    owner: torch.nn.Module
    local: str
    param: bool
    tensor: torch.Tensor


def _slots(module: torch.nn.Module) -> list[_Slot]:
    """Every parameter and buffer slot of ``module``'s tree, shared ones under each of their names."""
    out = []
    for prefix, m in module.named_modules(remove_duplicate=False):
        params, buffers, _ = _compat.module_tables(m)
        for table, param in ((params, True), (buffers, False)):
            out += [_Slot(f"{prefix}.{k}" if prefix else k, m, k, param, t) for k, t in table.items() if t is not None]
    return out


def _check_names(module: torch.nn.Module, slots: list[_Slot], state: dict[str, torch.Tensor]) -> None:
    expected = {k for k, _ in module.named_parameters()}
    missing = sorted(expected - set(state))
    unknown = sorted(set(state) - {s.key for s in slots})
    if missing or unknown:
        raise ValueError(f"params do not match {type(module).__name__}: missing {missing}, unknown {unknown}")
    tied: dict[int, str] = {}
    for s in slots:
        if (
            s.key in state
            and tied.setdefault(id(s.tensor), s.key) != s.key
            and state[tied[id(s.tensor)]] is not state[s.key]
        ):
            raise ValueError(
                f"{type(module).__name__} ties {tied[id(s.tensor)]!r} and {s.key!r} (one tensor), but state gives them different values"
            )


@dataclasses.dataclass
class _Placed:
    """A tensor :func:`_bind` put in a slot of the bound tree, and its version counter then."""

    slot: _Slot
    owner: torch.nn.Module
    tensor: torch.Tensor
    version: int | None


def _bind(
    module: torch.nn.Module, slots: list[_Slot], state: dict[str, torch.Tensor]
) -> tuple[torch.nn.Module, list[_Placed]]:
    """A copy of ``module``'s tree of modules (sharing their code, hooks and attributes) whose
    slots hold ``state``'s tensors (a tied slot the tensor given for any of its names), the
    module's own elsewhere; each buffer a copy, so that a write in forward changes neither."""
    copies: dict[int, torch.nn.Module] = {}
    for _, m in module.named_modules(remove_duplicate=False):
        copies.setdefault(id(m), _compat.module_node_copy(m))
    for new in copies.values():
        children = _compat.module_tables(new)[2]
        children.update({k: copies[id(c)] for k, c in children.items() if c is not None})
    given = {id(s.tensor): state[s.key] for s in slots if s.key in state}
    fresh: dict[int, torch.Tensor] = {}
    placed = []
    for s in slots:
        t = given.get(id(s.tensor), s.tensor)
        if not s.param:
            t = fresh.setdefault(id(s.tensor), t.clone())
        owner = copies[id(s.owner)]
        _compat.module_tables(owner)[0 if s.param else 1][s.local] = t
        placed.append(_Placed(s, owner, t, _compat.tensor_version(t)))
    bound: dict[int, Any] = {**copies, **{id(p.slot.tensor): p.tensor for p in placed}}
    made: dict[Any, Any] = {}
    for new in copies.values():
        attributes = vars(new)
        for name, value in list(attributes.items()):
            if name not in _compat.MODULE_STATE and type(value) not in _ATOMS:
                attributes[name] = _rebound(value, bound, made, _REBIND_DEPTH)
    keys = {(id(p.owner), p.slot.local): p.slot.key for p in reversed(placed)}  # (a tied tensor: its first name)
    for new in copies.values():
        _compat.conversions_checked(new, functools.partial(_unconverted, type(module).__name__, keys, id(new)))
    return copies[id(module)], placed


def _unconverted(
    name: str, keys: dict[tuple[int, str], str], owner: int, local: str, t: torch.Tensor, converted: torch.Tensor
) -> None:
    """A conversion in forward (st-moe's ``expert.to(device)``) is let pass where it leaves the
    bound tensor as it is; one that would change it is an :class:`ApplyError` naming it: the bound
    tree's tensors are the ones given."""
    if converted is not t:
        raise ApplyError(
            f"{name}'s forward converts {keys[owner, local]!r} ({_described(t)} -> {_described(converted)}, "
            "by Module.to, .float(), .cuda() or the like): vsf.tree.apply computes with the tensors given, "
            "as they are; convert them before the call"
        )


def _described(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


# how far below a module's attribute :func:`_rebound` looks for the modules it refers to
_REBIND_DEPTH = 2
# the attributes that refer to nothing (most of a module's own: its sizes, flags and names)
_ATOMS = (type(None), bool, int, float, str)


def _rebound(value: Any, bound: dict[int, Any], made: dict[Any, Any], depth: int) -> Any:
    """``value`` (a module's attribute that is not one of its parameters, buffers or children)
    referring to what the bound tree holds in place of the modules and tensors it refers to
    (``bound``, by the original's id: each module's copy, each slot's tensor): a module or tensor
    itself (HF's rotary embedding keeps ``original_inv_freq``, its buffer under another name), a
    bound method's module, and, ``depth`` levels down, the items of a list, tuple or dict and the
    attributes of a plain object (each worked out once: ``made``; a transformers config, which
    every module of a model holds, is read once), such as torchtune's ``TiedLinear``, which holds
    the embedding whose weight the output layer reads. ``value`` itself where it refers to none."""
    if isinstance(value, (torch.nn.Module, torch.Tensor)):
        return bound.get(id(value), value)
    if isinstance(value, types.MethodType):
        owner = bound.get(id(value.__self__))
        return value if owner is None else types.MethodType(value.__func__, owner)
    container = type(value) in (list, tuple, dict)
    plain = type(getattr(value, "__dict__", None)) is dict and not isinstance(
        value, (type, types.FunctionType, types.ModuleType)
    )
    if depth == 0 or not (container or plain):
        return value
    key = (id(value), depth)
    if key not in made:
        made[key] = _rebuilt(value, bound, made, depth) if container else _rebuilt_object(value, bound, made, depth)
    return made[key]


def _rebuilt(value: Any, bound: dict[int, Any], made: dict[Any, Any], depth: int) -> Any:
    """The list, tuple or dict ``value`` with its items :func:`_rebound`: a new one where any changed."""
    keys = list(value) if type(value) is dict else range(len(value))
    items = [_rebound(value[k], bound, made, depth - 1) for k in keys]
    if all(new is value[k] for new, k in zip(items, keys)):
        return value
    return dict(zip(keys, items)) if type(value) is dict else type(value)(items)


def _rebuilt_object(value: Any, bound: dict[int, Any], made: dict[Any, Any], depth: int) -> Any:
    """The plain object ``value`` with its attributes :func:`_rebound`: a shallow copy where any changed."""
    changed = {k: new for k, v in vars(value).items() if (new := _rebound(v, bound, made, depth - 1)) is not v}
    if not changed:
        return value
    new = copy.copy(value)
    vars(new).update(changed)
    return new


def _written(
    module: torch.nn.Module, placed: list[_Placed], state: dict[str, torch.Tensor], mutable: bool, hidden: set[int]
) -> dict[str, torch.Tensor]:
    """The new values of the buffers of ``state`` that forward wrote (an :class:`ApplyError` for
    any other write, or for any write without ``mutable``): a slot that holds another tensor now,
    or whose tensor was written in place (its version counter moved, or ``hidden`` has its id)."""
    updated: dict[str, torch.Tensor] = {}
    for p in placed:
        now = _compat.module_tables(p.owner)[0 if p.slot.param else 1].get(p.slot.local)
        if now is p.tensor and _compat.tensor_version(p.tensor) == p.version and id(p.tensor) not in hidden:
            continue
        name, key = type(module).__name__, p.slot.key
        if p.slot.param:
            raise ApplyError(
                f"{name}'s forward wrote its parameter {key!r} (in place or by assignment): vsf.tree.apply's params are read-only; return a new value instead"
            )
        if not any(q.slot.key in state for q in placed if q.slot.tensor is p.slot.tensor):
            raise ApplyError(
                f"{name}'s forward wrote its buffer {key!r}, which state does not hold: pass the buffers in state "
                "(vsf.tree.from_module(model, buffers=True)) with mutable=True, and carry the updated values it returns"
            )
        if not mutable:
            raise ApplyError(
                f"{name}'s forward wrote the buffer {key!r} of state: call vsf.tree.apply(..., mutable=True), which returns "
                "(out, updated) with the new values, and carry them to the next call"
            )
        keys = [q.slot.key for q in placed if q.slot.tensor is p.slot.tensor and q.slot.key in state]
        updated[keys[0]] = now
    return updated


class _Watch(torch.overrides.TorchFunctionMode):
    """Watches the torch functions a module's forward calls: notes in ``written`` the ids of the
    tensors one writes without its schema saying so (:func:`vsf._compat.undeclared_writes`), and
    raises an :class:`ApplyError` where one checkpoints with ``use_reentrant=True``, or reads one
    of the module's own tensors that state replaces (``replaced``: their names by id), which it
    reached by a way the bound tree does not hold (a closure, a global): it would compute with
    the module's weight, not the one given, and differentiate nothing."""

    def __init__(self, name: str, replaced: dict[int, str]) -> None:
        super().__init__()
        self.name = name
        self.replaced = replaced
        self.written: set[int] = set()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        where = _compat.reentrant_checkpoint_caller(func, args)
        if where is not None:
            raise ApplyError(
                f"{self.name} checkpoints activations with torch.utils.checkpoint's use_reentrant=True (at {where}), which "
                "vsf.tree.apply cannot differentiate (its backward refuses torch.autograd.grad, and gives no gradient where a "
                "block's input needs none): use use_reentrant=False (Hugging Face: "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}))"
            )
        for arg in (*args, *kwargs.values()):
            for t in arg if type(arg) in (list, tuple) else (arg,):
                if isinstance(t, torch.Tensor) and id(t) in self.replaced:
                    raise ApplyError(
                        f"{self.name}'s forward read the module's own tensor {self.replaced[id(t)]!r} "
                        f"({_described(t)}, in {getattr(func, '__name__', func)}, "
                        "called below), not the one state gives: it reached the module by a way vsf.tree.apply does not "
                        "bind (a closure, a global, an object more than two attributes away). Hold the module as a "
                        "submodule or as an attribute of an object a module holds."
                    )
        self.written.update(id(t) for t in _compat.undeclared_writes(func, args, kwargs))
        return func(*args, **kwargs)
