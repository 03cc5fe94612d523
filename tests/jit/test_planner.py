"""The planner's pieces on small hand-built graphs: op classification, DTensor's strategies for an
op, the cost of each collective kind, transition paths, bucket formation, and the driver on a
two-op graph. Oracles: hand-computed placements and bytes (ring model: an all-reduce sends
2(n-1)/n of the tensor, an all-gather or reduce-scatter (n-1)/n, an all-to-all (n-1)/n of the
local shard), and PyTorch's own registry for which ops DTensor covers."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

import vsf
from vsf import _compat
from vsf._compat import StridedShard
from vsf.config import PlanOptions
from vsf.jit.buckets import bucket_kind, form_buckets
from vsf.jit.classify import OpClass, classify, classify_all, constant_nodes
from vsf.jit.cost import Codes, latency_bytes, local_bytes, local_shape, transition_bytes, transition_kind
from vsf.jit.graph import output_node, value_of
from vsf.jit.plan import Collective, Redistribution
from vsf.jit.propagate import propagate
from vsf.jit.redistribute import collectives_of, local_step, minor_step, move_local, strided_regather, transition_path
from vsf.jit.strategies import Strategies, Strategy
from vsf.sharding import constraint

aten = torch.ops.aten
BUCKET_BYTES = PlanOptions().bucket_bytes  # vsf.config.bucket_bytes's default
R, P = Replicate(), Partial()


def _graph(fn, *shapes, mode="fake"):
    return make_fx(fn, tracing_mode=mode)(*(torch.randn(*s) for s in shapes))


def _node(gm, target):
    (node,) = [n for n in gm.graph.nodes if n.target is target]
    return node


# -- op classification -----------------------------------------------------------------------


def test_each_kind_of_op_is_classified_once_from_its_target_and_arguments():
    const = torch.arange(4.0)
    gm = _graph(
        lambda x, w: (
            x @ w,
            x.sum(),
            torch.ones_like(x),
            torch.ones(3),
            x.renorm(2, 0, 1.0),
            torch.bernoulli(x.sigmoid()),
            x + const,
        ),
        (4, 4),
        (4, 4),
        mode="real",
    )
    assert classify(_node(gm, aten.mm.default)) == OpClass("strategy", "single", local=True, ragged_reduction=False)
    assert classify(_node(gm, aten.sum.default)) == OpClass("strategy", "full", local=False, ragged_reduction=True)
    assert classify(_node(gm, aten.ones_like.default)).kind == "value_blind"
    assert classify(_node(gm, aten.ones.default)).kind == "constant"  # a factory: no tensor input
    assert classify(_node(gm, aten.renorm.default)).kind == "none"  # DTensor registers no strategy
    # a random op has per-mesh-dim rules but DTensor's dispatcher runs it its own way
    assert classify(_node(gm, aten.bernoulli.default)) == OpClass(
        "strategy", "single", local=False, ragged_reduction=False
    )
    (attr,) = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert classify(attr).kind == "constant"


def test_classify_all_works_out_per_op_what_the_op_alone_decides_and_per_node_the_rest():
    """Two overloads of one op with other rules (``bernoulli``'s, ``bernoulli.p`` has none), one op
    with and without a tensor argument, a constant: each classified as on its own."""
    gm = _graph(
        lambda x: (torch.bernoulli(x.sigmoid()), x.bernoulli(0.5), torch.ones(3) * 2, x * 2, torch.ones_like(x)),
        (4, 4),
        mode="real",
    )
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    constants = constant_nodes(gm.graph)
    assert classify_all(ops, constants) == {n: classify(n, constants) for n in ops}
    bernoullis = [n for n in ops if n.target in (aten.bernoulli.default, aten.bernoulli.p)]
    assert [classify(n).rules for n in bernoullis] == ["single", None]


# (op, args, whether it draws from torch's generator), by torch's semantics: attention's tag is for
# its dropout; dropout with probability 0 or not training is the identity
x4 = torch.ones(2, 2, 2, 2)
DRAWS = [
    (aten.mm.default, (x4[0, 0], x4[0, 0]), False),
    (aten.rand.default, ([2],), True),
    (aten._scaled_dot_product_flash_attention_for_cpu.default, (x4, x4, x4), False),
    (aten._scaled_dot_product_flash_attention_for_cpu.default, (x4, x4, x4, 0.1), True),
    (aten.native_dropout.default, (x4, 0.1, True), True),
    (aten.native_dropout.default, (x4, 0.1, False), False),
    (aten.native_dropout.default, (x4, 0.0, True), False),
]


@pytest.mark.parametrize("op, args, draws", DRAWS, ids=[f"{op.__name__}-{i}" for i, (op, _, _) in enumerate(DRAWS)])
def test_draws_random_follows_the_ops_dropout_arguments(op, args, draws):
    from vsf.jit.classify import draws_random

    assert draws_random(op, args, {}) is draws


def test_a_constraint_is_classified_by_its_op():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 2, device="meta")
    node = g.call_function(constraint.CONSTRAINT_OP, (x, "spec"))
    assert classify(node).kind == "constraint"


# -- DTensor's strategies --------------------------------------------------------------------


def test_per_mesh_dim_rules_are_asked_once_per_signature_and_each_axis_size_keeps_its_own():
    """DTensor's per-mesh-dim rules of an op do not depend on the axis's size, so they are asked
    once per signature for every size (``Strategies.single``); what a size allows is still each
    size's own (a dim of 4 rows splits over 2 and 4 ranks, not 8), and an op of another shape asks
    again and gets its own: the same strategies as asked with nothing shared."""
    gm = _graph(lambda x, w, y, v: (x @ w, y @ v), (4, 16), (16, 8), (8, 16), (16, 8))
    small, large = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    classes = {small: classify(small), large: classify(large)}
    shared = Strategies(PlanOptions(), classes)
    rows = Strategy((Shard(0), R), (Shard(0),))
    for n in (2, 4, 8):
        for node in (small, large):
            assert shared.of(node, n) == Strategies(PlanOptions(), classes).of(node, n)
        assert (rows in shared.of(small, n)[0]) == (n <= 4)
        assert rows in shared.of(large, n)[0]
    assert len(shared.single) == 2


class _Forgetful(dict):
    """A memo that remembers nothing."""

    def __contains__(self, key: object) -> bool:
        return False


def test_whole_op_strategies_are_asked_once_per_signature_lead_placement_and_axis_size(monkeypatch):
    """DTensor's whole-op strategy functions are asked once per op signature, lead input, its
    placement and axis size (``Strategies.whole``), and shared by the questions that ask again (an
    op whose inputs may arrive split balanced asks its plain candidates again): the same strategies
    as asked with nothing shared, though they differ with the op (a view and a transpose of one
    tensor), the axis's size (a view of 6 rows merged into 24 keeps them split over 2 and 3 ranks,
    not 4) and which input leads (a loss's backward follows its rows, not its incoming gradient's)."""

    def ops(x, i, g):  # (a loss's backward per row, reduction "none": it follows its second input)
        total = torch.tensor(6.0)
        return x.view(24), x.t(), torch.gather(x, 1, i), aten.nll_loss_backward(g, x, i[:, 0], None, 0, -100, total)

    gm = make_fx(ops)(torch.randn(6, 4), torch.zeros(6, 4, dtype=torch.long), torch.randn(6))
    targets = (aten.view.default, aten.t.default, aten.gather.default, aten.nll_loss_backward.default)
    nodes = [_node(gm, op) for op in targets]
    classes = {node: classify(node) for node in nodes}
    shared = Strategies(PlanOptions(), classes)
    questions = []
    ask = _compat.whole_op_strategies
    monkeypatch.setattr(_compat, "whole_op_strategies", lambda *a: questions.append(a) or ask(*a))
    asked_again = 0
    for n in (2, 4, 3):
        for node in nodes:
            for balanced in (False, True):
                alone = Strategies(PlanOptions(), classes)
                alone.whole = _Forgetful()  # (every question asked of DTensor)
                expected = alone.of(node, n, (), balanced)
                before = len(questions)
                assert shared.of(node, n, (), balanced) == expected, (node.target, n, balanced)
                asked_again += balanced and len(questions) > before
    assert asked_again == 0
    merged = Strategy((Shard(0),), (Shard(0),))
    assert [merged in shared.of(nodes[0], n)[0] for n in (2, 4, 3)] == [True, False, True]


def test_matmul_offers_the_megatron_strategies_on_one_axis():
    gm = _graph(lambda x, w: x @ w, (4, 6), (6, 8))
    mm = _node(gm, aten.mm.default)
    found, fallback = Strategies(PlanOptions(), {mm: classify(mm)}).of(mm, 2)
    assert not fallback
    expected = {
        Strategy((R, R), (R,)),  # replicated
        Strategy((Shard(0), R), (Shard(0),)),  # rows of x: rows of the result
        Strategy((R, Shard(1)), (Shard(1),)),  # columns of w: columns of the result
        Strategy((Shard(1), Shard(0)), (P,)),  # the contracted dim split: partial sums
    }
    assert expected <= set(found)
    assert all(s.ins[0] != Shard(1) or s.outs == (P,) for s in found)


def test_an_op_without_strategy_is_a_plan_error_or_a_flagged_fallback():
    gm = _graph(lambda x: x.renorm(2, 0, 1.0), (4, 4))
    node = _node(gm, aten.renorm.default)
    with pytest.raises(vsf.PlanError, match="renorm.default has no DTensor sharding strategy"):
        Strategies(PlanOptions(), {node: classify(node)}).of(node, 2)
    found, fallback = Strategies(PlanOptions(allow_replicated_fallback=True), {node: classify(node)}).of(node, 2)
    assert fallback and found == [Strategy((R,), (R,))]


# -- the cost of each collective kind ----------------------------------------------------------


def test_transition_bytes_follow_the_ring_model():
    assert transition_bytes("all_reduce", 4, 1000.0) == 1500.0
    assert transition_bytes("all_gather", 4, 1000.0) == 750.0
    assert transition_bytes("reduce_scatter", 4, 1000.0) == 750.0
    assert transition_bytes("all_to_all", 4, 1000.0) == 187.5  # (n-1)/n of the 250-byte local shard
    assert transition_bytes("slice", 4, 1000.0) < 1.01  # a token cost: local, nothing sent


def test_the_cost_table_charges_a_latency_per_collective_and_forbids_impossible_moves():
    codes = Codes(2, 4096.0)
    r, s0, p = codes.code(R), codes.code(Shard(0)), codes.code(P)
    assert codes.factor[p][r] == 1.0 and codes.fixed[p][r] == 4096.0  # all-reduce: 2(n-1)/n
    assert codes.factor[s0][r] == 0.5 and codes.factor[p][s0] == 0.5
    assert codes.fixed[r][s0] == 0.0  # a slice starts no collective
    assert (
        codes.factor[r][p] == codes.factor[r][s0] and codes.fixed[r][p] == 0.0
    )  # a replicated value's share: local, a token
    assert codes.factor[s0][p] == float("inf")  # a shard never becomes partial by moving


def test_the_cost_table_is_the_same_whatever_order_placements_are_coded_in():
    """Each placement a solver meets adds its row and column to the table; every entry is the
    transition's ring bytes per byte (and a start-up per collective), whatever the order."""
    placements = [R, Shard(0), P, Shard(1), Partial("max"), StridedShard(0, split_factor=2)]
    tables = [Codes(4, 4096.0), Codes(4, 4096.0)]
    for q in placements:
        tables[0].code(q)
    for q in reversed(placements):
        tables[1].code(q)
    for a, b in itertools.product(placements, repeat=2):
        kind = transition_kind(a, b)
        want = 0.0 if kind is None else float("inf") if kind == "invalid" else transition_bytes(kind, 4, 1.0)
        start_up = 4096.0 if kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") else 0.0
        for codes in tables:
            assert codes.factor[codes.code(a)][codes.code(b)] == want, (a, b)
            assert codes.fixed[codes.code(a)][codes.code(b)] == start_up, (a, b)


