"""Cases and oracles shared by the simulated tests and the gloo workers of vsf.ops / RaggedShard.

Each collective case is its definition on the list of every group member's tensor, in plain
torch; gradients come from torch.autograd over that list, with the objective
``sum over ranks of (w_r * y_r).sum()`` (the convention vsf.ops documents).
"""

from __future__ import annotations

import itertools
import math
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for layout_oracle under torchrun

import vsf  # noqa: E402
from layout_oracle import coordinate, expected_shard  # noqa: E402
from vsf import _compat  # noqa: E402
from vsf.sharding.ragged import RaggedShard, ragged, reshard  # noqa: E402

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Case:
    """A collective over mesh ``axes`` (major to minor)."""

    name: str
    axes: tuple[str, ...]
    shape: Callable[[int], tuple[int, ...]]  # local input shape of the member at this index
    run: Callable[[torch.Tensor], torch.Tensor]  # the vsf call, under vsf.use_mesh
    oracle: Callable[[Tensors], Tensors]  # every member's output from every member's input
    ragged: bool = False


def _chunks(x: torch.Tensor, n: int, dim: int) -> Tensors:
    return list(torch.chunk(x, n, dim))


def collective_cases(b: int) -> list[Case]:
    """Cases over a mesh ``{"a": 2, "b": b}``."""
    ab = 2 * b
    sizes = tuple([1, 0, 3, 2][:b])
    counts = [[(i + 2 * j) % 3 for j in range(b)] for i in range(b)]

    def a2a(split: int, concat: int) -> Callable[[Tensors], Tensors]:
        return lambda xs: [torch.cat([_chunks(x, len(xs), split)[j] for x in xs], concat) for j in range(len(xs))]

    def permuted(perm: list[tuple[int, int]]) -> Callable[[Tensors], Tensors]:
        def oracle(xs: Tensors) -> Tensors:
            got = {d: xs[s] for s, d in perm}
            return [got[j] if j in got else torch.zeros_like(xs[j]) for j in range(len(xs))]

        return oracle

    cycle = [(i, (i + 1) % b) for i in range(b)]
    partial = [(0, b - 1)]
    return [
        Case("psum_b", ("b",), lambda i: (3, 2), lambda x: vsf.ops.psum(x, "b"), lambda xs: [sum(xs)] * len(xs)),
        Case(
            "psum_ab",
            ("a", "b"),
            lambda i: (3, 2),
            lambda x: vsf.ops.psum(x, ("a", "b")),
            lambda xs: [sum(xs)] * len(xs),
        ),
        Case(
            "all_gather_b_dim1",
            ("b",),
            lambda i: (2, 3),
            lambda x: vsf.ops.all_gather(x, "b", 1),
            lambda xs: [torch.cat(xs, 1)] * len(xs),
        ),
        Case(
            "all_gather_b_untiled",
            ("b",),
            lambda i: (2, 3),
            lambda x: vsf.ops.all_gather(x, "b", 0, tiled=False),
            lambda xs: [torch.stack(xs)] * len(xs),
        ),
        Case(
            "all_gather_ba",
            ("b", "a"),
            lambda i: (2, 3),
            lambda x: vsf.ops.all_gather(x, ("b", "a")),
            lambda xs: [torch.cat(xs)] * len(xs),
        ),
        Case(
            "psum_scatter_b_dim1",
            ("b",),
            lambda i: (4, 2 * b),
            lambda x: vsf.ops.psum_scatter(x, "b", 1),
            lambda xs: _chunks(sum(xs), len(xs), 1),
        ),
        Case(
            "psum_scatter_ab",
            ("a", "b"),
            lambda i: (2 * ab, 3),
            lambda x: vsf.ops.psum_scatter(x, ("a", "b")),
            lambda xs: _chunks(sum(xs), len(xs), 0),
        ),
        Case(
            "psum_scatter_untiled",
            ("b",),
            lambda i: (b, 2),
            lambda x: vsf.ops.psum_scatter(x, "b", 0, tiled=False),
            lambda xs: list(sum(xs).unbind(0)),
        ),
        Case("all_to_all_0_1", ("b",), lambda i: (2 * b, 3), lambda x: vsf.ops.all_to_all(x, "b", 0, 1), a2a(0, 1)),
        Case("all_to_all_2_0", ("b",), lambda i: (3, 2, b), lambda x: vsf.ops.all_to_all(x, "b", 2, 0), a2a(2, 0)),
        Case("all_to_all_1_1", ("b",), lambda i: (3, b, 2), lambda x: vsf.ops.all_to_all(x, "b", 1, 1), a2a(1, 1)),
        Case("ppermute_cycle", ("b",), lambda i: (2, 2), lambda x: vsf.ops.ppermute(x, "b", cycle), permuted(cycle)),
        Case(
            "ppermute_partial", ("b",), lambda i: (2, 2), lambda x: vsf.ops.ppermute(x, "b", partial), permuted(partial)
        ),
        all_gather_v_case(sizes, 0),
        all_gather_v_case(sizes, 1),
        reduce_scatter_v_case(sizes, 0),
        reduce_scatter_v_case(sizes, 1),
        all_to_all_v_case(counts),
    ]


