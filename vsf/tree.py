"""Pytrees: nested dicts, lists, tuples, NamedTuples and registered dataclasses of leaves.

vsf uses optree in a namespace of its own (``"vsf"``). ``None`` is an empty node, as in JAX, so
``{"bias": None}`` has no leaves. Key paths are optree accessors; :func:`keystr` renders them in
the style a reader expects: ``blocks.0.attn.weight`` when every step is a name, JAX's
``['opt'][0].mu`` otherwise.

Example::

    >>> import torch, vsf
    >>> params = {"w": torch.ones(2, 2), "b": None, "stats": [torch.zeros(1)]}
    >>> [vsf.tree.keystr(p) for p, _ in vsf.tree.leaves_with_path(params)]
    ["['stats'][0]", 'w']
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optree
import torch
from optree import PyTreeAccessor, PyTreeSpec

from vsf import _compat
from vsf.errors import ApplyError

NAMESPACE = "vsf"

__all__ = [
    "NAMESPACE",
    "KeyPath",
    "PyTreeSpec",
    "apply",
    "broadcast_prefix",
    "flatten",
    "flatten_with_path",
    "from_module",
    "keystr",
    "leaves",
    "leaves_with_path",
    "map",
    "map_with_path",
    "register_dataclass",
    "structure",
    "unflatten",
]

KeyPath = PyTreeAccessor
T = TypeVar("T")
IsLeaf = Callable[[Any], bool] | None


def flatten(tree: Any, is_leaf: IsLeaf = None) -> tuple[list[Any], PyTreeSpec]:
    """Leaves of ``tree`` (in a fixed order; dict keys sorted) and its structure."""
    return optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def flatten_with_path(tree: Any, is_leaf: IsLeaf = None) -> tuple[list[tuple[KeyPath, Any]], PyTreeSpec]:
    """Like :func:`flatten`, with each leaf paired with its key path."""
    paths, leaves_, spec = _accessors(tree, is_leaf)
    return list(zip(paths, leaves_)), spec


def unflatten(spec: PyTreeSpec, leaves_: Sequence[Any]) -> Any:
    """Rebuild a tree of structure ``spec`` from ``leaves_``."""
    return optree.tree_unflatten(spec, leaves_)


def leaves(tree: Any, is_leaf: IsLeaf = None) -> list[Any]:
    """The leaves of ``tree``."""
    return optree.tree_leaves(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def leaves_with_path(tree: Any, is_leaf: IsLeaf = None) -> list[tuple[KeyPath, Any]]:
    """``(key path, leaf)`` pairs of ``tree``."""
    return flatten_with_path(tree, is_leaf)[0]


def structure(tree: Any, is_leaf: IsLeaf = None) -> PyTreeSpec:
    """The structure (treedef) of ``tree``."""
    return optree.tree_structure(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def map(f: Callable[..., Any], tree: Any, *rest: Any, is_leaf: IsLeaf = None) -> Any:  # noqa: A001
    """Apply ``f`` to the leaves of ``tree`` (and the matching leaves of each of ``rest``)."""
    return optree.tree_map(f, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def map_with_path(f: Callable[..., Any], tree: Any, *rest: Any, is_leaf: IsLeaf = None) -> Any:
    """Like :func:`map`, calling ``f(path, leaf, *other_leaves)``; render ``path`` with :func:`keystr`."""
    return optree.tree_map_with_accessor(f, tree, *rest, is_leaf=is_leaf, namespace=NAMESPACE)


def _accessors(tree: Any, is_leaf: IsLeaf) -> tuple[list[KeyPath], list[Any], PyTreeSpec]:
    return optree.tree_flatten_with_accessor(tree, is_leaf=is_leaf, namespace=NAMESPACE)


_NAMED_ENTRIES = (optree.NamedTupleEntry, optree.DataclassEntry, optree.GetAttrEntry)


def keystr(path: KeyPath | Sequence[Any], *, brackets: bool = False) -> str:
    """Render a key path: ``blocks.0.attn.weight`` if every step is a name, else ``['opt'][0].mu``
    (always the latter with ``brackets=True``, e.g. to follow ``args[0]``).

    Example::

        >>> paths = [p for p, _ in vsf.tree.leaves_with_path({"opt": [torch.ones(1)]})]
        >>> vsf.tree.keystr(paths[0])
        "['opt'][0]"
    """
    entries = tuple(path)
    if not entries:
        return "" if brackets else "<root>"
    if not brackets and all(_is_name(e) for e in entries):
        return ".".join(e.entry if isinstance(e, optree.MappingEntry) else _field(e) for e in entries)
    return "".join(_bracket(e) for e in entries)


def _is_name(entry: Any) -> bool:
    if isinstance(entry, optree.MappingEntry):
        return isinstance(entry.entry, str)
    return isinstance(entry, _NAMED_ENTRIES)


def _field(entry: Any) -> str:
    return entry.field if isinstance(entry, optree.NamedTupleEntry) else entry.name


def _bracket(entry: Any) -> str:
    if isinstance(entry, _NAMED_ENTRIES):
        return f".{_field(entry)}"
    if isinstance(entry, (optree.MappingEntry, optree.SequenceEntry)):
        return f"[{entry.entry!r}]"
    return f"[{entry!r}]"


def register_dataclass(cls: type[T], *, data_fields: Sequence[str] | None = None) -> type[T]:
    """Register a dataclass as a pytree node: ``data_fields`` are children, other fields metadata.

    Usable as a decorator. By default every field is a child.

    Example::

        >>> @vsf.tree.register_dataclass
        ... @dataclasses.dataclass
        ... class State:
        ...     mu: torch.Tensor
        ...     count: torch.Tensor
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_dataclass expects a dataclass type, got {cls!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    children = list(names if data_fields is None else data_fields)
    unknown = set(children) - set(names)
    if unknown:
        raise ValueError(f"data_fields {sorted(unknown)} are not fields of {cls.__name__} (fields: {names})")
    meta = [n for n in names if n not in children]

    def flatten_fn(obj: Any) -> tuple[list[Any], tuple[Any, ...], list[str]]:
        return [getattr(obj, n) for n in children], tuple(getattr(obj, n) for n in meta), children

    def unflatten_fn(aux: tuple[Any, ...], kids: Sequence[Any]) -> Any:
        return cls(**dict(zip(children, kids)), **dict(zip(meta, aux)))

    optree.register_pytree_node(
        cls, flatten_fn, unflatten_fn, namespace=NAMESPACE, path_entry_type=optree.DataclassEntry
    )
    return cls


def broadcast_prefix(prefix: Any, tree: Any, *, is_leaf: Callable[[Any], bool], what: str = "prefix") -> list[Any]:
    """Expand ``prefix`` (a tree whose leaves satisfy ``is_leaf``) to one value per leaf of ``tree``.

    A prefix leaf applies to the whole subtree at its position (JAX's rule for ``in_shardings``).
    A mismatch raises ``ValueError`` naming the key path where the structures differ.
    """
    out: list[Any] = []
    _broadcast(prefix, tree, is_leaf, (), out, what)
    return out


def _broadcast(
    prefix: Any, tree: Any, is_leaf: Callable[[Any], bool], path: tuple[Any, ...], out: list[Any], what: str
) -> None:
    if is_leaf(prefix):
        out.extend([prefix] * len(leaves(tree)))
        return
    if optree.tree_is_leaf(tree, namespace=NAMESPACE):
        raise ValueError(
            f"{what} is not a prefix of the value tree at {keystr(path)}: the value there is the leaf "
            f"{_short(tree)}, so {what} needs a single entry there, but has {type(prefix).__name__} {_short(prefix)}"
        )
    p_entries, p_children = _children(prefix)
    t_entries, t_children = _children(tree)
    p_keys, t_keys = [_entry_key(e) for e in p_entries], [_entry_key(e) for e in t_entries]
    if type(prefix) is not type(tree) or p_keys != t_keys:
        raise ValueError(
            f"{what} is not a prefix of the value tree at {keystr(path)}: expected "
            f"{type(tree).__name__} with keys {t_keys}, found {type(prefix).__name__} with keys {p_keys}"
        )
    for entry, p_child, t_child in zip(t_entries, p_children, t_children):
        _broadcast(p_child, t_child, is_leaf, path + (entry,), out, what)


def _children(node: Any) -> tuple[list[Any], list[Any]]:
    paths, kids, _ = optree.tree_flatten_with_accessor(node, is_leaf=lambda x: x is not node, namespace=NAMESPACE)
    return [p[0] for p in paths], kids


def _entry_key(entry: Any) -> Any:
    return _field(entry) if isinstance(entry, _NAMED_ENTRIES) else entry.entry


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor{list(x.shape)}"
    text = repr(x)
    return text if len(text) < 60 else text[:57] + "..."


def from_module(module: torch.nn.Module, *, params: bool = True, buffers: bool = False) -> dict[str, torch.Tensor]:
    """A module's parameters (and, with ``buffers=True``, its buffers) as a flat dict; with
    ``params=False`` its buffers alone.

    Keys are the module's own names (``"blocks.0.attn.qkv.weight"``); values are detached
    tensors, so the pytree is plain data that :func:`apply` feeds back to the module.

    Example::

        >>> model = torch.nn.BatchNorm1d(2)
        >>> sorted(vsf.tree.from_module(model))
        ['bias', 'weight']
        >>> sorted(vsf.tree.from_module(model, params=False, buffers=True))
        ['num_batches_tracked', 'running_mean', 'running_var']
    """
    named = dict(module.named_parameters()) if params else {}
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
    :class:`~vsf.errors.ApplyError`), so activation checkpointing
    (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, Hugging Face's ``gradient_checkpointing_enable()``) recomputes with them in the backward too.
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
    return copies[id(module)], placed


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
                        f"({str(t.dtype).removeprefix('torch.')}{list(t.shape)}, in {getattr(func, '__name__', func)}, "
                        "called below), not the one state gives: it reached the module by a way vsf.tree.apply does not "
                        "bind (a closure, a global, an object more than two attributes away). Hold the module as a "
                        "submodule or as an attribute of an object a module holds."
                    )
        self.written.update(id(t) for t in _compat.undeclared_writes(func, args, kwargs))
        return func(*args, **kwargs)