def test_a_collectives_start_up_is_charged_by_the_meshs_device_unless_set():
    """``vsf.config.collective_latency_bytes`` unset (``None``): a gloo CPU collective's start-up,
    about 200 us at 0.3 GB/s, 64 KiB; an NCCL one's, about 10 us at 100 GB/s, 1 MiB. Set, it is
    charged on every device; a device with no default must have it set."""
    assert latency_bytes("cpu", None) == 64 * 2**10 and latency_bytes("cuda", None) == 2**20
    assert latency_bytes("cpu", 4096.0) == latency_bytes("cuda", 4096.0) == 4096.0
    with pytest.raises(ValueError, match="no default for a mesh of device type 'xpu'"):
        latency_bytes("xpu", None)


def test_local_shapes_follow_ceil_division(sim):
    sim(4, compute=False)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    t = torch.empty(5, 6, device="meta")
    assert local_shape(mesh, t, (Shard(0), Shard(0))) == (2, 6)  # 5 rows over 4 ranks: 2, 2, 1, 0
    assert local_shape(mesh, t, (Shard(0), Shard(1))) == (3, 3)
    assert local_bytes(mesh, t, (R, Shard(1))) == 5 * 3 * 4


@pytest.mark.parametrize(
    "src, dst, kind, shape, sent",
    [
        ((P, R), (R, R), "all_reduce", (8, 4), 128),  # 128 bytes, 2(n-1)/n
        ((Shard(0), R), (R, R), "all_gather", (8, 4), 64),  # gathers into the whole tensor
        ((P, R), (Shard(0), R), "reduce_scatter", (8, 4), 64),
        ((Shard(0), R), (Shard(1), R), "all_to_all", (4, 4), 32),  # (n-1)/n of the 64-byte shard
        ((R, P), (R, R), "all_reduce", (8, 4), 128),  # the other axis
    ],
)
def test_each_collective_kind_sends_what_the_ring_model_says(sim, src, dst, kind, shape, sent):
    sim(4, compute=False)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    t = torch.empty(8, 4)  # 128 bytes
    axis = "dp" if src[0] != dst[0] else "tp"
    assert collectives_of(mesh, t, src, dst) == (Collective(kind, axis, shape, torch.float32, sent),)


