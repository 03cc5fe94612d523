"""Why a jitted function planned again: the first difference between the cache keys of two calls
(tree structure, leaves' shapes, dtypes and shardings, static arguments, mesh, the inputs torch
autograd differentiates, the plan's switches ``vsf.config.plan_options``), in the words
``Jitted.replans`` and the ``vsf.jit`` logger show.

Example::

    >>> step(params, batch); step(params, bigger_batch)
    >>> vsf.config.bucket_bytes = 2**20; step(params, bigger_batch)
    >>> step.replans
    ['first call', "args[1]: shape changed, i64[8,32] -> i64[16,32]", 'options changed: vsf.config.bucket_bytes 4194304 -> 1048576']
"""

from __future__ import annotations

from typing import Any

from vsf.sharding.inspect import type_string

__all__ = ["replan_reason"]


def replan_reason(old: tuple[Any, ...] | None, new: tuple[Any, ...], names: list[str]) -> str:
    """Why a call whose cache key is ``new`` re-plans after the call keyed ``old`` (``None``: the
    first call): the first difference, in words (``names``: the argument leaves').

    Example::

        >>> replan_reason(key_before, key_now, ["args[0]['w']", "args[1]"])
        "args[1]: shape changed, f32[8,4] -> f32[16,4]"
    """
    if old is None:
        return "first call"
    if old[0] != new[0]:
        return f"argument structure changed: {old[0]} -> {new[0]}"
    if old[3] != new[3]:
        return f"mesh changed: {old[3]!r} -> {new[3]!r}"
    if old[2] != new[2]:
        return f"static arguments changed: {old[2]} -> {new[2]}"
    if old[5] != new[5]:
        return f"options changed: {', '.join(old[5].changed(new[5]))}"
    if old[4] != new[4]:
        wrt = lambda g: ", ".join(n for n, m in zip(names, g or ()) if m is not None) or "none"  # noqa: E731
        return f"inputs differentiated by torch autograd changed: {wrt(old[4])} -> {wrt(new[4])}"
    for name, a, b in zip(names, old[1], new[1]):
        if a != b:
            changed = [
                w
                for w, x, y in (
                    ("shape", a[0], b[0]),
                    ("dtype", a[1], b[1]),
                    ("sharding", a[2], b[2]),
                    ("kind", a[3], b[3]),
                )
                if x != y
            ]
            return f"{name}: {' and '.join(changed)} changed, {type_string(a[0], a[1], old[3], a[2])} -> {type_string(b[0], b[1], new[3], b[2])}"
    return "cache miss"
