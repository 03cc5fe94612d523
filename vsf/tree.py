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

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import optree
import torch
from optree import PyTreeAccessor, PyTreeSpec

from vsf.modules import apply, from_module

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