def test_a_local_slice_sends_nothing(sim):
    sim(4, compute=False)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    assert collectives_of(mesh, torch.empty(8, 4), (R, R), (Shard(0), Shard(1))) == ()


# -- transition paths --------------------------------------------------------------------------


def test_paths_slice_first_then_reduce_then_all_to_all_then_gather(sim):
    sim(4, compute=False)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    # the slice over tp comes before the reduce-scatter over dp (which then moves a smaller shard)
    assert transition_path(mesh, (P, R), (Shard(0), Shard(1))) == [(P, Shard(1)), (Shard(0), Shard(1))]
    # a gather goes last: the slice first
    assert transition_path(mesh, (Shard(0), R), (R, Shard(0))) == [(Shard(0), Shard(0)), (R, Shard(0))]
    assert transition_path(mesh, (P, Shard(0)), (R, Shard(1))) == [(R, Shard(0)), (R, Shard(1))]
    assert transition_path(mesh, (R, R), (R, R)) == []


def test_a_minor_strided_shard_is_reached_last_by_a_one_dim_step(sim):
    # ZeRO's P(("fsdp", "dp")) on mesh (dp, fsdp): dp splits fsdp's local rows, so it is a strided
    # shard of dim 0 with split factor fsdp = 2; a partial gradient is reduce-scattered over fsdp,
    # then over dp on its local shard
    sim(4, compute=False)
    mesh = vsf.make_mesh((2, 2), ("dp", "fsdp"))
    zero = (StridedShard(0, split_factor=2), Shard(0))
    assert vsf.NamedSharding(mesh, vsf.P(("fsdp", "dp"))).placements == zero
    assert transition_path(mesh, (P, P), zero) == [(P, Shard(0)), zero]
    assert minor_step(mesh, (P, Shard(0)), zero) == (0, 0)
    assert minor_step(mesh, (P, P), zero) is None  # two mesh dims change at once
    assert minor_step(mesh, (P, R), (Shard(0), R)) is None  # no strided shard: DTensor's own step
    kinds = [(c.kind, c.axis) for c in collectives_of(mesh, torch.empty(8, 4), (P, P), zero)]
    assert kinds == [("reduce_scatter", "fsdp"), ("reduce_scatter", "dp")]


