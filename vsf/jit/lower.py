"""Lowering a plan to a program over local shards.

:func:`execute` walks the planned graph on this rank's local tensors: before each op it
redistributes every input to the placement the plan chose (once per value and placement, with
DTensor's own redistribution, i.e. explicit collectives), then runs the op. Most ops run as they
are on the local shards; view ops (whose shape arguments must become local), random ops and the
few ops DTensor handles specially run through DTensor's dispatcher, and must produce the plan's
placements; a ``shard_map`` region's collectives run over its manual axes (:mod:`vsf.jit.manual`). Under ``vsf.simulate`` the walk runs as is (every simulated rank at once), and
:mod:`vsf.jit.replay` records the plain ops it runs for each rank once and replays them; in a
real run it is traced once with ``make_fx`` into an fx graph of local aten ops and functional
collectives, which is what each step then runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from vsf import _compat
from vsf.errors import PlanMismatch
from vsf.jit import context_parallel, manual, packed
from vsf.jit.graph import Value, is_tensor_node, meta_of, output_node, placeholders_of, value_of
from vsf.jit.plan import Bucket, Placements, Plan, Redistribution, as_contiguous
from vsf.jit.redistribute import move_local, transition_path
from vsf.ops.backend import local_ranks

__all__ = ["compile_local", "execute"]

aten = torch.ops.aten


def _replicated(t: torch.Tensor) -> torch.Tensor:
    """A value every rank holds whole, as a local tensor of this run: one per simulated rank, every
    rank of the simulation (each computes every op, a program on a sub-mesh's too, such as a
    pipeline stage's: a copy for the plan's ranks alone failed the first op it met)."""
    if _compat.active_local_mode() is not None and not _compat.is_local_tensor(t):
        return _compat.make_local(dict.fromkeys(local_ranks(), t))
    return t


def execute(
    plan: Plan, inputs: Sequence[torch.Tensor], check: Callable[[torch.fx.Node, list[Any]], None] | None = None
) -> list[torch.Tensor]:
    """Run ``plan`` on local shards laid out as ``plan.inputs``; return local shards laid out as ``plan.outputs``.

    ``check`` (checking mode, :class:`vsf.jit.check.Checker`) is called after each op with the op's
    local results.
    """
    gm = plan.graph
    dm = plan.mesh.device_mesh
    env: dict[Value, torch.Tensor] = {(ph, 0): x for ph, x in zip(placeholders_of(gm), inputs)}
    moved: dict[int, torch.Tensor] = {}  # id of a redistribution -> its result

    def spec(v: Value, placements: Placements) -> Any:
        return _compat.dtensor_layout(dm, as_contiguous(placements), meta_of(v))  # a balanced split: the view's shards

    def get(v: Value, dst: Placements, user: torch.fx.Node) -> torch.Tensor:
        if plan.placement(v) == dst:
            return env[v]
        r = plan.serving(user, v, dst)
        if id(r) not in moved:
            moved[id(r)] = _move(plan, r, env[v])
        return moved[id(r)]

    for node in plan.order:
        if isinstance(node, Bucket):
            outs = _run_bucket(plan, node, [env[r.value] for r in node.members])
            moved.update((id(r), o) for r, o in zip(node.members, outs))
            continue
        if isinstance(node, Redistribution):  # a lone reduction, started as soon as its value exists
            moved[id(node)] = _move(plan, node, env[node.value])
            continue
        if node not in plan.nodes:
            continue  # placeholders, tuple indexing and the output: nothing to run
        step = plan.nodes[node]
        wanted = iter(step.ins)
        split_queries = context_parallel.splits_sequence(node, step.ins)
        as_dtensor = step.op.kind == "strategy" and not step.direct and not step.fallback and not split_queries

        def arg(a: Any) -> Any:
            if isinstance(a, torch.fx.Node) and is_tensor_node(a):
                v, dst = value_of(a), next(wanted)
                local = _traced_layout(get(v, dst, node), meta_of(v))
                return _compat.dtensor_from_local(local, spec(v, dst)) if as_dtensor else local
            return a

        args, kwargs = _compat.torch_tree_map(arg, (node.args, node.kwargs))
        if node.op == "get_attr":
            out: Any = _replicated(getattr(gm, node.target))
        elif step.op.kind == "constraint":
            out = args[0]
        elif step.op.kind == "manual":
            out = manual.run(node, args)
        elif step.op.kind == "constant":
            out = _compat.torch_tree_map(
                lambda t: _replicated(t) if isinstance(t, torch.Tensor) else t, node.target(*args, **kwargs)
            )
        elif split_queries:
            out = context_parallel.run(plan.mesh, node, args, kwargs, step.ins)
        elif packed.takes_apart(node, step.ins, step.outs):
            out = packed.run(node, args)
        elif as_dtensor:
            out = _unwrap(node, node.target(*args, **kwargs), step.outs)
        else:
            out = node.target(*args, **kwargs)
        outs = out if isinstance(out, (list, tuple)) else [out]
        for i, (o, want) in enumerate(zip(outs, step.outs)):
            if want is not None:
                env[(node, i)] = o
        if check is not None:
            check(node, outs)
    output = output_node(gm)
    return [get(value_of(a), dst, output) for a, dst in zip(_compat.torch_tree_leaves(output.args), plan.outputs)]


def _move(plan: Plan, r: Redistribution, local: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``r``'s value (``local``, laid out as ``r.src``) laid out as ``r.dst``
    (a reduction in the plan's ``reduce_dtype``: cast to it for the move, and back)."""
    prev, t, wire = r.src, meta_of(r.value), plan.reduced_in(r)
    if wire is not None:
        local, t = local.to(wire), torch.empty_strided(t.shape, t.stride(), dtype=wire, device="meta")
    for nxt in transition_path(plan.mesh, r.src, r.dst):
        local, prev = move_local(plan.mesh, t, local, prev, nxt), nxt
    if wire is not None:
        local = local.to(meta_of(r.value).dtype)
    # a shard cut from a replicated value, unpadded after an uneven collective or taken from an
    # all-to-all is a strided view, which some kernels read as a contiguous block (CPU
    # layer-norm backward's mean and rstd, view rules)
    return local.contiguous()


