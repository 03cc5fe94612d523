"""Muon: momentum whose update of each matrix is orthogonalised by a Newton-Schulz iteration.

Reference: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
https://kellerjordan.github.io/posts/muon/, and its code https://github.com/KellerJordan/Muon
(``muon.py``: ``zeropower_via_newtonschulz5``, ``muon_update``, ``MuonWithAuxAdam``). vsf follows
that update: ``m = lerp(m, g, 1 - beta)``; ``u = lerp(g, m, beta)`` (Nesterov) or ``m``; ``u``
orthogonalised by 5 steps of the quintic ``X = a X + (b A + c A^2) X``, ``A = X X^T``, with
``(a, b, c) = (3.4445, -4.7750, 2.0315)``, in bfloat16, on the wide orientation of ``u``
normalised by its Frobenius norm + 1e-7; then scaled by ``max(1, rows / cols) ** 0.5``; the
param moves by ``-lr * (u + weight_decay * p)`` (the reference decays ``p`` in place first:
equal up to rounding). Leaves that are not matrices get AdamW, with the reference's defaults.

On sharded params each matrix's update is orthogonalised on ONE rank of a mesh axis, its
owner, chosen by load balancing (largest Newton-Schulz cost first onto the least loaded rank):
the update moves to the owner by a ragged redistribution (``RaggedShard`` whose units are all
on the owner: one ragged all-to-all), is orthogonalised there, and moves back to its layout.

Example::

    >>> tx = vsf.optim.muon(0.02, adam_learning_rate=3e-4)
    >>> state = tx.init(params)                       # params ragged over fsdp, e.g. by ragged_plan
    >>> updates, state = tx.update(grads, state, params)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from vsf import tree
from vsf.ops import backend
from vsf.optim import _leaves
from vsf.optim.base import GradientTransformation, Params, Updates, chain, masked
from vsf.optim.transforms import ScalarOrSchedule, _prepare, add_decayed_weights, adamw, scale_by_learning_rate
from vsf.sharding.named import NamedSharding, sharding_of
from vsf.sharding.put import device_put, from_local
from vsf.sharding.spec import PartitionSpec, ragged

__all__ = ["NS_COEFFICIENTS", "ScaleByMuonState", "muon", "newton_schulz", "scale_by_muon"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

Hook = Callable[[int, str], None]


def newton_schulz(
    g: torch.Tensor,
    steps: int = 5,
    coefficients: Sequence[float] = NS_COEFFICIENTS,
    dtype: torch.dtype = torch.bfloat16,
    eps: float = 1e-7,
) -> torch.Tensor:
    """The Newton-Schulz orthogonalisation of the matrix ``g`` (Muon's ``zeropower``), in ``dtype``.

    Example::

        >>> o = newton_schulz(torch.randn(64, 32))     # ~ U V^T of the SVD U S V^T, singular values in ~[0.5, 1.5]
    """
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.shape[0] > g.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class ScaleByMuonState(NamedTuple):
    momentum: Updates


def scale_by_muon(
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    *,
    coefficients: Sequence[float] = NS_COEFFICIENTS,
    ns_dtype: torch.dtype = torch.bfloat16,
    axis: str | None = None,
    on_orthogonalize: Hook | None = None,
) -> GradientTransformation:
    """Muon's direction for matrices: momentum, then each matrix orthogonalised (see the module docs).

    Every leaf must be 2D. A DTensor matrix is orthogonalised on one owner rank of ``axis`` and
    moved back; without ``axis``, of the axis that splits it (its ragged axis, or its one sharded
    axis; a matrix split over several needs ``axis``). A matrix replicated on that axis, or a
    plain tensor, is orthogonalised where it is. ``on_orthogonalize(rank, key_path)`` is called
    each time a rank runs the iteration, by that rank (under simulation, once for each simulated
    rank that runs it), e.g. to count where the work happens.

    Example::

        >>> tx = vsf.optim.chain(vsf.optim.scale_by_muon(), vsf.optim.scale(-0.02))
    """
    if not 0 <= beta < 1:
        raise ValueError(f"Muon needs 0 <= beta < 1, got {beta}")

    def init(params: Params) -> ScaleByMuonState:
        ref = _leaves.flat(params)
        _leaves.check_floating(ref.leaves, ref.paths, "params")
        _check_matrices(ref)
        return ScaleByMuonState(_leaves.zeros_like(params))

    def update(
        updates: Updates, state: ScaleByMuonState, params: Params | None = None
    ) -> tuple[Updates, ScaleByMuonState]:
        step = _prepare(updates, state.momentum, "the Muon state", None)
        _check_matrices(step.ref)

        def momentum(g: list[torch.Tensor], m: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            m = torch._foreach_lerp(m, g, 1 - beta)
            return (torch._foreach_lerp(g, m, beta) if nesterov else m), m

        us, ms = _leaves.leafwise(momentum, [step.updates, step.ref.leaves], step.ref.leaves, outputs=2)

        def orthogonal(g: torch.Tensor) -> torch.Tensor:
            o = newton_schulz(g, ns_steps, coefficients, ns_dtype)
            return (o * max(1.0, g.shape[0] / g.shape[1]) ** 0.5).to(g.dtype)

        owners = _owners(us, axis)
        out = [
            _on_owner(u, owner, orthogonal, on_orthogonalize, tree.keystr(path))
            for u, owner, path in zip(us, owners, step.ref.paths)
        ]
        return step.ref.unflatten(out), ScaleByMuonState(step.ref.unflatten(ms))

    return GradientTransformation(init, update)


def _check_matrices(ref: _leaves.Flat) -> None:
    for path, leaf in zip(ref.paths, ref.leaves):
        if leaf.ndim != 2:
            raise ValueError(
                f"Muon orthogonalises matrices, but leaf {tree.keystr(path)} has shape {tuple(leaf.shape)}; mask it out (muon's mask)"
            )


class _Owner(NamedTuple):
    axis: str
    index: int


def _owners(us: Sequence[torch.Tensor], axis: str | None) -> list[_Owner | None]:
    """Each matrix's owner on its axis (``None``: it runs where it is). A matrix already whole on
    one rank of the axis is owned there (nothing moves); the others go, per axis, largest
    Newton-Schulz cost first onto the least loaded rank (ties: lower rank, earlier leaf)."""
    axes = [_owner_axis(u, axis) for u in us]
    out: list[_Owner | None] = [None] * len(us)
    for a in dict.fromkeys(x for x in axes if x is not None):
        mine = [i for i, x in enumerate(axes) if x == a]
        loads = [0] * sharding_of(us[mine[0]]).mesh.axis_size(a)
        for i in mine:
            out[i] = _holder(us[i], a)
            if out[i] is not None:
                loads[out[i].index] += _cost(us[i].shape)
        for i in sorted((i for i in mine if out[i] is None), key=lambda i: -_cost(us[i].shape)):
            r = min(range(len(loads)), key=lambda j: (loads[j], j))
            loads[r] += _cost(us[i].shape)
            out[i] = _Owner(a, r)
    return out


def _holder(u: torch.Tensor, axis: str) -> _Owner | None:
    """The rank of ``axis`` that holds all of ``u`` (ragged with all its units there, whole on the other axes)."""
    s = sharding_of(u)
    r = s.ragged
    if r is None or r.axis != axis or sum(1 for n in r.units if n) != 1 or s.spec.normalized() != PartitionSpec(r):
        return None
    return _Owner(axis, next(j for j, n in enumerate(r.units) if n))


def _cost(shape: Sequence[int]) -> int:
    """Newton-Schulz flops up to a constant: a ``k x K`` iteration (``k <= K``) costs ``~ k^2 K``."""
    k, big = sorted(shape)
    return k * k * big


def _owner_axis(u: torch.Tensor, axis: str | None) -> str | None:
    s = sharding_of(u)
    if s is None:
        return None
    if axis is not None:
        return axis if s.mesh.axis_size(axis) > 1 else None
    split = [a for d in range(u.ndim) for a in s.spec.entry_axes(d) if s.mesh.axis_size(a) > 1]
    if len(split) > 1:
        raise ValueError(
            f"a Muon update laid out as {s.spec!r} is split over {split}; pass muon(..., axis=...) to pick the owners' axis"
        )
    return split[0] if split else None


def _on_owner(
    u: torch.Tensor, owner: _Owner | None, fn: Callable[[torch.Tensor], torch.Tensor], hook: Hook | None, path: str
) -> torch.Tensor:
    """``fn(u)`` computed on ``owner`` (moved there and back), or where ``u`` is without one."""
    if owner is None:
        for r in backend.local_ranks():
            if hook is not None:
                hook(r, path)
        return _leaves.wrap(fn(_leaves.local(u)), u)
    s = sharding_of(u)
    units = tuple(int(j == owner.index) for j in range(s.mesh.axis_size(owner.axis)))
    held = NamedSharding(s.mesh, PartitionSpec(ragged(owner.axis, units)))
    whole = device_put(u, held)  # the owner's units are all of the matrix: it gets all of it (no-op if it has)

    def run(t: torch.Tensor, me: int, rank: int) -> torch.Tensor:
        if me != owner.index:
            return t
        if hook is not None:
            hook(rank, path)
        return fn(t)

    done = backend.per_rank(_leaves.local(whole), backend.axis_group(s.mesh, owner.axis), run, with_rank=True)
    return device_put(from_local(done, held, u.shape), s)


def _complement(mask: Any) -> Callable[[Any], Any]:
    def flipped(x: Any) -> Any:
        ref = _leaves.flat(x)
        return ref.unflatten([not k for k in _leaves.mask_leaves(mask, x)])

    return flipped


def _matrices(x: Any) -> Any:
    return tree.map(lambda leaf: leaf.ndim == 2, x)


def muon(
    learning_rate: ScalarOrSchedule = 0.02,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    weight_decay: float = 0.0,
    *,
    mask: Any = None,
    adam_learning_rate: ScalarOrSchedule = 3e-4,
    adam_b1: float = 0.9,
    adam_b2: float = 0.95,
    adam_eps: float = 1e-10,
    adam_weight_decay: float = 0.0,
    ns_dtype: torch.dtype = torch.bfloat16,
    axis: str | None = None,
    on_orthogonalize: Hook | None = None,
) -> GradientTransformation:
    """Muon for the matrices ``mask`` selects (default: every 2D leaf), AdamW for the others
    (Keller Jordan's ``MuonWithAuxAdam``, its defaults; see the module docs).

    ``chain(masked(chain(scale_by_muon, add_decayed_weights, scale_by_learning_rate), mask),
    masked(adamw, not mask))``. ``mask`` is a bool pytree prefix of the params or a callable
    returning one (optax's convention). ``axis`` and ``on_orthogonalize`` are
    :func:`scale_by_muon`'s: on sharded params each matrix is orthogonalised by one owner rank.

    Example::

        >>> tx = vsf.optim.muon(0.02, weight_decay=0.01, mask=lambda p: {k: "embed" not in k and v.ndim == 2 for k, v in p.items()})
    """
    select = mask if mask is not None else _matrices
    parts = [
        scale_by_muon(momentum, nesterov, ns_steps, ns_dtype=ns_dtype, axis=axis, on_orthogonalize=on_orthogonalize)
    ]
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay))
    parts.append(scale_by_learning_rate(learning_rate))
    aux = adamw(adam_learning_rate, adam_b1, adam_b2, adam_eps, adam_weight_decay)
    return chain(masked(chain(*parts), select), masked(aux, _complement(select)))