def test_moves_through_strided_shards_that_dtensor_cannot_make_are_made_by_vsf(sim):
    # a [b@fsdp, t@cp] split merged into one dim on a mesh ("fsdp", "cp") is S(0), S(0)/sf2 (cp's
    # split of each fsdp shard's 2 rows of b); gathering over fsdp alone keeps cp's split of
    # every b, S(0)/sf4: one all-gather. S(0)/sf2 kept instead (cp holding whole b's) needs the
    # dim gathered over cp and fsdp and sliced again. On a mesh ("cp", "dp"), dp splitting last
    # after a strided cp shard gathers in one step.
    sim(4, compute=False)
    fsdp_cp = vsf.make_mesh((2, 2), ("fsdp", "cp"))
    t = torch.empty(16, 3)
    assert local_step(
        fsdp_cp, t, (Shard(0), StridedShard(0, split_factor=2)), (R, StridedShard(0, split_factor=4))
    ) == (0, 0)
    kinds = [
        (c.kind, c.axis, c.shape)
        for c in collectives_of(
            fsdp_cp, t, (Shard(0), StridedShard(0, split_factor=2)), (R, StridedShard(0, split_factor=4))
        )
    ]
    assert kinds == [("all_gather", "fsdp", (8, 3))]
    kept = (R, StridedShard(0, split_factor=2))
    assert local_step(fsdp_cp, t, (Shard(0), StridedShard(0, split_factor=2)), kept) is None
    regather = strided_regather(fsdp_cp, (16, 3), (Shard(0), StridedShard(0, split_factor=2)), kept)
    assert regather.gathers == (
        (1, 0, StridedShard(0, split_factor=2), 8),
        (0, 0, Shard(0), 16),
    ) and regather.slices == ((1, 0, StridedShard(0, split_factor=2), 16),)
    got = collectives_of(fsdp_cp, t, (Shard(0), StridedShard(0, split_factor=2)), kept)
    # an all-gather sends (n-1)/n of what it gathers: 8 x 3 and 16 x 3 f32
    assert [(c.kind, c.axis, c.shape, c.bytes) for c in got] == [
        ("all_gather", "cp", (8, 3), 8 * 3 * 4 // 2),
        ("all_gather", "fsdp", (16, 3), 16 * 3 * 4 // 2),
    ]
    cp_dp = vsf.make_mesh((2, 2), ("cp", "dp"))
    assert local_step(cp_dp, t, (StridedShard(0, split_factor=4), Shard(0)), (StridedShard(0, split_factor=4), R)) == (
        1,
        0,
    )
    assert (
        strided_regather(cp_dp, (15, 3), (StridedShard(0, split_factor=4), Shard(0)), (R, R)) is None
    )  # uneven: not vsf's


def test_a_split_moved_to_another_dim_into_a_strided_shard_is_one_all_to_all(sim):
    # the tokens [batch@ep, seq@cp] on a mesh ("cp", "ep") (S(1), S(0)) split over the batch
    # ep-major, P(("ep", "cp")) (S(0)/sf2, S(0)), for an expert dispatch: each ep group's 2 batch
    # rows change hands over cp alone, one all-to-all of a rank's 2 x 8 x 4 floats (half of it
    # sent); DTensor would gather over both axes. Oracle: DTensor's own split of each layout
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("cp", "ep"))
    src, dst = (Shard(1), Shard(0)), (StridedShard(0, split_factor=2), Shard(0))
    assert vsf.NamedSharding(mesh, vsf.P(("ep", "cp"))).placements == dst
    x = torch.arange(4 * 16 * 4).view(4, 16, 4)
    assert local_step(mesh, x, src, dst) == (0, 0) and local_step(mesh, x, dst, src) == (0, 1)
    for a, b, shape in ((src, dst, (2, 8, 4)), (dst, src, (1, 16, 4))):
        assert [(c.kind, c.axis, c.shape, c.bytes) for c in collectives_of(mesh, x, a, b)] == [
            ("all_to_all", "cp", shape, 2 * 8 * 4 * 8 // 2)
        ]
    coords = list(itertools.product(range(2), range(2)))
    with _compat.local_mode_disabled():
        shards = {pl: [_compat.shard_of(x, pl, (2, 2), c).contiguous() for c in coords] for pl in (src, dst)}
    for a, b in ((src, dst), (dst, src)):
        got = _compat.local_shards(move_local(mesh, x, _compat.make_local(dict(enumerate(shards[a]))), a, b), 0)
        for r, c in enumerate(coords):
            assert torch.equal(got[r], shards[b][r]), (a, b, c)


def test_one_mesh_dims_strided_piece_of_the_local_shard_is_gathered_over_that_dim_alone(sim):
    # the tokens [batch@ep, seq@cp] merged on a mesh ("cp", "ep") (S(0)/sf4, S(0)): rank (c, e)
    # holds half c of each of its ep group's 2 sequences. Gathered over cp alone they are ep's
    # whole 2 sequences (R, S(0)): the gathered [cp, sequence, position] transposed to [sequence,
    # cp, position], one all-gather of a rank's 16 x 4 int64 (half of the gathered 32 x 4 sent);
    # back, a local slice. vsf gathered over both axes and sliced ep again. Oracle: DTensor's own
    # split of each layout
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("cp", "ep"))
    src, dst = (StridedShard(0, split_factor=4), Shard(0)), (R, Shard(0))
    x = torch.arange(64 * 4).view(64, 4)
    assert [(c.kind, c.axis, c.shape, c.bytes) for c in collectives_of(mesh, x, src, dst)] == [
        ("all_gather", "cp", (32, 4), 32 * 4 * 8 // 2)
    ]
    assert collectives_of(mesh, x, dst, src) == ()
    coords = list(itertools.product(range(2), range(2)))
    with _compat.local_mode_disabled():
        shards = {pl: [_compat.shard_of(x, pl, (2, 2), c).contiguous() for c in coords] for pl in (src, dst)}
    # rank 1, (c, e) = (0, 1): the first halves of sequences 2 and 3
    assert torch.equal(shards[src][1], torch.cat([x[32:40], x[48:56]]))
    for a, b in ((src, dst), (dst, src)):
        got = _compat.local_shards(move_local(mesh, x, _compat.make_local(dict(enumerate(shards[a]))), a, b), 0)
        for r, c in enumerate(coords):
            assert torch.equal(got[r], shards[b][r]), (a, b, c)


# ops that work along the last dim of the tokens' rows (a router's softmax and top-k, a loss's
# log-softmax), each with its line in the plan
ALONG_THE_ROW = {
    "softmax": (lambda h: torch.softmax(h, -1), "_softmax("),
    "log_softmax": (lambda h: torch.log_softmax(h, -1), "_log_softmax("),
    "topk": (lambda h: torch.topk(h, 3, -1).values, "topk("),
    "topk_indices": (lambda h: h * torch.topk(h, 3, -1).indices.sum(-1, keepdim=True), "topk("),
}


def _only_the_loss_moves(loss, x: torch.Tensor, mesh):
    """``value_and_grad(loss)`` jitted on ``x`` split ``P("ep", "cp")`` over ``mesh``: its loss and
    gradient are one device's and the only collectives are the loss's sums over cp and ep (4 B
    each); returns the lowered step."""
    want = vsf.value_and_grad(loss)(x)
    arg = vsf.device_put(x, vsf.NamedSharding(mesh, vsf.P("ep", "cp")))
    step = vsf.jit(vsf.value_and_grad(loss))
    torch.testing.assert_close(vsf.device_get(step(arg)), want, rtol=1e-5, atol=1e-6)
    lowered = step.lower(arg)
    assert sorted((c.axis, c.kind, c.bytes) for c in lowered.cost().collectives) == [
        ("cp", "all_reduce", 4),
        ("ep", "all_reduce", 4),
    ]
    return lowered


@pytest.mark.parametrize("name", list(ALONG_THE_ROW))
def test_ops_along_a_dim_no_mesh_dim_splits_run_on_rows_split_as_a_strided_shard(sim, name):
    # the tokens [4, 16, 8] split [batch@ep, seq@cp] on a mesh ("cp", "ep"), merged into 64 rows:
    # S(0)/sf4 over cp (each rank holds half of each of its ep group's 2 sequences), S(0) over ep.
    # The op works along the last dim, which no mesh dim splits: each rank runs it on its rows,
    # forward and backward, and nothing moves but the loss (a sum over each axis, 4 B each; by
    # hand). Oracle: the same function on one device
    op, line = ALONG_THE_ROW[name]
    scale = torch.linspace(0.5, 1.5, 8)

    def loss(x):
        y = op(x.reshape(64, 8))
        return (y.reshape(4, 16, -1) * scale[: y.shape[-1]]).pow(2).sum()

    x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(0))
    sim(4)
    lowered = _only_the_loss_moves(loss, x, vsf.make_mesh((2, 2), ("cp", "ep")))
    (ran,) = [t for t in lowered.as_text().splitlines() if f"= {line}" in t]
    assert ran.count("[64@<cp/sf4,ep>,") >= 2  # its input and output(s): the rows as they arrive


def test_attention_runs_on_a_batch_split_as_a_strided_shard(sim):
    # queries, keys and values [4, 4, 16, 8] viewed from [2@ep, 2@cp, 4, 16, 8] on a mesh ("cp",
    # "ep"): their batch is split ep-major, S(0)/sf2 over cp. Causal attention works along the
    # sequence and the head dim, which no mesh dim splits: each rank runs it on its batch rows,
    # forward and backward, and nothing moves but the loss. Oracle: the same function on one device
    def loss(x):
        q = x.reshape(4, 4, 16, 8)
        out = torch.nn.functional.scaled_dot_product_attention(q, q * 0.5, q.flip(-1), is_causal=True)
        return (out.reshape(2, 2, 4, 16, 8) ** 2).sum()

    x = torch.randn(2, 2, 4, 16, 8, generator=torch.Generator().manual_seed(0))
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("cp", "ep"))
    assert vsf.NamedSharding(mesh, vsf.P(("ep", "cp"))).placements == (StridedShard(0, split_factor=2), Shard(0))
    lowered = _only_the_loss_moves(loss, x, mesh)
    ran = [t for t in lowered.as_text().splitlines() if "= _scaled_dot_product" in t]
    assert len(ran) == 2 and all(t.count("f32[4@(ep,cp),4,16,8]") >= 3 for t in ran)  # forward and backward