def _run_bucket(plan: Plan, b: Bucket, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """The local values of ``b``'s members (``pieces``, laid out as their sources) moved to
    their destinations by one collective per mesh dim on a flat buffer: the members copied into
    it once (one ``cat``) and the results read back as views of the collective's buffer where
    their layout allows (an all-reduce's, a reduce-scatter's; a gather's members are
    interleaved by rank, so each is copied out). (The functional all-reduce copies the buffer
    once more; its in-place twin would not, but ``CommDebugMode`` does not count it.)"""
    wire = plan.reduced_in(b)
    if wire is not None:  # reduced in the plan's reduce_dtype, each result cast back to its own
        return [
            o.to(p.dtype)
            for p, o in zip(
                pieces, _run_bucket(dataclasses.replace(plan, reduce_dtype=None), b, [p.to(wire) for p in pieces])
            )
        ]
    dm, mesh = plan.mesh.device_mesh, plan.mesh
    nd = len(b.members[0].src)
    sizes = [mesh.axis_size(a) for a in mesh.device_axes]
    if b.kind != "all_gather":  # averages join sums: divide first
        averaged = [math.prod(sizes[k] for k in b.mesh_dims if r.src[k].reduce_op == "avg") for r in b.members]
        pieces = [p / n if n > 1 else p for n, p in zip(averaged, pieces)]
    replicated = (Replicate(),) * nd
    if b.kind == "all_reduce":
        out = _summed(torch.cat([p.reshape(-1) for p in pieces]), dm, b.mesh_dims)
        return [o.view(p.shape) for p, o in zip(pieces, out.split([p.numel() for p in pieces]))]
    k, *summed = b.mesh_dims
    n = sizes[k]
    if b.kind == "all_gather":
        flat = torch.cat([p.reshape(-1) for p in pieces])
        src = tuple(Shard(0) if j == k else Replicate() for j in range(nd))
        out = _compat.redistribute_local(
            flat, dm, src, replicated, shape=(n * flat.numel(),), stride=(1,), dtype=flat.dtype
        )
        rows = out.view(n, -1).split([p.numel() for p in pieces], dim=1)
        # (reshape keeps a view where it can: a member of one element a rank is a strided view of
        # the buffer, which kernels such as CPU layer-norm backward read as a contiguous block)
        return [
            _unstack(row.reshape(n, *p.shape), r.src[k].dim).contiguous() for r, p, row in zip(b.members, pieces, rows)
        ]
    chunks = [_stack(p, r.dst[k].dim, n).reshape(n, -1) for r, p in zip(b.members, pieces)]
    flat = torch.cat(chunks, dim=1).reshape(-1)
    src = tuple(Partial() if j == k else Replicate() for j in range(nd))
    dst = tuple(Shard(0) if j == k else Replicate() for j in range(nd))
    out = _compat.redistribute_local(flat, dm, src, dst, shape=flat.shape, stride=flat.stride(), dtype=flat.dtype)
    if summed:  # (the scattered buffer, all-reduced over the bucket's further mesh dims)
        out = _summed(out, dm, summed)
    shards = [_piece_shape(p.shape, r.dst[k].dim, n) for r, p in zip(b.members, pieces)]
    return [o.view(shape) for shape, o in zip(shards, out.split([c.shape[1] for c in chunks]))]


def _summed(flat: torch.Tensor, dm: Any, dims: Sequence[int]) -> torch.Tensor:
    """``flat``, a partial sum over the mesh ``dims`` of ``dm``, all-reduced over them."""
    src = tuple(Partial() if k in dims else Replicate() for k in range(dm.ndim))
    replicated = (Replicate(),) * dm.ndim
    return _compat.redistribute_local(
        flat, dm, src, replicated, shape=flat.shape, stride=flat.stride(), dtype=flat.dtype
    )


def _piece_shape(shape: Sequence[int], dim: int, n: int) -> list[int]:
    """The shape of one of ``n`` equal pieces of ``shape`` along ``dim``."""
    return [s // n if d == dim else s for d, s in enumerate(shape)]


def _stack(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``x`` cut into ``n`` equal pieces along ``dim``, stacked on a new leading dim (rank order)."""
    return x.view(*x.shape[:dim], n, x.shape[dim] // n, *x.shape[dim + 1 :]).movedim(dim, 0)


def _unstack(y: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`_stack`: ``y``'s leading pieces concatenated along ``dim``."""
    piece = y.shape[1:]
    return y.movedim(0, dim).reshape(*piece[:dim], y.shape[0] * piece[dim], *piece[dim + 1 :])


def _traced_layout(local: torch.Tensor, traced: torch.Tensor) -> torch.Tensor:
    """``local`` laid out as the trace laid out its value ``traced``, for the op about to read it:
    a kernel may read its input's strides as the trace's (a view that folds dims needs them), and
    its result's layout may follow its input's (SDPA's CPU kernel on q, k, v), which later ops
    then read. A shard's layout can differ from the traced value's: a collective returns a
    row-major buffer, a redistribution materialises a broadcast (an expanded attention mask), a
    slice of a shard is strided where the traced value was dense. So: dims the trace broadcast
    (stride 0) broadcast again (their values are equal along them, on every shard), the other dims
    stored in the traced memory order, densely where the traced value was dense; a copy only where
    the layouts differ, none where they agree (read off the strides; a dim the shard broadcasts
    too is one of them, not a dim to store innermost: torchtune's keys of one head, expanded to
    the queries' heads, once reached SDPA's CPU kernel that way and it read them wrongly).
    (Uneven shards under ``vsf.simulate``, whose sizes differ by rank, are left as they are.)"""
    if local.ndim != traced.ndim or not all(type(n) is int for n in (*local.shape, *local.stride())):
        return local
    broadcast = [d for d in range(traced.ndim) if traced.shape[d] > 1 and traced.stride(d) == 0 and local.shape[d] > 1]
    base = (
        local[tuple(slice(0, 1) if d in broadcast else slice(None) for d in range(local.ndim))] if broadcast else local
    )
    order = _dim_order(traced)
    shape = [1 if traced.stride(d) == 0 else s for d, s in enumerate(traced.shape)]
    dense = _dense_in(traced.stride(), shape, order)
    # (a shard's one row of a dim the traced value has several of: see _one_row_dims_in_order)
    one_row = dense and any(base.shape[d] == 1 and shape[d] > 1 for d in range(base.ndim))
    if one_row:
        base = _one_row_dims_in_order(base, order)
    # (a strided view in the trace too: the same order suffices)
    elif not (_dense_in(base.stride(), base.shape, order) if dense else _ordered_in(base, order)):
        inverse = sorted(range(len(order)), key=order.__getitem__)
        base = base.permute(order).contiguous().permute(inverse)
    return base.expand(local.shape) if broadcast else base


def _dense_in(stride: Sequence[int], shape: Sequence[int], order: Sequence[int]) -> bool:
    """Are ``shape``'s elements at ``stride`` stored densely with dims in ``order``, outermost first (no op)?"""
    step = 1
    for d in reversed(order):
        if shape[d] > 1 and stride[d] != step:
            return False
        step *= shape[d]
    return True


def _one_row_dims_in_order(t: torch.Tensor, order: Sequence[int]) -> torch.Tensor:
    """``t`` stored densely in ``order``, every dim strided as that order places it, those of one
    row included: through a flat copy of ``t`` in that order (a view where ``t`` is already dense
    so), which sets each stride whatever ``t``'s were, also in a compiled program, traced on fake
    tensors whose one-row strides can differ from the kernels' own. Indexing never reads a one-row
    dim's stride, but a kernel telling a memory format does: CPU group norm refused a channels-last
    image batch of one row whose batch stride was not the format's (a view of a transposed shard,
    and an addition to it, give it so)."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return t.permute(order).reshape(-1).view([t.shape[d] for d in order]).permute(inverse)


def _ordered_in(t: torch.Tensor, order: Sequence[int]) -> bool:
    """Are ``t``'s dims (those of size > 1) in memory order ``order``, outermost first?"""
    strides = [t.stride(d) for d in order if t.shape[d] > 1]
    return all(a >= b for a, b in zip(strides, strides[1:]))


def _dim_order(t: torch.Tensor) -> list[int]:
    """``t``'s dims from outermost to innermost in memory (dims of size 1, whose stride means nothing, last)."""
    return sorted(range(t.ndim), key=lambda d: (0, -t.stride(d), d) if t.shape[d] > 1 else (1, 0, d))


def _unwrap(node: torch.fx.Node, out: Any, want: Sequence[Placements | None]) -> Any:
    outs = out if isinstance(out, (list, tuple)) else [out]
    for o, w in zip(outs, want):
        if w is not None and tuple(o.placements) != as_contiguous(w):
            raise PlanMismatch(f"{node.target} (node {node.name}) produced {tuple(o.placements)}, the plan said {w}")
    locals_ = [_compat.dtensor_local(o) if isinstance(o, DTensor) else o for o in outs]
    return locals_ if isinstance(out, (list, tuple)) else locals_[0]


def compile_local(plan: Plan, local_inputs: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """Trace :func:`execute` on this rank's local shards into a graph of local ops and collectives
    (:func:`vsf.jit.donation.reuse_donated` then lets it overwrite donated inputs)."""
    with _compat.quiet_redistribute():
        gm = _compat.trace_fake(lambda *xs: execute(plan, xs), local_inputs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
