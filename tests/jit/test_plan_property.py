"""Property: the plan is what runs, for every op DTensor has a strategy for.

Each example jits one aten op over random shapes, on a 1D or 2D mesh of simulated ranks, with
random input layouts (replicated, unreduced partial sums split at random across ranks, shards of
any dim, several mesh axes on one dim in either order, uneven and empty shards) and a random or
free output layout. Three oracles:

* the op run unsharded on the whole inputs: the jitted result must equal it;
* DTensor itself: an op the plan runs on local shards as they are (``direct``) must be one DTensor
  runs on those input placements without moving anything, to the placements the plan predicts
  (an op the plan runs through DTensor's dispatcher is checked by the lowering itself, which
  raises ``PlanMismatch`` when DTensor produces other placements);
* a ``PlanError`` is allowed only as the planner declining (never an internal error).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.debug import CommDebugMode

import vsf
from vsf import P
from vsf._compat import StridedShard, local_shards
from vsf.errors import PlanError
from vsf.sharding.named import from_placements

aten = torch.ops.aten

MESHES = [((4,), ("dp",)), ((2, 2), ("dp", "tp"))]
EXAMPLES = 10  # per op: about 20 s of CPU for the whole list


@dataclass
class Case:
    """One call: ``fn`` applied to ``inputs`` (whole values); ``linear[i]``: input ``i`` may
    arrive as an unreduced partial sum (a float tensor)."""

    fn: Callable[..., torch.Tensor]
    inputs: list[torch.Tensor]

    @property
    def linear(self) -> list[bool]:
        return [x.is_floating_point() for x in self.inputs]


def _shape(draw, lo: int = 1, hi: int = 3, sizes=(1, 2, 3, 4, 5, 6, 8)) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.sampled_from(sizes), min_size=lo, max_size=hi)))


def _data(rng: np.random.Generator, shape, positive: bool = False) -> torch.Tensor:
    x = rng.standard_normal(shape).astype(np.float32)
    return torch.from_numpy(np.abs(x) + 0.5 if positive else x)


def _dims(draw, ndim: int) -> list[int]:
    return sorted(draw(st.sets(st.integers(0, ndim - 1), min_size=1, max_size=ndim)))


# -- op families: each draws a call ----------------------------------------------------------


def unary(op, positive=False):
    def build(draw, rng):
        return Case(op, [_data(rng, _shape(draw), positive)])

    return build


def binary(op, positive_rhs=False):
    def build(draw, rng):
        shape = _shape(draw)
        rhs = list(shape[draw(st.integers(0, len(shape) - 1)) :])  # a suffix: broadcast
        rhs = [1 if draw(st.booleans()) and draw(st.booleans()) else s for s in rhs]
        if draw(st.booleans()):
            a, b = shape, tuple(rhs)
        else:
            a, b = tuple(rhs), shape
        return Case(op, [_data(rng, a), _data(rng, b, positive_rhs)])

    return build


def where(draw, rng):
    shape = _shape(draw)
    cond = torch.from_numpy(rng.standard_normal(shape) > 0)
    return Case(aten.where.self, [cond, _data(rng, shape), _data(rng, shape)])


def scalar(op, value):
    def build(draw, rng):
        return Case(lambda x: op(x, value), [_data(rng, _shape(draw), positive=True)])

    return build


def reduce_dims(op, **extra):
    def build(draw, rng):
        shape = _shape(draw)
        dims, keep = _dims(draw, len(shape)), draw(st.booleans())
        return Case(lambda x: op(x, dims, keep, **extra), [_data(rng, shape)])

    return build


def norm(draw, rng):
    shape = _shape(draw)
    dims, keep = _dims(draw, len(shape)), draw(st.booleans())
    return Case(lambda x: aten.linalg_vector_norm.default(x, 2, dims, keep), [_data(rng, shape)])


def var(draw, rng):
    shape = _shape(draw)
    dims, keep = _dims(draw, len(shape)), draw(st.booleans())
    return Case(lambda x: aten.var.correction(x, dims, correction=0, keepdim=keep), [_data(rng, shape)])


def whole_sum(draw, rng):
    return Case(aten.sum.default, [_data(rng, _shape(draw))])


def max_dim(draw, rng):
    shape = _shape(draw)
    dim, keep = draw(st.integers(0, len(shape) - 1)), draw(st.booleans())
    return Case(lambda x: aten.max.dim(x, dim, keep)[0], [_data(rng, shape)])


def mm(draw, rng):
    m, k, n = _shape(draw, 3, 3)
    return Case(aten.mm.default, [_data(rng, (m, k)), _data(rng, (k, n))])


def addmm(draw, rng):
    m, k, n = _shape(draw, 3, 3)
    bias = (n,) if draw(st.booleans()) else (m, n)
    return Case(aten.addmm.default, [_data(rng, bias), _data(rng, (m, k)), _data(rng, (k, n))])


def bmm(draw, rng):
    b, m, k, n = _shape(draw, 4, 4)
    return Case(aten.bmm.default, [_data(rng, (b, m, k)), _data(rng, (b, k, n))])


def view(draw, rng):
    shape = _shape(draw, 2, 3)
    i = draw(st.integers(0, len(shape) - 2))
    merged = shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2 :]
    src, dst = (shape, merged) if draw(st.booleans()) else (merged, shape)  # merge or split
    op = draw(st.sampled_from([aten.view.default, aten._unsafe_view.default, aten.reshape.default]))
    return Case(lambda x: op(x, list(dst)), [_data(rng, src)])


def transpose(draw, rng):
    shape = _shape(draw, 2, 3)
    a, b = draw(st.integers(0, len(shape) - 1)), draw(st.integers(0, len(shape) - 1))
    return Case(lambda x: aten.transpose.int(x, a, b), [_data(rng, shape)])


def permute(draw, rng):
    shape = _shape(draw, 2, 3)
    order = draw(st.permutations(range(len(shape))))
    return Case(lambda x: aten.permute.default(x, order), [_data(rng, shape)])


def unsqueeze(draw, rng):
    shape = _shape(draw)
    dim = draw(st.integers(0, len(shape)))
    return Case(lambda x: aten.unsqueeze.default(x, dim), [_data(rng, shape)])


def squeeze(draw, rng):
    shape = list(_shape(draw))
    dim = draw(st.integers(0, len(shape)))
    shape.insert(dim, 1)
    return Case(lambda x: aten.squeeze.dim(x, dim), [_data(rng, shape)])


def expand(draw, rng):
    shape = list(_shape(draw))
    dim = draw(st.integers(0, len(shape) - 1))
    size = shape[dim]
    shape[dim] = 1
    return Case(lambda x: aten.expand.default(x, [*shape[:dim], size, *shape[dim + 1 :]]), [_data(rng, shape)])


def slice_(draw, rng):
    shape = _shape(draw)
    dim = draw(st.integers(0, len(shape) - 1))
    start = draw(st.integers(0, shape[dim] - 1))
    end = draw(st.integers(start + 1, shape[dim]))
    return Case(lambda x: aten.slice.Tensor(x, dim, start, end), [_data(rng, shape)])


def select(draw, rng):
    shape = _shape(draw, 2, 3)
    dim = draw(st.integers(0, len(shape) - 1))
    index = draw(st.integers(0, shape[dim] - 1))
    return Case(lambda x: aten.select.int(x, dim, index), [_data(rng, shape)])


def softmax(op):
    def build(draw, rng):
        shape = _shape(draw)
        dim = draw(st.integers(0, len(shape) - 1))
        return Case(lambda x: op(x, dim, False), [_data(rng, shape)])

    return build


def softmax_backward(draw, rng):
    shape = _shape(draw)
    dim = draw(st.integers(0, len(shape) - 1))
    y = torch.softmax(_data(rng, shape), dim)
    return Case(lambda g, y: aten._softmax_backward_data.default(g, y, dim, torch.float32), [_data(rng, shape), y])


def cat(draw, rng):
    shape = _shape(draw)
    dim = draw(st.integers(0, len(shape) - 1))
    other = list(shape)
    other[dim] = draw(st.sampled_from([1, 2, 3, 4]))
    return Case(lambda a, b: aten.cat.default([a, b], dim), [_data(rng, shape), _data(rng, other)])


def embedding(draw, rng):
    vocab, width = _shape(draw, 2, 2)
    ids = torch.from_numpy(rng.integers(0, vocab, _shape(draw, 1, 2)))
    return Case(aten.embedding.default, [_data(rng, (vocab, width)), ids])


def embedding_backward(draw, rng):
    vocab, width = _shape(draw, 2, 2)
    ids_shape = _shape(draw, 1, 2)
    ids = torch.from_numpy(rng.integers(0, vocab, ids_shape))
    return Case(
        lambda g, i: aten.embedding_dense_backward.default(g, i, vocab, -1, False),
        [_data(rng, (*ids_shape, width)), ids],
    )


def layer_norm(draw, rng):
    shape = _shape(draw, 2, 3)
    width = shape[-1]
    return Case(
        lambda x, w, b: aten.native_layer_norm.default(x, [width], w, b, 1e-5)[0],
        [_data(rng, shape), _data(rng, (width,)), _data(rng, (width,))],
    )


def cumsum(draw, rng):
    shape = _shape(draw)
    dim = draw(st.integers(0, len(shape) - 1))
    return Case(lambda x: aten.cumsum.default(x, dim), [_data(rng, shape)])


def masked_fill(draw, rng):
    shape = _shape(draw)
    mask = torch.from_numpy(rng.standard_normal(shape) > 0)
    return Case(lambda x, m: aten.masked_fill.Scalar(x, m, -1.0), [_data(rng, shape), mask])


def stack(draw, rng):
    shape = _shape(draw)
    dim = draw(st.integers(0, len(shape)))
    return Case(lambda a, b: aten.stack.default([a, b], dim), [_data(rng, shape), _data(rng, shape)])


def gather(draw, rng):
    shape = _shape(draw)
    dim = draw(st.integers(0, len(shape) - 1))
    index = torch.from_numpy(rng.integers(0, shape[dim], shape))
    return Case(lambda x, i: aten.gather.default(x, dim, i), [_data(rng, shape), index])


def index_select(draw, rng):
    shape = _shape(draw)
    dim = draw(st.integers(0, len(shape) - 1))
    index = torch.from_numpy(rng.integers(0, shape[dim], _shape(draw, 1, 1)))
    return Case(lambda x, i: aten.index_select.default(x, dim, i), [_data(rng, shape), index])


def argmax(draw, rng):
    shape = _shape(draw)
    dim, keep = draw(st.integers(0, len(shape) - 1)), draw(st.booleans())
    return Case(lambda x: aten.argmax.default(x, dim, keep), [_data(rng, shape)])


def triu(draw, rng):
    shape, diagonal = _shape(draw, 2, 3), draw(st.integers(-1, 1))
    return Case(lambda x: aten.triu.default(x, diagonal), [_data(rng, shape)])


def baddbmm(draw, rng):
    b, m, k, n = _shape(draw, 4, 4)
    return Case(
        lambda c, x, y: aten.baddbmm.default(c, x, y, beta=0.5, alpha=2.0),
        [_data(rng, (b, m, n)), _data(rng, (b, m, k)), _data(rng, (b, k, n))],
    )


def merged_bmm_case(rng, b, h, m, k, n):
    """A 4D matmul as it traces: batch and heads merged into one dim (a split of the heads becomes
    a strided shard of it), ``bmm``, and the result viewed back."""
    return Case(
        lambda x, y: aten._unsafe_view.default(
            aten.bmm.default(aten.view.default(x, [b * h, m, k]), aten.view.default(y, [b * h, k, n])), [b, h, m, n]
        ),
        [_data(rng, (b, h, m, k)), _data(rng, (b, h, k, n))],
    )


def merged_bmm(draw, rng):
    return merged_bmm_case(rng, *_shape(draw, 5, 5, sizes=(1, 2, 4)))


def layer_norm_backward(draw, rng):
    # a width of 1 normalizes to a constant, and a width of 2 to +-sqrt(var / (var + eps)): the input
    # gradient is then only the epsilon's share of terms the gradient's size (6.9e-4 in float64 against
    # terms of 1), which rounding noise times rstd swamps (Hypothesis runs found 1.2e-4 against 0 on
    # [2, 5, 1], and 1.5e-4 off on [3, 2], each with a part split over dp)
    shape = _shape(draw, 1, 2) + (draw(st.sampled_from((3, 4, 5, 6, 8))),)
    return layer_norm_backward_case(rng, shape, draw(st.integers(0, 2)))


def layer_norm_backward_case(rng, shape, which):
    """The gradient of the input (``which`` 0), the weight (1) or the bias (2) of a layer norm."""
    width = shape[-1]
    x, w, b = _data(rng, shape), _data(rng, (width,)), _data(rng, (width,))
    _, mean, rstd = aten.native_layer_norm.default(x, [width], w, b, 1e-5)
    return Case(
        lambda g, x, mean, rstd, w, b: aten.native_layer_norm_backward.default(
            g, x, [width], mean, rstd, w, b, [True, True, True]
        )[which],
        [_data(rng, shape), x, mean, rstd, w, b],
    )


def nll_loss(draw, rng):
    return nll_loss_case(rng, *_shape(draw, 2, 2))


OPS: dict[str, Callable] = {
    "exp": unary(aten.exp.default),
    "tanh": unary(aten.tanh.default),
    "neg": unary(aten.neg.default),
    "relu": unary(aten.relu.default),
    "gelu": unary(aten.gelu.default),
    "rsqrt": unary(aten.rsqrt.default, positive=True),
    "add": binary(aten.add.Tensor),
    "mul": binary(aten.mul.Tensor),
    "sub": binary(aten.sub.Tensor),
    "div": binary(aten.div.Tensor, positive_rhs=True),
    "maximum": binary(aten.maximum.default),
    "where": where,
    "mul_scalar": scalar(aten.mul.Scalar, 3.0),
    "pow_scalar": scalar(aten.pow.Tensor_Scalar, 2.0),
    "sum": whole_sum,
    "sum_dims": reduce_dims(aten.sum.dim_IntList),
    "mean_dims": reduce_dims(aten.mean.dim),
    "amax": reduce_dims(aten.amax.default),
    "max_dim": max_dim,
    "norm": norm,
    "var": var,
    "mm": mm,
    "addmm": addmm,
    "bmm": bmm,
    "view": view,
    "transpose": transpose,
    "permute": permute,
    "unsqueeze": unsqueeze,
    "squeeze": squeeze,
    "expand": expand,
    "slice": slice_,
    "select": select,
    "softmax": softmax(aten._softmax.default),
    "log_softmax": softmax(aten._log_softmax.default),
    "softmax_backward": softmax_backward,
    "cat": cat,
    "embedding": embedding,
    "embedding_backward": embedding_backward,
    "layer_norm": layer_norm,
    "nll_loss": nll_loss,
    "cumsum": cumsum,
    "masked_fill": masked_fill,
    "stack": stack,
    "gather": gather,
    "index_select": index_select,
    "argmax": argmax,
    "triu": triu,
    "baddbmm": baddbmm,
    "merged_bmm": merged_bmm,
    "layer_norm_backward": layer_norm_backward,
}


# -- layouts ------------------------------------------------------------------------------------


def _spec(draw, mesh: vsf.Mesh, shape, may_be_partial: bool) -> P:
    """A random spec: each mesh axis replicates, shards a dim (several axes on one dim in a
    random order: against mesh order that is a strided shard) or holds a partial sum."""
    entries: dict[int, list[str]] = {}
    unreduced = []
    for axis in mesh.axis_names:
        kind = draw(st.sampled_from(["R", "P", "S"] if may_be_partial else ["R", "S"]))
        if kind == "P":
            unreduced.append(axis)
        elif kind == "S" and shape:
            entries.setdefault(draw(st.integers(0, len(shape) - 1)), []).append(axis)
    for d, axes in entries.items():
        if shape[d] % math.prod(mesh.axis_size(a) for a in axes) == 0:  # DTensor splits against mesh order evenly only
            axes[:] = draw(st.permutations(axes))
    spec = [
        None if d not in entries else entries[d][0] if len(entries[d]) == 1 else tuple(entries[d])
        for d in range(len(shape))
    ]
    return P(*spec, unreduced=unreduced)


def _put(mesh: vsf.Mesh, full: torch.Tensor, spec: P, rng: np.random.Generator) -> DTensor:
    """``full`` laid out as ``spec``; an unreduced value's parts are random (they sum to ``full``)."""
    if not spec.unreduced:
        return vsf.device_put(full, vsf.NamedSharding(mesh, spec))
    axes = tuple(a for a in mesh.axis_names if a in spec.unreduced)
    k = math.prod(mesh.axis_size(a) for a in axes)
    parts = torch.from_numpy(rng.standard_normal((k, *full.shape)).astype(np.float32))
    parts[-1] = full - parts[:-1].sum(0)
    stacked = vsf.device_put(parts, vsf.NamedSharding(mesh, P(axes, *spec)))
    placements = vsf.NamedSharding(mesh, spec).placements
    return DTensor.from_local(
        stacked.to_local()[0], mesh.device_mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


def _dtensor(mesh: vsf.Mesh, full: torch.Tensor, placements, rng: np.random.Generator) -> DTensor:
    """``full`` as a DTensor laid out as ``placements``."""
    try:
        spec = from_placements(mesh, placements, full.ndim).spec
    except ValueError:  # a layout no spec names (a strided shard the plan passes through): DTensor cuts it,
        # and a partial sum over k ranks holds 1/k of each element on each (exact: k is a power of 2)
        whole = [Replicate() if isinstance(p, Partial) else p for p in placements]
        cut = vsf.device_put(full, vsf.NamedSharding(mesh, P())).redistribute(mesh.device_mesh, whole)
        k = math.prod(mesh.device_mesh.size(d) for d, p in enumerate(placements) if isinstance(p, Partial))
        return DTensor.from_local(
            cut.to_local() / k, mesh.device_mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
        )
    return _put(mesh, full, spec, rng)


def _whole_values(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> dict[torch.fx.Node, object]:
    """Every node's value when the traced graph runs on the whole inputs."""
    seen: dict[torch.fx.Node, object] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            seen[n] = super().run_node(n)
            return seen[n]

    Recorder(gm).run(*inputs)
    return seen


def _check_direct_ops_are_dtensors(plan, whole: dict, mesh: vsf.Mesh, rng: np.random.Generator) -> None:
    """Each op the plan runs on local shards as they are: DTensor, given inputs in the plan's
    placements, runs it without communication and returns the plan's placements; or, where DTensor
    does not (a row rule on strided shards, which DTensor's whole-op rules do not name), the op on
    each rank's shards of the unsharded inputs gives that rank's shard of the unsharded output."""
    for node, step in plan.nodes.items():
        if not step.direct or node.op != "call_function":
            continue
        if any(isinstance(p, Partial) and p.reduce_op != "sum" for pl in step.ins for p in pl):
            continue  # (a value-blind op's inputs: no spec says "partial max")
        args, kwargs = _placed_args(node, step.ins, whole, mesh, rng)
        with CommDebugMode() as comm:
            out = node.target(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else [out]
        got = tuple(tuple(o.placements) if isinstance(o, DTensor) else None for o in outs)
        want = tuple(None if w is None else tuple(w) for w in step.outs)
        if comm.get_total_counts() == 0 and got == want:
            continue
        strided = any(isinstance(p, StridedShard) for pl in step.ins for p in pl)
        assert strided and not any(isinstance(p, Partial) for pl in [*step.ins, *want] if pl is not None for p in pl), (
            f"{node.format_node()}: the plan runs it on local shards {step.ins} -> {step.outs}; DTensor on "
            f"those inputs gives {got} after {comm.get_total_counts()} collectives"
        )
        _check_on_local_shards(node, step, whole, mesh, rng)


def _placed_args(
    node: torch.fx.Node, placements, whole: dict, mesh: vsf.Mesh, rng: np.random.Generator, local: bool = False
):
    """``node``'s args with each tensor the unsharded value laid out as ``placements`` (its local shards if ``local``)."""
    ins = iter(placements)

    def arg(a):
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            t = _dtensor(mesh, whole[a], next(ins), rng)
            return t.to_local() if local else t
        return a

    return torch.fx.node.map_aggregate((node.args, node.kwargs), arg)


def _check_on_local_shards(node: torch.fx.Node, step, whole: dict, mesh: vsf.Mesh, rng: np.random.Generator) -> None:
    args, kwargs = _placed_args(node, step.ins, whole, mesh, rng, local=True)
    out, full = node.target(*args, **kwargs), whole[node]
    pairs = zip(out, full, step.outs) if isinstance(out, (tuple, list)) else [(out, full, step.outs[0])]
    for got, value, p in pairs:
        if p is None:
            continue
        want = _dtensor(mesh, value, p, rng).to_local()
        for rank, shard in local_shards(want, 0).items():
            assert torch.equal(local_shards(got, rank)[rank], shard), (
                f"{node.format_node()} on rank {rank}'s local shards {step.ins}: not its shard of the output as {p}"
            )


def check(mesh: vsf.Mesh, case: Case, specs: list[P], out_spec: P | None, rng: np.random.Generator) -> str:
    """Plan ``case`` with inputs laid out as ``specs``; check the plan against DTensor and the
    jitted result against the unsharded op. Returns how the op ran, or why the planner declined."""
    want = case.fn(*case.inputs)
    note = f"inputs {[tuple(x.shape) for x in case.inputs]} as {specs}, output {tuple(want.shape)} as {out_spec}"
    args = [_put(mesh, x, s, rng) for x, s in zip(case.inputs, specs)]
    jitted = vsf.jit(
        lambda *xs: [case.fn(*xs)], out_shardings=[None if out_spec is None else vsf.NamedSharding(mesh, out_spec)]
    )
    try:
        plan = jitted.lower(*args).plan
    except PlanError as e:
        return f"planner declined: {str(e)[:60]}"  # allowed (an internal error is not)
    _check_direct_ops_are_dtensors(plan, _whole_values(plan.graph, case.inputs), mesh, rng)
    (got,) = jitted(*args)
    torch.testing.assert_close(vsf.device_get(got), want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{note}: {m}")
    return "on local shards" if any(s.direct for s in plan.nodes.values()) else "through DTensor"


@pytest.mark.parametrize("op", list(OPS))
@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_plan_matches_dtensor_and_the_unsharded_op(sim, op, data):
    if not torch.distributed.is_initialized():
        sim(4)  # once per test: its examples share the simulated ranks
    shape, names = data.draw(st.sampled_from(MESHES), label="mesh")
    mesh = vsf.make_mesh(shape, names)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    case = OPS[op](data.draw, rng)
    out_shape = case.fn(*case.inputs).shape
    specs = [_spec(data.draw, mesh, x.shape, lin) for x, lin in zip(case.inputs, case.linear)]
    out_spec = _spec(data.draw, mesh, out_shape, False) if data.draw(st.booleans(), label="fixed output") else None
    event(check(mesh, case, specs, out_spec, rng))


# -- each cause of a mismatch found, pinned -------------------------------------------------------


def _two_sums(rng):
    # DTensor's sharding cache keys a call by the op's registered runtime info: asked without
    # it, sum(x, [0, 1]) answered for sum(x, [2]) (Partial where the program gets Shard(0))
    return Case(
        lambda x: aten.sum.dim_IntList(x, [0, 1], True) * aten.sum.dim_IntList(x, [2], True), [_data(rng, (4, 6, 8))]
    )


PINNED = {
    "reductions over other dims of one value": ((4,), _two_sums, [P("dp")], None),
    # per mesh dim 2 rows may be split, but not over S(0), S(0) together: DTensor's nll_loss
    # strategy raises, its view rule answers with 2 rows over 4 shards (and the program fails)
    "nll_loss on fewer rows than the combined shards": (
        (2, 2),
        lambda rng: nll_loss_case(rng, 2, 3),
        [P(unreduced=("dp", "tp")), P(("dp", "tp"))],
        None,
    ),
    "view to fewer rows than the combined shards": (
        (2, 2),
        lambda rng: Case(lambda x: aten.view.default(x, [2, 2]), [_data(rng, (4,))]),
        [P("dp", unreduced="tp")],
        None,
    ),
    # a max over shards has no identity for a rank that holds no rows (5 rows on 4 ranks: 2, 2, 1, 0)
    "amax over an empty shard": (
        (4,),
        lambda rng: Case(lambda x: aten.amax.default(x, [0]), [_data(rng, (5, 3))]),
        [P("dp")],
        None,
    ),
    # merging a dim split on tp into a dim before it leaves a strided shard no spec names
    "view leaving a layout no spec names": (
        (2, 2),
        lambda rng: Case(lambda x: aten.view.default(x, [4]), [_data(rng, (2, 2))]),
        [P(None, "tp")],
        None,
    ),
    # reduce-scattering 5 columns over 2 ranks unpads a column slice, which view cannot take
    "view of an uneven column shard": (
        (2, 2),
        lambda rng: Case(lambda x: aten.view.default(x, [15]), [_data(rng, (3, 5))]),
        [P(unreduced="tp")],
        None,
    ),
    # an all-to-all leaves rstd a strided view, which CPU layer-norm backward reads as contiguous
    "layer-norm backward of a moved rstd": (
        (2,),
        lambda rng: layer_norm_backward_case(rng, (3, 2), 0),
        [P(), P(), P(), P(None, "dp"), P(), P()],
        None,
    ),
    # dp's split factor in P(("tp", "dp")) is tp's split: DTensor cannot gather tp and keep dp strided
    "elementwise op gathering the major axis of a nesting": (
        (2, 2),
        lambda rng: Case(aten.neg.default, [_data(rng, (4,))]),
        [P(("tp", "dp"))],
        P("dp"),
    ),
    # DTensor's view rule maps a strided input to a wrong layout (a silent wrong result), and makes
    # nestings out of plain shards that no redistribution undoes
    "view of a strided shard": (
        (2, 2),
        lambda rng: Case(lambda x: aten.view.default(x, [6, 4]), [_data(rng, (24,))]),
        [P(("tp", "dp"))],
        None,
    ),
    "view merging two sharded dims": (
        (2, 2),
        lambda rng: Case(lambda x: aten.view.default(x, [8]), [_data(rng, (4, 2))]),
        [P("tp", unreduced="dp")],
        None,
    ),
    # heads split on tp (and the batch on dp) merged into one dim: bmm and the view back keep the split
    "bmm of merged batch and heads": (
        (2, 2),
        lambda rng: merged_bmm_case(rng, 2, 4, 3, 2, 3),
        [P("dp", "tp"), P("dp", "tp")],
        None,
    ),
    "bmm of merged heads": (
        (2, 2),
        lambda rng: merged_bmm_case(rng, 3, 4, 2, 2, 2),
        [P(None, ("tp", "dp")), P(None, ("tp", "dp"))],
        None,
    ),
    # DTensor moving (S(0)/sf2, R) to (R, S(0)) in one step slices tp first, then regathers dp as if
    # it split the whole dim (each rank got all rows, wrongly ordered)
    "strided shard gathered while another mesh dim slices": (
        (2, 2),
        lambda rng: merged_bmm_case(rng, 2, 2, 1, 1, 1),
        [P("tp"), P(None, "dp")],
        None,
    ),
    # the merged dim of a partial sum split on tp: the plan runs bmm on a (partial, strided) input that
    # no spec names (the test's DTensor for it cannot come from a redistribution to a partial sum)
    "bmm of a partial sum's merged heads": (
        (2, 2),
        lambda rng: merged_bmm_case(rng, 2, 2, 1, 1, 1),
        [P("tp"), P(None, "tp", unreduced="dp")],
        None,
    ),
    # a replicated value may become partial by keeping a share on each rank, but integer indices
    # cannot (embedding's rule, asked with partial indices, takes them)
    "embedding of replicated indices on a split table": (
        (4,),
        lambda rng: Case(aten.embedding.default, [_data(rng, (4, 1)), torch.from_numpy(rng.integers(0, 4, (1,)))]),
        [P("dp"), P()],
        None,
    ),
    # embedding's rules name plain shards: DTensor does not keep strided indices strided
    "embedding of strided indices": (
        (2, 2),
        lambda rng: Case(aten.embedding.default, [_data(rng, (3, 2)), torch.from_numpy(rng.integers(0, 3, (8,)))]),
        [P(), P(("tp", "dp"))],
        None,
    ),
    # DTensor's argmax handler takes plain shards only: it raised NotImplementedError on a strided one
    "argmax across a strided shard": (
        (2, 2),
        lambda rng: Case(lambda x: aten.argmax.default(x, 1, False), [_data(rng, (4, 3))]),
        [P(("tp", "dp"))],
        None,
    ),
    # a bucketed all-gather read a one-element-a-rank member (layer norm's mean) back as a strided
    # view of the buffer, which CPU layer-norm backward reads as a contiguous block: a wrong weight gradient
    "layer norm backward of a gathered mean": (
        (4,),
        lambda rng: layer_norm_backward_case(rng, (4, 4), 1),
        [P(), P(), P("dp", None), P(), P(), P("dp")],
        None,
    ),
}


def nll_loss_case(rng, n, c):
    target = torch.from_numpy(rng.integers(0, c, (n,)))
    return Case(
        lambda x, t: aten.nll_loss_forward.default(x, t, None, 1, -100)[0],
        [torch.log_softmax(_data(rng, (n, c)), -1), target],
    )


@pytest.mark.parametrize("name", list(PINNED))
def test_pinned_cause_of_a_mismatch(sim, name):
    shape, build, specs, out_spec = PINNED[name]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, ("dp", "tp")[: len(shape)])
    rng = np.random.default_rng(0)
    assert not check(mesh, build(rng), specs, out_spec, rng).startswith("planner declined")


def test_a_move_no_redistribution_makes_is_a_plan_error(sim, monkeypatch):
    """Were DTensor to ask for an input layout no redistribution reaches (a shard made a partial
    max), the plan names the op and the user's line; the cost model's table of moves raised a
    bare ``KeyError: 'invalid'`` there."""
    from vsf.jit import strategies

    monkeypatch.setattr(
        strategies, "dtensor_decision", lambda node, dm, want_in, asked: ([(Partial("max"),)], [(Partial("max"),)])
    )
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.ones(4, 3), vsf.NamedSharding(mesh, P("dp")))
    with pytest.raises(
        PlanError,
        match=r"aten.sum.dim_IntList wants %arg0_1 as \(Partial\(max\),\) but it is \(Shard\(dim=0\),\).*test_plan_property.py",
    ):
        vsf.jit(lambda x: x.sum(0)).lower(x)