def test_a_value_nested_in_mesh_order_is_not_moved_to_another_inputs_nesting(sim):
    # x [8, 4] on P(("tp", "dp")) (dp nested inside tp, against the mesh order) and y of the same
    # shape on P(("dp", "tp")): each is scaled where it is, and nothing moves. The nesting of a
    # strided input is preferred for the values of its shape (a ZeRO state's gradient and update
    # reach it without a regather), but not over a value that arrives split the plain way on the
    # same dims: y * 2 was gathered into x's nesting and back (4 all-gathers). Oracle: one device
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, vsf.P(("tp", "dp"))))
    ys = vsf.device_put(y, vsf.NamedSharding(mesh, vsf.P(("dp", "tp"))))
    f = vsf.jit(lambda x, y: (x * 2, y * 2))
    assert f.lower(xs, ys).plan.collectives() == []
    for got, want, typed in zip(f(xs, ys), (x * 2, y * 2), ("f32[8@(tp,dp),4]", "f32[8@(dp,tp),4]")):
        assert vsf.typeof(got) == typed
        torch.testing.assert_close(vsf.device_get(got), want)


def test_tokens_split_on_batch_and_sequence_merged_against_the_mesh_order_stay_split(sim):
    # a linear layer on tokens [batch@dp, seq@cp] on a mesh ("cp", "dp"): its view to rows makes
    # S(0)/sf4, S(0), which DTensor cannot regather but vsf moves itself, so the tokens stay split
    # (they were gathered over dp, with their gradient: 4 x 2 KiB). What moves is the weight's
    # gradient, 32 x 32 floats, which the step may return split: reduce-scattered over cp (half of
    # 4 KiB sent), then its half over dp (half of 2 KiB; all-reducing the half, 2 KiB, was planned
    # while dp was charged for reducing the whole gradient), and the loss. Loss and gradients are
    # one device's.
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) * 0.1
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))

    def loss(w, x):
        return (torch.nn.functional.linear(x, w).relu() ** 2).sum()

    want = vsf.value_and_grad(loss, argnums=(0, 1))(w, x)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("cp", "dp"))
    step = vsf.jit(vsf.value_and_grad(loss, argnums=(0, 1)))
    args = (
        vsf.device_put(w, vsf.NamedSharding(mesh, vsf.P())),
        vsf.device_put(x, vsf.NamedSharding(mesh, vsf.P("dp", "cp"))),
    )
    torch.testing.assert_close(vsf.device_get(step(*args)), want, rtol=1e-5, atol=1e-6)
    assert sorted((c.axis, c.kind, c.bytes) for c in step.lower(*args).cost().collectives) == [
        ("cp", "all_reduce", 4),
        ("cp", "reduce_scatter", 2048),
        ("dp", "all_reduce", 4),
        ("dp", "reduce_scatter", 1024),
    ]


def _layouts(ndim, two_dims):
    one = [R, Shard(0), StridedShard(0, split_factor=2), StridedShard(0, split_factor=4)]
    if two_dims:
        one += [P, Shard(1), StridedShard(1, split_factor=2)]
    return list(itertools.product(one, repeat=ndim))


