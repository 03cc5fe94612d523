"""Expert parallelism: a mixture-of-experts layer whose experts are split over a mesh axis, with
the tokens sent to the experts' ranks and back (all-to-all dispatch and combine with the counts
routing gives each step) instead of the experts' weights gathered to the tokens.

:func:`expert_parallel` is one ``vsf.shard_map`` region, manual over the token axes (which include
the expert axis): on each rank its tokens' copies (one per chosen expert) are sorted by expert, the
per-expert counts are all-gathered over the expert axis (``n x experts`` integers), the rows go to
the ranks holding their experts (:func:`vsf.ops.all_to_all_counted`), each rank runs its local
experts on the rows it received, grouped by expert (``experts(rows, offsets, *weights)``, e.g.
``torch.nn.functional.grouped_mm``), and the results go back by the transposed exchange, to be
weighted by the router's gates and summed per token. The backward is the same exchanges reversed.
Inside ``vsf.jit`` the plan lists the exchanges (``all_to_all_v`` over the expert axis) and moves
no expert weight over that axis.

Example::

    >>> def experts(rows, offsets, w_in, w_out):
    ...     h = F.grouped_mm(rows, w_in.transpose(1, 2), offs=offsets)
    ...     return F.grouped_mm(F.silu(h), w_out.transpose(1, 2), offs=offsets)
    >>> y = vsf.nn.expert_parallel(experts, x, top_k_index, top_k_weights, (w_in, w_out), axis="ep", token_axes=("dp", "ep"))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vsf import ops
from vsf.func import shard_map
from vsf.sharding.mesh import Mesh, current_mesh
from vsf.sharding.spec import P

__all__ = ["expert_parallel"]


def expert_parallel(
    experts: Callable[..., torch.Tensor],
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: Sequence[torch.Tensor],
    *,
    axis: str,
    token_axes: Sequence[str] | None = None,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """The routed experts' output for each token, ``sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(x[t])``,
    with the experts split over mesh axis ``axis`` and the tokens sent to them.

    ``x``: the tokens ``[tokens, hidden]``; ``top_k_index`` / ``top_k_weights``: each token's chosen
    experts and their gates ``[tokens, k]``; ``weights``: the experts' weights, each with the expert
    dim first (``[experts, ...]``), split over ``axis`` on it (``P(axis)``); ``experts(rows,
    offsets, *local_weights)``: the local experts on ``rows`` grouped by expert, expert ``e``'s rows
    ending at ``offsets[e]`` (int32, ``grouped_mm``'s convention; rows past the last offset are
    padding, zero in and ignored out). ``token_axes``: the mesh axes the tokens are split over (dim
    0, major to minor; default ``(axis,)``), which must include ``axis``: each rank routes its own
    tokens. The buffer each rank receives into holds ``n * tokens * k`` rows for its share of the
    tokens (no token is ever dropped: every rank may route all its tokens to one rank's experts).

    Example::

        >>> y = vsf.nn.expert_parallel(experts, x, idx, gates, (w_in, w_out), axis="ep", token_axes=("dp", "ep"))
    """
    tokens = tuple(token_axes) if token_axes is not None else (axis,)
    if axis not in tokens:
        raise ValueError(f"expert_parallel: token_axes {tokens!r} must include the expert axis {axis!r} (each rank of it routes its own tokens)")
    m = mesh if mesh is not None else current_mesh()
    if m is None:
        raise ValueError("expert_parallel needs a mesh: pass mesh=... or call it inside `with vsf.use_mesh(mesh):`")
    n = m.axis_size(axis)
    for i, w in enumerate(weights):
        if w.shape[0] % n:
            raise ValueError(f"expert_parallel: weights[{i}] has {w.shape[0]} experts (dim 0), which {axis!r} of size {n} does not divide")
    split = P(tokens)

    def body(x: torch.Tensor, index: torch.Tensor, gates: torch.Tensor, *local: torch.Tensor) -> torch.Tensor:
        return _routed(experts, x, index, gates, local, axis, n)

    region = shard_map(body, mesh=m, in_specs=(split, split, split, *(P(axis) for _ in weights)), out_specs=split, axis_names=tokens)
    return region(x, top_k_index, top_k_weights, *weights)


def _routed(experts: Callable[..., torch.Tensor], x: torch.Tensor, index: torch.Tensor, gates: torch.Tensor,
            local: tuple[torch.Tensor, ...], axis: str, n: int) -> torch.Tensor:
    """One rank's part: dispatch its token copies, run its experts, combine (see the module docs)."""
    t, k = index.shape
    per_rank = local[0].shape[0]
    rows, capacity = t * k, n * t * k
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, so by the rank that holds it
    sent = x[order // k]
    mine = (flat[:, None] == torch.arange(n * per_rank, device=flat.device)).sum(0)
    table = ops.all_gather(mine[None], axis).view(n, n, per_rank)  # [source, destination, its expert]
    by_rank = table.sum(-1)
    got = ops.all_to_all_counted(sent, by_rank, axis, capacity)
    # the received rows are grouped by source, then by expert: which local expert each one is for
    here = table.index_select(1, ops.axis_index(axis).reshape(1)).reshape(n * per_rank)
    ends = torch.cumsum(here, 0).clamp(max=capacity)  # row r is in segment #(ends <= r): searchsorted, as a scatter and a cumsum
    segment = torch.zeros(capacity + 1, dtype=ends.dtype, device=ends.device).scatter_add(0, ends, torch.ones_like(ends)).cumsum(0)[:capacity]
    expert = torch.where(segment < n * per_rank, segment % per_rank, per_rank)
    regroup = torch.argsort(expert, stable=True)
    offsets = torch.cumsum(here.view(n, per_rank).sum(0), 0).to(torch.int32)
    valid = (torch.arange(capacity, device=flat.device) < offsets[-1])[:, None]
    out = experts(torch.where(valid, got[regroup], 0.0), offsets, *local)
    out = torch.where(valid, out, 0.0)[torch.argsort(regroup)]
    back = ops.all_to_all_counted(out, by_rank.T, axis, rows)[torch.argsort(order)]
    return (back.view(t, k, -1) * gates[..., None]).sum(1).to(x.dtype)
