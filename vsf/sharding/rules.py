"""Choosing specs by rule: key-path regexes for parameter trees, logical axis names for model code."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from vsf import tree
from vsf.sharding.spec import PartitionSpec

__all__ = ["logical_to_mesh", "match"]

Rule = tuple[str, PartitionSpec]


def match(values: Any, rules: Sequence[Rule]) -> Any:
    """A spec pytree for ``values``: each leaf gets the spec of the first rule whose regex matches
    its whole key path (``vsf.tree.keystr``; use ``.*`` to match a suffix).

    A leaf that no rule matches is an error listing every such leaf, so a new parameter never
    silently ends up replicated. A spec longer than its leaf's rank is an error too.

    Example::

        >>> specs = vsf.sharding.match(params, [
        ...     (r".*attn\\.qkv\\.weight", P("tp", "fsdp")),
        ...     (r".*", P()),
        ... ])
    """
    compiled = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[1], PartitionSpec)):
            raise TypeError(f"rule {i} must be a (regex, P) pair, got {rule!r}")
        try:
            compiled.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
            raise ValueError(f"rule {i} has an invalid regex {rule[0]!r}: {e}") from None
    pairs, treedef = tree.flatten_with_path(values)
    out, unmatched = [], []
    for path, leaf in pairs:
        name = tree.keystr(path)
        spec = next((s for rx, s in compiled if rx.fullmatch(name)), None)
        if spec is None:
            unmatched.append(name)
            continue
        ndim = getattr(leaf, "ndim", 0)
        if len(spec) > ndim:
            raise ValueError(
                f"rule spec {spec!r} matched {name}, which has rank {ndim} (shape {tuple(getattr(leaf, 'shape', ()))})"
            )
        out.append(spec)
    if unmatched:
        raise ValueError(
            f"no rule matches {len(unmatched)} leaves: {unmatched}; add a rule (e.g. (r'.*', P())) for them"
        )
    return tree.unflatten(treedef, out)


def logical_to_mesh(
    logical_axes: Sequence[str | None], rules: Sequence[tuple[str, str | tuple[str, ...] | None]]
) -> PartitionSpec:
    """Map logical dimension names to a spec, with flax's ``logical_to_mesh_axes`` meaning.

    ``rules`` are ``(logical name, mesh axes)`` pairs in order of precedence. Each rule, in
    order, claims the dimension of that logical name if the dimension is still unassigned and
    none of the rule's mesh axes is used yet; a rule with mesh axes ``None`` pins its dimension
    to unsharded. Dimensions no rule claims (and ``None`` names) are unsharded. A logical name
    used for two dimensions is an error.

    Example::

        >>> rules = [("batch", ("dp", "fsdp")), ("embed", "tp"), ("mlp", "tp")]
        >>> vsf.sharding.logical_to_mesh(("batch", "seq", "embed"), rules)
        P(('dp', 'fsdp'), None, 'tp')
        >>> vsf.sharding.logical_to_mesh(("embed", "mlp"), [("mlp", "tp"), ("embed", "tp")])
        P(None, 'tp')
    """
    names = tuple(logical_axes)
    repeated = sorted({n for n in names if n is not None and names.count(n) > 1})
    if repeated:
        raise ValueError(f"logical axes {names} name {repeated} for more than one dimension")
    unassigned = object()
    assigned: list[Any] = [unassigned if n is not None else None for n in names]
    used: set[str] = set()
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise TypeError(f"logical rule {i} must be a (logical name, mesh axes) pair, got {rule!r}")
        logical, mesh_axes = rule
        axes = () if mesh_axes is None else (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        if logical not in names:
            continue
        dim = names.index(logical)
        if assigned[dim] is unassigned and used.isdisjoint(axes):
            assigned[dim] = mesh_axes
            used.update(axes)
    return PartitionSpec(*(None if a is unassigned else a for a in assigned))