@pytest.mark.parametrize("sizes", [(2, 2), (2, 2, 2)])
def test_moves_vsf_makes_itself_give_dtensors_own_shards(sim, sizes):
    # oracle: DTensor's split of each layout (shard_of, as distribute_tensor cuts it) of an arange,
    # a partial sum held whole by the first rank of its mesh dim and zeros by the others. Of the
    # pairs of layouts that vsf moves itself (one 1D collective of the local shard, or gathered
    # and sliced again through strided shards) of a [16, 8] tensor, on 2 x 2 ranks (either dim
    # split, a partial sum) and on 2 x 2 x 2 (the rows split), 300 drawn with a fixed seed
    x = torch.arange(16 * 8).view(16, 8)
    coords = list(itertools.product(*(range(k) for k in sizes)))
    layouts = _layouts(len(sizes), two_dims=len(sizes) == 2)

    def held(pl, c):
        whole = all(j == 0 for p, j in zip(pl, c) if isinstance(p, Partial))
        return _compat.shard_of(x, pl, sizes, c).contiguous() * int(whole)

    sim(math.prod(sizes))
    mesh = vsf.make_mesh(sizes, ("a", "b", "c")[: len(sizes)])
    ours = [
        (src, dst)
        for src, dst in itertools.permutations(layouts, 2)
        if not any(
            isinstance(b, Partial) and a != b for a, b in zip(src, dst)
        )  # a partial sum is made by ops, not by moves
        and (local_step(mesh, x, src, dst) is not None or strided_regather(mesh, tuple(x.shape), src, dst) is not None)
    ]
    assert len(ours) > (1000 if len(sizes) == 2 else 200)
    with _compat.local_mode_disabled():
        shards = {pl: [held(pl, c) for c in coords] for pl in layouts}
    for src, dst in random.Random(0).sample(ours, 300):
        got = _compat.local_shards(move_local(mesh, x, _compat.make_local(dict(enumerate(shards[src]))), src, dst), 0)
        for r, c in enumerate(coords):
            assert torch.equal(got[r], shards[dst][r]), (src, dst, c)


# -- buckets -----------------------------------------------------------------------------------


def _reduction(mesh, gm, node, before):
    v = value_of(node)
    t = node.meta["val"]
    return Redistribution(v, (P,), (R,), collectives_of(mesh, t, (P,), (R,)), before)


def test_independent_all_reduces_share_one_bucket(sim):
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    gm = _graph(lambda a, b: (a * 2, b * 3), (8, 4), (8, 2))
    out = output_node(gm)
    muls = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    moves = [_reduction(mesh, gm, n, out) for n in muls]
    buckets, order = form_buckets(mesh, gm, moves, {id(r): [out] for r in moves}, BUCKET_BYTES)
    (bucket,) = buckets
    assert bucket.members == tuple(moves) and bucket.mesh_dims == (0,) and bucket.before is out
    # one all-reduce of 32 + 16 floats: the members' bytes, 2(n-1)/n of 128 and 64 bytes
    assert bucket.collectives == (Collective("all_reduce", "dp", (48,), torch.float32, 128 + 64),)
    assert order.index(bucket) > max(order.index(n) for n in muls) and order.index(bucket) < order.index(out)


def test_a_reduction_that_depends_on_another_is_not_bucketed_with_it(sim):
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    gm = _graph(lambda a, b: (a * 2 + b) * 3, (8, 4), (8, 4))
    out = output_node(gm)
    first, last = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    (add,) = [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    moves = [_reduction(mesh, gm, first, add), _reduction(mesh, gm, last, out)]
    buckets, order = form_buckets(mesh, gm, moves, {id(moves[0]): [add], id(moves[1]): [out]}, BUCKET_BYTES)
    # each reduction alone, started right after its value exists
    nodes = list(gm.graph.nodes)
    want = (
        nodes[: nodes.index(first) + 1]
        + [moves[0]]
        + nodes[nodes.index(first) + 1 : nodes.index(last) + 1]
        + [moves[1], out]
    )
    assert buckets == () and list(order) == want


def test_uneven_or_mixed_dtype_reductions_stay_apart(sim):
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    gm = _graph(lambda a, b: (a * 2, b.double() * 3), (8, 4), (8, 4))
    out = output_node(gm)
    muls = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    moves = [_reduction(mesh, gm, n, out) for n in muls]
    assert form_buckets(mesh, gm, moves, {id(r): [out] for r in moves}, BUCKET_BYTES)[0] == ()  # float32 and float64
    odd = _graph(lambda a, b: (a * 2, b * 3), (5, 4), (8, 4))
    out = output_node(odd)
    moves = [
        Redistribution(value_of(n), (Shard(0),), (R,), (), out) for n in odd.graph.nodes if n.target is aten.mul.Tensor
    ]
    assert (
        form_buckets(mesh, odd, moves, {id(r): [out] for r in moves}, BUCKET_BYTES)[0] == ()
    )  # gathers, not reductions


def test_which_redistributions_can_join_a_bucket(sim):
    sim(4, compute=False)
    mesh = vsf.make_mesh((2, 2), ("dp", "fsdp"))
    gm = _graph(lambda a: a * 2, (8, 4))
    v = value_of(_node(gm, aten.mul.Tensor))
    S0, S1, avg = Shard(0), Shard(1), Partial("avg")

    def kind(src, dst):
        return bucket_kind(mesh, Redistribution(v, src, dst, (), output_node(gm)))

    assert kind((P, P), (R, R)) == ("all_reduce", (0, 1)) and kind((R, avg), (R, R)) == ("all_reduce", (1,))
    assert kind((R, S0), (R, R)) == ("all_gather", (1,)) and kind((S1, S0), (S1, R)) == ("all_gather", (1,))
    assert kind((R, P), (R, S0)) == ("reduce_scatter", (1,))
    assert kind((S0, S0), (S0, R)) is None  # dim 0 split twice: the gathered rows interleave
    assert kind((R, StridedShard(0, split_factor=2)), (R, R)) is None
    assert kind((R, Partial("max")), (R, R)) is None
    assert kind((S0, R), (R, S0)) is None  # two mesh dims change
    odd = value_of(_node(_graph(lambda a: a * 2, (5, 4)), aten.mul.Tensor))  # 5 rows do not split over 2
    assert bucket_kind(mesh, Redistribution(odd, (R, S1), (R, R), (), output_node(gm))) == ("all_gather", (1,))
    assert bucket_kind(mesh, Redistribution(odd, (R, P), (R, S0), (), output_node(gm))) is None


def test_moves_holding_one_layout_object_join_buckets_by_their_own_kind_and_shape(sim):
    """Moves that hold one source or destination layout object (as a plan's do: its layouts are
    interned) still bucket by their own kind: 5 rows do not split evenly over 2, so that gather
    joins no bucket; a partial sum reduced whole and one reduced into a shard, or a partial sum
    and a shard made whole, are buckets of their own."""
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    S0, whole, summed = (Shard(0),), (R,), (P,)

    def buckets(f, shapes, layouts):
        gm = _graph(f, *shapes)
        out = output_node(gm)
        muls = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
        moves = [Redistribution(value_of(n), src, dst, (), out) for n, (src, dst) in zip(muls, layouts)]
        found = form_buckets(mesh, gm, moves, {id(r): [out] for r in moves}, BUCKET_BYTES)[0]
        return [(b.kind, [moves.index(r) for r in b.members]) for b in found]

    gathers = [(S0, whole)] * 3
    assert buckets(lambda a, b, c: (a * 2, b * 3, c * 4), [(5, 4), (8, 4), (8, 4)], gathers) == [("all_gather", [1, 2])]
    reductions = [(summed, whole), (summed, S0)] * 2
    assert buckets(lambda a: (a * 2, a * 3, a * 4, a * 5), [(8, 4)], reductions) == [
        ("all_reduce", [0, 2]),
        ("reduce_scatter", [1, 3]),
    ]
    made_whole = [(summed, whole), (S0, whole)] * 2
    assert buckets(lambda a: (a * 2, a * 3, a * 4, a * 5), [(8, 4)], made_whole) == [
        ("all_reduce", [0, 2]),
        ("all_gather", [1, 3]),
    ]


def test_gathers_share_a_bucket_placed_right_before_the_first_use(sim):
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("fsdp",))
    gm = _graph(lambda x, a, b: (x * 3) @ a @ b, (4, 8), (8, 8), (8, 8))
    x, a, b = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mul = _node(gm, aten.mul.Tensor)
    mm1, mm2 = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    moves = [
        Redistribution(value_of(w), (Shard(0),), (R,), collectives_of(mesh, w.meta["val"], (Shard(0),), (R,)), mm)
        for w, mm in ((a, mm1), (b, mm2))
    ]
    buckets, order = form_buckets(mesh, gm, moves, {id(moves[0]): [mm1], id(moves[1]): [mm2]}, BUCKET_BYTES)
    (bucket,) = buckets
    assert bucket.kind == "all_gather" and bucket.members == tuple(moves) and bucket.before is mm1
    # one all-gather into 2 x 64 floats, each rank sending its halves: (n-1)/n of 256 bytes each
    assert bucket.collectives == (Collective("all_gather", "fsdp", (128,), torch.float32, 128 + 128),)
    assert order.index(mul) < order.index(bucket) < order.index(mm1)