def all_gather_v_case(sizes: Sequence[int], dim: int) -> Case:
    """Member ``i`` holds ``sizes[i]`` slices along ``dim`` of a ``(2, *, 3)`` tensor."""
    return Case(
        f"all_gather_v_dim{dim}_{sizes}",
        ("b",),
        lambda i: (2, 3)[:dim] + (sizes[i],) + (2, 3)[dim:],
        lambda x: vsf.ops.all_gather_v(x, "b", sizes, dim),
        lambda xs: [torch.cat(xs, dim)] * len(xs),
        ragged=True,
    )


def reduce_scatter_v_case(sizes: Sequence[int], dim: int) -> Case:
    return Case(
        f"reduce_scatter_v_dim{dim}_{sizes}",
        ("b",),
        lambda i: (2, 3)[:dim] + (sum(sizes),) + (2, 3)[dim:],
        lambda x: vsf.ops.reduce_scatter_v(x, "b", sizes, dim),
        lambda xs: list(torch.split(sum(xs), list(sizes), dim)),
        ragged=True,
    )


def all_to_all_v_case(counts: Sequence[Sequence[int]]) -> Case:
    return Case(
        f"all_to_all_v_{counts}",
        ("b",),
        lambda i: (sum(counts[i]), 2),
        lambda x: vsf.ops.all_to_all_v(x, "b", counts),
        lambda xs: [torch.cat([torch.split(x, list(counts[i]))[j] for i, x in enumerate(xs)]) for j in range(len(xs))],
        ragged=True,
    )


def groups(mesh: vsf.Mesh, axes: tuple[str, ...]) -> list[list[int]]:
    """Ranks that communicate over ``axes`` (major to minor), each group in collective order."""
    others = [a for a in mesh.axis_names if a not in axes]
    out: dict[tuple[int, ...], list[int]] = {}
    for r in mesh.devices:
        out.setdefault(tuple(mesh.coordinate(r)[a] for a in others), []).append(r)
    return [sorted(g, key=lambda r: tuple(mesh.coordinate(r)[a] for a in axes)) for g in out.values()]


def member_index(mesh: vsf.Mesh, axes: tuple[str, ...], rank: int) -> int:
    coord = mesh.coordinate(rank)
    index = 0
    for a in axes:
        index = index * mesh.axis_size(a) + coord[a]
    return index