def test_a_gather_of_a_value_computed_from_another_gathers_use_starts_a_new_bucket(sim):
    """Gathers in the order of their first uses: ``y`` is computed from the first gather's use,
    so it cannot join that bucket (the bucket would wait for its own use); ``b``, a plain input,
    joins ``y``'s. The last gather's use comes after everything, so finding that ``y`` depends
    on the first use walks the graph only up to ``y``."""
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("fsdp",))
    gm = _graph(lambda x, a, b: ((x @ a) * 2) @ b, (8, 8), (8, 8), (8, 8))
    x, a, b = [n for n in gm.graph.nodes if n.op == "placeholder"]
    y = _node(gm, aten.mul.Tensor)
    mm1, mm2 = [n for n in gm.graph.nodes if n.target is aten.mm.default]
    moves = [
        Redistribution(value_of(v), (Shard(0),), (R,), collectives_of(mesh, v.meta["val"], (Shard(0),), (R,)), mm)
        for v, mm in ((a, mm1), (y, mm2), (b, mm2))
    ]
    users = {id(moves[0]): [mm1], id(moves[1]): [mm2], id(moves[2]): [mm2]}
    buckets, order = form_buckets(mesh, gm, moves, users, BUCKET_BYTES)
    (bucket,) = buckets  # a's gather alone is no bucket
    assert bucket.members == tuple(moves[1:]) and bucket.before is mm2
    assert order.index(y) < order.index(bucket) < order.index(mm2)


def test_reductions_bucket_by_size_in_production_order_and_their_users_run_bucket_by_bucket(sim):
    """Three pairs of gradients produced one pair after the other (a backward), each pair used by
    the optimizer-like adds written in the opposite order: with buckets of two values (256 B),
    each pair is one bucket started right after its second value, and the adds run bucket by
    bucket, the first bucket's first (they wait for no later collective)."""
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))

    def f(x):
        a1, b1 = x * 2, x * 3
        a2, b2 = a1 * 4, b1 * 5
        a3, b3 = a2 * 6, b2 * 7
        return a3 + 1, b3 + 1, a2 + 1, b2 + 1, a1 + 1, b1 + 1

    gm = _graph(f, (8, 4))
    muls = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    adds = {n.args[0]: n for n in gm.graph.nodes if n.target is aten.add.Tensor}
    moves = [_reduction(mesh, gm, m, adds[m]) for m in muls]
    buckets, order = form_buckets(mesh, gm, moves, {id(r): [adds[m]] for r, m in zip(moves, muls)}, 2 * 8 * 4 * 4)
    assert [b.members for b in buckets] == [tuple(moves[0:2]), tuple(moves[2:4]), tuple(moves[4:6])]
    at = {id(item): i for i, item in enumerate(order)}
    for k, b in enumerate(buckets):
        first, second = muls[2 * k : 2 * k + 2]
        assert at[id(b)] == at[id(second)] + 1  # right after its last value
        users = [at[id(adds[m])] for m in (first, second)]
        assert max(users) < min((at[id(adds[m])] for m in muls[2 * k + 2 :]), default=len(order))
        assert min(users) > at[id(buckets[-1])]  # after the whole "backward"