def inputs_and_weights(
    case: Case, mesh: vsf.Mesh, seed: int
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Every rank's input, and every rank's weights for the objective (same on every process)."""
    gen = torch.Generator().manual_seed(seed)
    xs = {r: torch.randn(case.shape(member_index(mesh, case.axes, r)), generator=gen) for r in mesh.devices}
    outs = expected(case, mesh, xs)
    return xs, {r: torch.randn(outs[r].shape, generator=gen) for r in mesh.devices}


def expected(case: Case, mesh: vsf.Mesh, xs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    out = {}
    for g in groups(mesh, case.axes):
        out.update(zip(g, case.oracle([xs[r] for r in g])))
    return out


def expected_grads(
    case: Case, mesh: vsf.Mesh, xs: dict[int, torch.Tensor], ws: dict[int, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """d/dx_r of sum_r (w_r * y_r).sum(), by torch.autograd over the oracle."""
    leaves = {r: x.clone().requires_grad_() for r, x in xs.items()}
    ys = expected(case, mesh, leaves)
    objective = sum((ws[r] * ys[r]).sum() for r in ys) + sum(0 * x.sum() for x in leaves.values())
    return dict(zip(leaves, torch.autograd.grad(objective, list(leaves.values()))))


def check_on_rank(case: Case, mesh: vsf.Mesh, rank: int, device: str = "cpu") -> dict[str, bool]:
    """Run ``case`` on this process's rank (real processes); does its value and gradient match?"""
    xs, ws = inputs_and_weights(case, mesh, seed=0)
    x = xs[rank].to(device).requires_grad_()
    y = case.run(x)
    (ws[rank].to(device) * y).sum().backward()
    return {
        "value": all_close(y.detach().cpu(), expected(case, mesh, xs)[rank]),
        "grad": all_close(x.grad.cpu(), expected_grads(case, mesh, xs, ws)[rank]),
    }


def as_local(values: dict[int, torch.Tensor]) -> torch.Tensor:
    """A simulated tensor holding ``values[r]`` on rank ``r``."""
    with _compat.local_mode_disabled():
        return _compat.make_local({r: v.clone() for r, v in values.items()})


def per_rank(t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Every simulated rank's value of ``t``."""
    with _compat.local_mode_disabled():
        return {r: v.clone() for r, v in _compat.local_shards(t, 0).items()}


def check_simulated(case: Case, mesh: vsf.Mesh) -> None:
    """``case.run`` under simulation equals the oracle on every rank, in value and gradient."""
    with _compat.local_mode_disabled():  # the oracle runs on plain tensors
        xs, ws = inputs_and_weights(case, mesh, seed=0)
        want, want_grads = expected(case, mesh, xs), expected_grads(case, mesh, xs, ws)
    x = as_local(xs).requires_grad_()
    y = case.run(x)
    got = per_rank(y)
    (as_local(ws) * y).sum().backward()
    grads = per_rank(x.grad)
    for r in mesh.devices:
        torch.testing.assert_close(got[r], want[r], atol=1e-5, rtol=1e-5, msg=f"{case.name}: value on rank {r}")
        torch.testing.assert_close(
            grads[r], want_grads[r], atol=1e-5, rtol=1e-5, msg=f"{case.name}: gradient on rank {r}"
        )


# -- RaggedShard ------------------------------------------------------------------------------------------


def _ragged_rows(full: torch.Tensor, layout: RaggedShard, index: int) -> tuple[torch.Tensor, slice]:
    rows = full.reshape(-1, *full.shape[layout.dims :])
    per_unit = rows.shape[0] // sum(layout.units)
    bounds = [0, *itertools.accumulate(u * per_unit for u in layout.units)]
    return rows, slice(bounds[index], bounds[index + 1])


def zero_filled(full: torch.Tensor, layout: RaggedShard, index: int) -> torch.Tensor:
    """``full`` with every row but rank ``index``'s zeroed."""
    rows, mine = _ragged_rows(full, layout, index)
    out = torch.zeros_like(rows)
    out[mine] = rows[mine]
    return out.reshape(full.shape)


def expected_piece(full: torch.Tensor, layout, index: int, n: int) -> torch.Tensor:
    """Rank ``index``'s piece, computed from the definitions (not from vsf's layout code)."""
    if isinstance(layout, RaggedShard):
        rows, mine = _ragged_rows(full, layout, index)
        return rows[mine]
    if isinstance(layout, Shard):
        pieces = torch.chunk(full, n, layout.dim)
        return pieces[index] if index < len(pieces) else full.narrow(layout.dim, 0, 0)
    return full


def expected_local(
    full: torch.Tensor, sizes: Sequence[int], names: Sequence[str], entries: Sequence[object], rank: int
) -> torch.Tensor:
    """``rank``'s local tensor under a spec whose first entry may be a RaggedShard: its rows of
    the flattened leading dims, then the later dims cut by ``torch.chunk`` (layout_oracle)."""
    first = entries[0] if entries else None
    if not isinstance(first, RaggedShard) or dict(zip(names, sizes))[first.axis] == 1:
        return expected_shard(full, sizes, names, [None if isinstance(e, RaggedShard) else e for e in entries], rank)
    index = coordinate(sizes, names, rank)[first.axis]
    rows = expected_piece(full, first, index, len(first.units))
    return expected_shard(rows, sizes, names, [None, *entries[first.dims :]], rank)


def ragged_case(
    draw_int: Callable[[int, int], int], n: int, axis: str
) -> tuple[tuple[int, ...], RaggedShard, RaggedShard, int]:
    """A shape, two ragged layouts of it over ``axis`` (any dims, block, units with zeros) and a
    Shard dim; ``draw_int(lo, hi)`` draws an int in ``[lo, hi]`` (hypothesis or ``random``)."""
    ndim = draw_int(1, 4)

    def layout() -> RaggedShard:
        units = [draw_int(0, 3) for _ in range(n)]
        units[draw_int(0, n - 1)] += 1  # never all zero
        return ragged(axis, units, dims=draw_int(1, ndim), block=draw_int(1, 2))

    r1, r2 = layout(), layout()
    # dim 0 alone is divisible by both layouts' block * sum(units), so any flattening splits evenly
    rows = math.lcm(r1.block * sum(r1.units), r2.block * sum(r2.units)) * draw_int(1, 2)
    shape = (rows, *(draw_int(1, 3) for _ in range(ndim - 1)))
    return shape, r1, r2, draw_int(0, ndim - 1)


def seeded(seed: int) -> Callable[[int, int], int]:
    return random.Random(seed).randint


def reshard_case(shape: tuple[int, ...], src, dst, axis: str, n: int) -> Case:
    """``reshard`` from ``src`` to ``dst`` over ``axis`` (of size ``n``). The oracle rebuilds the
    value each rank's output is a piece of: a rank's own copy (Replicate), the sum of the ranks'
    values (Partial), or the ranks' pieces put together (Shard, RaggedShard)."""

    def oracle(xs: Tensors) -> Tensors:
        if isinstance(src, Replicate):
            fulls = xs
        elif isinstance(src, Partial):
            fulls = [sum(xs)] * n
        elif isinstance(src, Shard):
            fulls = [torch.cat(xs, src.dim)] * n
        else:
            fulls = [torch.cat(xs).reshape(shape)] * n
        if isinstance(dst, Partial):  # vsf's choice: each rank keeps its own rows, zeros elsewhere
            return [zero_filled(fulls[j], src, j) for j in range(n)]
        return [expected_piece(fulls[j], dst, j, n) for j in range(n)]

    def local_shape(i: int) -> tuple[int, ...]:
        return tuple(expected_piece(torch.empty(shape), src, i, n).shape)

    return Case(f"reshard {src} -> {dst} {shape}", (axis,), local_shape, lambda x: reshard(x, shape, src, dst), oracle)


def all_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def payload_bytes(sizes: Sequence[int], me: int, row_bytes: int) -> int:
    """What a rank must send in a ragged all-gather: its rows to each of the other ranks."""
    return (len(sizes) - 1) * sizes[me] * row_bytes