def test_a_reduction_of_little_values_computed_from_the_inputs_starts_first(sim):
    """A mean's token count (the sum of a mask of an input) is reduced before the heavy compute
    that comes before it in the graph, so the reduction overlaps it; a reduction of a big result
    stays right after its value."""
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    gm = _graph(lambda x, t: ((x @ x) * 2, (t > 0).sum()), (256, 256), (8,))
    out = output_node(gm)
    mm, mul = _node(gm, aten.mm.default), _node(gm, aten.mul.Tensor)
    count = [n for n in gm.graph.nodes if n.target is aten.sum.default][0]
    moves = [_reduction(mesh, gm, count, out), _reduction(mesh, gm, mul, out)]
    buckets, order = form_buckets(mesh, gm, moves, {id(r): [out] for r in moves}, BUCKET_BYTES)
    assert buckets == ()  # (an integer and a float: each alone)
    at = {id(item): i for i, item in enumerate(order)}
    assert at[id(moves[0])] < at[id(mm)] and at[id(moves[1])] == at[id(mul)] + 1
    assert [n.op for n in order[:2]] == ["placeholder", "placeholder"]


# -- the driver ------------------------------------------------------------------------------


def test_an_elementwise_op_keeps_its_input_sharding_and_moves_nothing(sim):
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    gm = _graph(lambda x: x * 2, (8, 4))
    plan = propagate(gm, mesh, [(Shard(0),)], [None], PlanOptions())
    mul = _node(gm, aten.mul.Tensor)
    assert plan.nodes[mul].ins == ((Shard(0),),) and plan.nodes[mul].outs == ((Shard(0),),)
    assert plan.nodes[mul].op.kind == "strategy" and plan.nodes[mul].direct
    assert plan.collectives() == [] and plan.outputs == ((Shard(0),),)


def test_a_split_contraction_is_reduced_once_where_the_output_asks(sim):
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    gm = _graph(lambda x, w: x @ w, (4, 8), (8, 6))
    plan = propagate(gm, mesh, [(Shard(1),), (Shard(0),)], [vsf.NamedSharding(mesh, vsf.P())], PlanOptions())
    mm = _node(gm, aten.mm.default)
    assert plan.nodes[mm].outs == ((P,),)
    # the 4x6 float32 result (96 bytes) all-reduced over 2 ranks: 2(n-1)/n * 96
    assert plan.collectives() == [Collective("all_reduce", "dp", (4, 6), torch.float32, 96)]


def test_moves_of_one_shape_and_layouts_are_priced_by_each_values_dtype(sim):
    """The plan finds a move's collectives once per shape, strides, dtype and layouts (repeated
    blocks move the same values): three results of one shape gathered alike, two float32 and one
    float64, send (n-1)/n of their own bytes each: 64, 64 and 128 over 2 ranks."""
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    gm = make_fx(lambda a, b, c: (a * 2, b * 2, c * 2), tracing_mode="fake")(
        torch.randn(8, 4), torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4)
    )
    replicated = vsf.NamedSharding(mesh, vsf.P())
    plan = propagate(gm, mesh, [(Shard(0),)] * 3, [replicated] * 3, PlanOptions())
    sent = [(c.dtype, c.bytes) for r in plan.redistributions for c in r.collectives]
    assert sent == [(torch.float32, 64), (torch.float64, 128), (torch.float32, 64)]


# -- overlap -------------------------------------------------------------------------------------


def _collective_graph(in_place: str | None) -> torch.fx.GraphModule:
    """x all-reduced, waited for, viewed, and added to y * 2, after ``in_place`` (``"x"``, ``"y"``,
    or a view of x) has 1 added to it in place, if given."""
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    issued = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    waited = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (issued,))
    flat = g.call_function(aten.view.default, (waited, [-1]))
    doubled = g.call_function(aten.mul.Tensor, (y, 2))
    if in_place is not None:
        written = {"x": x, "y": y}.get(in_place) or g.call_function(aten.t.default, (x,))
        g.call_function(aten.add_.Tensor, (written, 1))
    g.output(g.call_function(aten.add.Tensor, (flat, doubled)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_a_reduce_scatter_is_waited_for_before_the_next_one_is_issued():
    """Two reduce-scatters whose results are first used at the end (a backward's gradient
    buckets, used by the optimizer): the first is waited for where the second is issued, so the
    unreduced buffer it holds is freed then; the second waits for its first use."""
    from vsf.jit.overlap import wait_late

    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    rs = torch.ops._c10d_functional.reduce_scatter_tensor.default
    first = g.call_function(rs, (x, "sum", 2, "0"))
    w1 = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (first,))
    mid = g.call_function(aten.mul.Tensor, (y, 2))
    second = g.call_function(rs, (mid, "sum", 2, "0"))
    w2 = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (second,))
    late = g.call_function(aten.mul.Tensor, (y, 3))
    g.output(g.call_function(aten.add.Tensor, (g.call_function(aten.add.Tensor, (w1, w2)), late)))
    gm = wait_late(torch.fx.GraphModule(torch.nn.Module(), g))
    names = [n.name for n in gm.graph.nodes]
    assert names.index(mid.name) < names.index(w1.name) < names.index(second.name)
    assert names.index(late.name) < names.index(w2.name)


@pytest.mark.parametrize("in_place", [None, "y", "x", "view of x"])
def test_a_collective_is_waited_for_at_its_first_use_never_past_a_write_of_its_input(in_place):
    from vsf.jit.overlap import wait_late

    names = [
        str(n.target).split(".")[1] if n.op == "call_function" else n.op
        for n in wait_late(_collective_graph(in_place)).graph.nodes
    ]
    if in_place in ("x", "view of x"):  # x is still being sent until the wait
        view = ["t"] if in_place != "x" else []
        assert names == [
            "placeholder",
            "placeholder",
            "all_reduce",
            "mul",
            *view,
            "wait_tensor",
            "view",
            "add_",
            "add",
            "output",
        ]
    else:  # writing another buffer in place holds no wait back
        assert names == [
            "placeholder",
            "placeholder",
            "all_reduce",
            "mul",
            *(["add_"] if in_place else []),
            "wait_tensor",
            "view",
            "add",
            "output",
        ]
