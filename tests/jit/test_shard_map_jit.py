"""vsf.shard_map inside vsf.jit (manual regions) on simulated ranks, against the same math on one
device: values, gradients of every collective by torch autograd, a Megatron MLP train step, a
ring of ppermutes, the plan's collectives and the errors."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint
from torch.distributed.tensor.debug import CommDebugMode

import vsf
from vsf import P, optim
from vsf.jit import manual
from vsf.jit.plan import Collective


def blocks(x: torch.Tensor, n: int = 4) -> torch.Tensor:
    """``x``'s ``n`` row blocks stacked: what ranks 0..n-1 of ``P("i")`` hold."""
    return x.reshape(n, x.shape[0] // n, *x.shape[1:])


@dataclasses.dataclass(frozen=True)
class Case:
    """A region over a 1D mesh ``i`` of 4 and the one-device function of the global input it computes."""

    name: str
    body: Callable[[torch.Tensor], torch.Tensor]
    in_spec: P
    out_spec: P
    oracle: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]
    forward: tuple[str, ...]  # the collectives the body runs, and those its backward runs
    backward: tuple[str, ...]


# rank i sends BALANCED[i][j] of its 4 rows to rank j: each sends 4 and receives 4, in uneven blocks
BALANCED = ((1, 0, 2, 1), (0, 3, 0, 1), (2, 1, 0, 1), (1, 0, 2, 1))


def balanced_rows() -> list[int]:
    """The global rows ``all_to_all_v(x, BALANCED)`` gives over ``P("i")``, in order (hand-computed
    from the matrix: rank j stacks the blocks rank 0, 1, ... send it)."""
    starts = [[4 * i + sum(BALANCED[i][:j]) for j in range(4)] for i in range(4)]
    return [starts[i][j] + k for j in range(4) for i in range(4) for k in range(BALANCED[i][j])]


CASES = [
    Case(
        "psum",
        lambda x: vsf.ops.psum(x, "i"),
        P("i"),
        P(),
        lambda x: blocks(x).sum(0),
        (8, 3),
        ("all_reduce",),
        ("all_reduce",),
    ),
    Case(
        "pmean",
        lambda x: vsf.ops.pmean(x, "i"),
        P("i"),
        P(),
        lambda x: blocks(x).mean(0),
        (8, 3),
        ("all_reduce",),
        ("all_reduce",),
    ),
    Case(
        "pmax",
        lambda x: vsf.ops.pmax(x, "i"),
        P("i"),
        P(),
        lambda x: blocks(x).amax(0),
        (8, 3),
        ("all_reduce",),
        ("all_reduce", "all_reduce"),
    ),  # ties counted, cotangents summed
    Case(
        "all_gather",
        lambda x: vsf.ops.all_gather(x, "i", dim=1),
        P("i"),
        P("i"),
        lambda x: torch.cat(list(blocks(x)), 1).repeat(4, 1),
        (8, 3),
        ("all_gather",),
        ("reduce_scatter",),
    ),
    Case(
        "all_gather_untiled",
        lambda x: vsf.ops.all_gather(x, "i", dim=0, tiled=False),
        P("i"),
        P(),
        blocks,
        (8, 3),
        ("all_gather",),
        ("reduce_scatter",),
    ),
    Case(
        "psum_scatter",
        lambda x: vsf.ops.psum_scatter(x, "i", dim=0),
        P("i"),
        P("i"),
        lambda x: blocks(x).sum(0),
        (16, 3),
        ("reduce_scatter",),
        ("all_gather",),
    ),
    Case(
        "all_to_all",
        lambda x: vsf.ops.all_to_all(x, "i", 0, 1),
        P("i"),
        P("i"),
        lambda x: blocks(x).permute(1, 0, 2).reshape(4, 12),
        (16, 3),
        ("all_to_all",),
        ("all_to_all",),
    ),
    Case(
        "ppermute",
        lambda x: vsf.ops.ppermute(x, "i", [(j, (j + 1) % 4) for j in range(4)]),
        P("i"),
        P("i"),
        lambda x: torch.roll(x, 2, 0),
        (8, 3),
        ("ppermute",),
        ("ppermute",),
    ),
    Case(
        "ppermute_partial",
        lambda x: vsf.ops.ppermute(x, "i", [(0, 2), (1, 3)]),
        P("i"),
        P("i"),
        lambda x: torch.cat([torch.zeros(4, 3), x[:4]]),
        (8, 3),
        ("ppermute",),
        ("ppermute",),
    ),
    Case(
        "all_gather_v_even",
        lambda x: vsf.ops.all_gather_v(x, "i", sizes=(2, 2, 2, 2)),
        P("i"),
        P(),
        lambda x: x,
        (8, 3),
        ("all_gather",),
        ("reduce_scatter",),
    ),
    Case(
        "reduce_scatter_v_even",
        lambda x: vsf.ops.reduce_scatter_v(x, "i", sizes=(1, 1, 1, 1)),
        P("i"),
        P("i"),
        lambda x: blocks(x).sum(0),
        (16, 3),
        ("reduce_scatter",),
        ("all_gather",),
    ),
    Case(
        "all_to_all_v_balanced",
        lambda x: vsf.ops.all_to_all_v(x, "i", BALANCED),
        P("i"),
        P("i"),
        lambda x: x[balanced_rows()],
        (16, 3),
        ("all_to_all_v",),
        ("all_to_all_v",),
    ),
    Case(
        "axis_index",
        lambda x: x * (vsf.ops.axis_index("i") + 1),
        P("i"),
        P("i"),
        lambda x: x * torch.arange(1.0, 5.0).repeat_interleave(2)[:, None],
        (8, 3),
        (),
        (),
    ),
    Case("replicated_input", lambda x: x * vsf.ops.axis_size("i"), P(), P(), lambda x: x * 4, (8, 3), (), ()),
]


def _region_kinds(lowered: vsf.jit.Lowered) -> list[str]:
    return [c.kind for step in lowered.plan.nodes.values() for c in step.collectives]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_collective_and_its_gradient_equal_torch_on_one_device(sim, case):
    torch.manual_seed(0)
    x = torch.randn(case.shape)
    want_y = case.oracle(x)
    w = torch.randn(want_y.shape)
    xr = x.clone().requires_grad_()
    (case.oracle(xr) * w).sum().backward()
    sim(4)
    mesh = vsf.make_mesh((4,), ("i",))
    region = vsf.shard_map(case.body, mesh=mesh, in_specs=case.in_spec, out_specs=case.out_spec)
    forward = vsf.jit(region)
    step = vsf.jit(lambda x, w: vsf.value_and_grad(lambda x: (region(x) * w).sum())(x))
    xs, ws = vsf.device_put((x, w), vsf.NamedSharding(mesh, P()))
    torch.testing.assert_close(vsf.device_get(forward(xs)), want_y)
    loss, g = step(xs, ws)
    torch.testing.assert_close(vsf.device_get(loss), (want_y * w).sum())
    torch.testing.assert_close(vsf.device_get(g), xr.grad)
    assert _region_kinds(step.lower(xs, ws)) == [*case.forward, *case.backward]
    assert _region_kinds(forward.lower(xs)) == list(case.forward)


def mlp(x, w1, w2):
    return vsf.ops.psum(torch.relu(x @ w1) @ w2, "tp")


def plain_mlp(x, w1, w2):
    return torch.relu(x @ w1) @ w2


MEGATRON = (P("dp"), P(None, "tp"), P("tp"))


def _mlp_case():
    torch.manual_seed(0)
    return torch.randn(8, 4), torch.randn(4, 8) / 2, torch.randn(8, 4) / 2, torch.randn(8, 4)


def test_the_body_is_traced_into_the_plan_and_its_psum_is_a_collective_of_the_program(sim):
    x, w1, w2, _ = _mlp_case()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    region = vsf.shard_map(mlp, mesh=mesh, in_specs=MEGATRON, out_specs=P("dp"))
    f = vsf.jit(lambda x, w1, w2: region(x, w1, w2) * 2)
    args = vsf.device_put((x, w1, w2), vsf.NamedSharding(mesh, P()))
    lowered = f.lower(*args)
    text = lowered.as_text()
    # each argument enters as its in_spec says; the body's ops run on the local [4, 4] blocks
    assert "manual_in(%arg0_1:f32[8@dp,4]) -> f32[4,4]" in text
    assert "manual_in(%arg1_1:f32[4,8@tp]) -> f32[4,4]" in text
    assert "mm(%manual_in:f32[4,4], %manual_in_1:f32[4,4]) -> f32[4,4]" in text
    assert "manual_out(%manual_collective:f32[4,4]) -> f32[8@dp,4]" in text
    # each rank's [4 rows, 4] partial product is all-reduced over tp=2: 2(n-1)/n of 64 bytes
    assert "all_reduce over tp (inside shard_map(mlp)): [4, 4] 64 B sent" in text
    assert Collective("all_reduce", "tp", (4, 4), torch.float32, 64) in lowered.cost().collectives
    assert lowered.cost().count("all_reduce", "tp") == 1
    torch.testing.assert_close(vsf.device_get(f(*args)), 2 * plain_mlp(x, w1, w2))


@pytest.mark.parametrize(
    "make_tx", [lambda: optim.sgd(0.1), lambda: optim.adamw(1e-2, weight_decay=0.1)], ids=["sgd", "adamw"]
)
def test_a_megatron_mlp_region_in_a_jitted_train_step_equals_the_unsharded_step(sim, make_tx):
    x, w1, w2, t = _mlp_case()
    tx = make_tx()

    def make_step(model):
        def train_step(params, opt_state, x, t):
            loss, grads = vsf.value_and_grad(lambda p: (model(x, *p) - t).pow(2).mean())(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optim.apply_updates(params, updates), opt_state, loss

        return train_step

    want, state, want_losses = (w1, w2), tx.init((w1, w2)), []
    plain_step = make_step(plain_mlp)
    for _ in range(3):
        want, state, loss = plain_step(want, state, x, t)
        want_losses.append(loss)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    region = vsf.shard_map(mlp, mesh=mesh, in_specs=MEGATRON, out_specs=P("dp"))
    p = vsf.device_put((w1, w2), (vsf.NamedSharding(mesh, P(None, "tp")), vsf.NamedSharding(mesh, P("tp"))))
    s = optim.init_sharded(tx, p)
    b = vsf.device_put((x, t), vsf.NamedSharding(mesh, P("dp")))
    step = vsf.jit(make_step(region))
    for want_loss in want_losses:
        p, s, loss = step(p, s, *b)
        torch.testing.assert_close(vsf.device_get(loss), want_loss)
    for got, w in zip(vsf.device_get(p), want):
        torch.testing.assert_close(got, w)
    assert step.plan_count == 1


@pytest.mark.parametrize(
    "recompute",
    [vsf.remat, lambda f: functools.partial(torch.utils.checkpoint.checkpoint, f, use_reentrant=False)],
    ids=["vsf.remat", "torch_checkpoint"],
)
def test_a_region_recomputed_in_the_backward_trains_like_the_unsharded_step(sim, recompute):
    """Activation checkpointing around a region calls its function again in the backward: a second
    region of the same name and specs, with no results (torch stops the recompute once it has the
    saved values), whose body values the first region's backward reads with its own (Mixtral's
    expert dispatch under Hugging Face's gradient checkpointing was a ``PlanError``: 'computes with
    values of shard_map(expert_dispatch) and shard_map(expert_dispatch) at once')."""
    x, w1, w2, t = _mlp_case()

    def step(params, x, t):
        w1, w2 = params
        loss, grads = vsf.value_and_grad(lambda p: (model(x, *p) - t).pow(2).mean())(params)
        return [w - 0.1 * g for w, g in zip(params, grads)], loss

    model = plain_mlp
    want, want_losses = [w1, w2], []
    for _ in range(3):
        want, loss = step(want, x, t)
        want_losses.append(loss)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    model = recompute(vsf.shard_map(mlp, mesh=mesh, in_specs=MEGATRON, out_specs=P("dp")))
    p = vsf.device_put([w1, w2], [vsf.NamedSharding(mesh, P(None, "tp")), vsf.NamedSharding(mesh, P("tp"))])
    b = vsf.device_put((x, t), vsf.NamedSharding(mesh, P("dp")))
    jitted = vsf.jit(step)
    entered = [n for n in jitted.lower(p, *b).plan.graph.graph.nodes if "manual_in." in str(n.target)]
    assert len(entered) == 6  # (the region's 3 arguments enter it again for the recompute)
    for want_loss in want_losses:
        p, loss = jitted(p, *b)
        torch.testing.assert_close(vsf.device_get(loss), want_loss)
    for got, w in zip(vsf.device_get(p), want):
        torch.testing.assert_close(got, w)


def test_commdebugmode_counts_the_planned_collectives_and_checking_mode_runs_the_region(sim):
    x, w1, w2, _ = _mlp_case()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    region = vsf.shard_map(mlp, mesh=mesh, in_specs=MEGATRON, out_specs=P("dp"))
    step = vsf.jit(lambda p, x: vsf.value_and_grad(lambda p: region(x, *p).pow(2).sum())(p))
    x, *p = vsf.device_put((x, w1, w2), vsf.NamedSharding(mesh, P()))
    step(p, x)
    with CommDebugMode() as comm:
        step(p, x)
    planned = step.lower(p, x).cost()
    ran = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    assert ran == {"all_reduce": planned.count("all_reduce"), "all_gather_into_tensor": planned.count("all_gather")}
    assert planned.count("all_reduce", "tp") == 2  # the region's psum and its transpose
    (loss, grads), want = step.check(p, x), step(p, x)
    torch.testing.assert_close(vsf.device_get(loss), vsf.device_get(want[0]))
    for g, w in zip(vsf.tree.leaves(grads), vsf.tree.leaves(want[1])):
        torch.testing.assert_close(vsf.device_get(g), vsf.device_get(w))


def ring_sum(x):
    n = vsf.ops.axis_size("i")
    perm = [(j, (j + 1) % n) for j in range(n)]
    acc = cur = x
    for _ in range(n - 1):
        cur = vsf.ops.ppermute(cur, "i", perm)
        acc = acc + cur
    return acc


def test_a_ring_of_ppermutes_accumulates_the_psum_forward_and_backward(sim):
    torch.manual_seed(0)
    x, w = torch.randn(8, 3), torch.randn(8, 3)
    xr = x.clone().requires_grad_()
    (blocks(xr).sum(0).repeat(4, 1) * w).sum().backward()
    sim(4)
    mesh = vsf.make_mesh((4,), ("i",))
    xs, ws = vsf.device_put((x, w), vsf.NamedSharding(mesh, P("i")))
    got = {}
    for name, body in (("ring", ring_sum), ("psum", lambda x: vsf.ops.psum(x, "i"))):
        region = vsf.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
        step = vsf.jit(lambda x, w: _loss_and_y(region, x, w))
        (_, y), g = step(xs, ws)
        got[name] = (vsf.device_get(y), vsf.device_get(g))
        if name == "ring":
            assert _region_kinds(step.lower(xs, ws)) == ["ppermute"] * 3 * 2
    torch.testing.assert_close(got["ring"][0], blocks(x).sum(0).repeat(4, 1))
    torch.testing.assert_close(got["ring"][0], got["psum"][0])
    torch.testing.assert_close(got["ring"][1], xr.grad)
    torch.testing.assert_close(got["ring"][1], got["psum"][1])


def _loss_and_y(region, x, w):
    def loss(x):
        y = region(x)
        return (y * w).sum(), y

    return vsf.value_and_grad(loss, has_aux=True)(x)


def test_replicated_inputs_and_outputs_follow_the_documented_rule(sim):
    # over an axis an input's spec leaves out, its gradient is the sum over the ranks there; a
    # result out_specs replicates has its cotangent split among them (JAX's rule without check_vma)
    torch.manual_seed(0)
    x, v = torch.randn(8, 3), torch.randn(3)
    xr, vr = x.clone().requires_grad_(), v.clone().requires_grad_()
    (blocks(xr * vr).sum(0).sum() * 3.0).backward()
    sim(4)
    mesh = vsf.make_mesh((4,), ("i",))
    region = vsf.shard_map(
        lambda x, v: vsf.ops.psum((x * v).sum(0), "i"), mesh=mesh, in_specs=(P("i"), P()), out_specs=P()
    )
    step = vsf.jit(lambda x, v: vsf.grad(lambda x, v: region(x, v).sum() * 3.0, argnums=(0, 1))(x, v))
    gx, gv = step(*vsf.device_put((x, v), vsf.NamedSharding(mesh, P())))
    torch.testing.assert_close(vsf.device_get(gx), xr.grad)
    torch.testing.assert_close(vsf.device_get(gv), vr.grad)


def test_a_partial_manual_region_sees_whole_values_over_its_automatic_axes(sim):
    # manual over dp only: the batch is split over dp, the body sees whole values over tp (which
    # the planner may split: tp is automatic here), and its collectives run over dp only
    torch.manual_seed(0)
    x, w, c = torch.randn(8, 3), torch.randn(3, 5), torch.randn(5)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ((xr @ wr).sum(0) * c).sum().backward()
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    seen = []

    def body(x, w):
        seen.append((tuple(x.shape), tuple(w.shape), vsf.ops.axis_size("dp")))
        return vsf.ops.psum((x @ w).sum(0), "dp")

    region = vsf.shard_map(body, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P(), axis_names=("dp",))
    step = vsf.jit(lambda x, w, c: vsf.value_and_grad(lambda x, w: (region(x, w) * c).sum(), argnums=(0, 1))(x, w))
    args = vsf.device_put((x, w, c), vsf.NamedSharding(mesh, P()))
    loss, (gx, gw) = step(*args)
    assert seen[0] == ((4, 3), (3, 5), 2)
    torch.testing.assert_close(vsf.device_get(loss), ((x @ w).sum(0) * c).sum())
    torch.testing.assert_close(vsf.device_get(gx), xr.grad)
    torch.testing.assert_close(vsf.device_get(gw), wr.grad)
    assert {c.axis for step_ in step.lower(*args).plan.nodes.values() for c in step_.collectives} == {"dp"}
    # eagerly too, with the same rule
    eager = vsf.grad(lambda w: (region(args[0], w) * args[2]).sum())(args[1])
    torch.testing.assert_close(vsf.device_get(eager), wr.grad)


def test_bad_regions_are_refused_saying_where(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    x = vsf.device_put(torch.ones(4, 2), vsf.NamedSharding(mesh, P()))

    def jitted(body, **kw):
        return vsf.jit(lambda x: vsf.shard_map(body, mesh=mesh, **kw)(x, x))

    with pytest.raises(ValueError, match=r"in_specs is not a prefix of the value tree at \[1\]"):
        jitted(lambda a, b: a, in_specs=(P(), (P(), P())), out_specs=P())(x)
    with pytest.raises(ValueError, match=r"out_specs is not a prefix of the value tree"):
        jitted(lambda a, b: (a, b), in_specs=P(), out_specs=(P(), P(), P()))(x)
    with pytest.raises(ValueError, match=r"axis_names \('dp', 'pp'\) names 'pp', which is not an axis of the mesh"):
        jitted(lambda a, b: a, in_specs=P(), out_specs=P(), axis_names=("dp", "pp"))(x)
    with pytest.raises(
        ValueError,
        match=r"in_specs gives args\[0\] the spec P\('dp'\), which splits over 'dp'; the region is manual over \('tp',\) only",
    ):
        jitted(lambda a, b: a, in_specs=P("dp"), out_specs=P(), axis_names=("tp",))(x)
    with pytest.raises(ValueError, match=r"out_specs gives the result the spec P\('dp'\), which splits over 'dp'"):
        jitted(lambda a, b: a, in_specs=P(), out_specs=P("dp"), axis_names=("tp",))(x)

    def sums_over_dp(a, b):
        return vsf.ops.psum(a, "dp")

    with pytest.raises(
        ValueError, match=r"psum over 'dp' inside shard_map\(sums_over_dp\): the region makes only \('tp',\) manual"
    ):
        jitted(sums_over_dp, in_specs=P(), out_specs=P(), axis_names=("tp",))(x)

    def sums_over_cp(a, b):
        return vsf.ops.psum(a, "cp")

    with pytest.raises(
        ValueError,
        match=r"psum over unknown mesh axis .cp. inside shard_map\(sums_over_cp\): the mesh has axes \('dp', 'tp'\)",
    ):
        jitted(sums_over_cp, in_specs=P(), out_specs=P())(x)
    line = vsf.make_mesh((4,), ("i",))
    with pytest.raises(
        vsf.PlanError,
        match=r"shard_map\(<lambda>\) runs on Mesh\(\(4,\), \('i',\).*but the jitted step is planned over Mesh\(\(2, 2\), \('dp', 'tp'\)",
    ):
        vsf.jit(lambda x: vsf.shard_map(lambda a: a, mesh=line, in_specs=P(), out_specs=P())(x))(x)
    # the body sees only its arguments (and constants); a collective needs a region
    with pytest.raises(
        vsf.PlanError,
        match=r"shard_map\(<lambda>\): aten.mul.Tensor reads %arg1_1, a value computed outside the region.*pass it to the region as an argument",
    ):
        vsf.jit(lambda x, w: vsf.shard_map(lambda a: a * w, mesh=mesh, in_specs=P(), out_specs=P())(x))(x, x)
    with pytest.raises(
        ValueError,
        match=r"an all_reduce over 'tp' inside vsf.jit: the named-axis collectives of vsf.ops run only inside a vsf.shard_map region",
    ):
        vsf.jit(lambda x: vsf.ops.psum(x, "tp", mesh=mesh))(x)

    def outer(a, b):
        return vsf.shard_map(lambda a: a, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=("dp",))(a)

    with pytest.raises(
        ValueError,
        match=r"shard_map\(<lambda>\) is called inside shard_map\(outer\) in a vsf.jit step: nested regions are not supported",
    ):
        jitted(outer, in_specs=P(), out_specs=P(), axis_names=("tp",))(x)

    # a result out_specs replicates over a manual axis must not vary over it (check_vma)
    def two_results(a, b):
        return vsf.ops.psum(a, "tp"), vsf.ops.ppermute(a, "tp", [(0, 1), (1, 0)])

    with pytest.raises(
        vsf.PlanError,
        match=r"shard_map\(two_results\): the result\[1\] varies over 'tp', but out_specs gives it P\(\), which says it is the same on every rank of 'tp'",
    ):
        jitted(two_results, in_specs=P(), out_specs=P())(x)
    with pytest.raises(vsf.PlanError, match=r"the result varies over 'dp', but out_specs gives it P\(\)"):
        jitted(lambda a, b: vsf.ops.psum(a * vsf.ops.axis_index("dp"), "tp"), in_specs=P(), out_specs=P())(x)
    y, z = jitted(two_results, in_specs=P(), out_specs=P(), check_vma=False)(x)  # trusted: each rank's own
    torch.testing.assert_close(vsf.device_get(y), 2 * torch.ones(4, 2))
    # ragged pieces of different sizes would give a traced value a different shape on each rank
    with pytest.raises(
        ValueError,
        match=r"all_gather_v over 'tp' inside a jitted shard_map: its operand would hold \(3, 1\) rows on ranks 0..1",
    ):
        jitted(lambda a, b: vsf.ops.all_gather_v(a[:3], "tp", sizes=(3, 1)), in_specs=P(), out_specs=P())(x)
    with pytest.raises(
        ValueError, match=r"reduce_scatter_v over 'tp' inside a jitted shard_map: its result would hold \(3, 1\) rows"
    ):
        jitted(lambda a, b: vsf.ops.reduce_scatter_v(a, "tp", sizes=(3, 1)), in_specs=P(), out_specs=P())(x)
    with pytest.raises(
        ValueError,
        match=r"all_to_all_v over 'tp' inside a jitted shard_map: its result \(the send matrix's column sums\) would hold \(3, 5\) rows",
    ):
        jitted(lambda a, b: vsf.ops.all_to_all_v(a, "tp", [[1, 3], [2, 2]]), in_specs=P(), out_specs=P())(x)
    with pytest.raises(ValueError, match=r"args\[0\] has 3 in dim 0, which P\('dp'\) splits 2 ways"):
        jitted(lambda a, b: a, in_specs=P("dp"), out_specs=P("dp"))(
            vsf.device_put(torch.ones(3, 2), vsf.NamedSharding(mesh, P()))
        )
    with pytest.raises(ValueError, match=r"the result\[1\] has 0 dims but out_specs gives it P\('dp'\)"):
        jitted(lambda a, b: (a, a.sum()), in_specs=P(), out_specs=P("dp"))(x)


# -- partial-manual regions: manual over some axes, planned automatically over the others ---------

PARTIAL_MLP = dict(in_specs=(P(), P(None, "tp"), P("tp")), out_specs=P(), axis_names=("tp",))


def _moved_axes(plan, inside: bool) -> set[str]:
    """The mesh axes the plan moves values over, for values a region's body computes (``inside``)
    or for the others."""
    return {
        a
        for r in plan.redistributions
        if manual.inside(r.value[0]) == inside
        for a, s, d in zip(plan.mesh.device_axes, r.src, r.dst)
        if s != d
    }


def test_a_region_manual_over_tp_is_planned_over_dp_and_fsdp_and_its_train_step_equals_one_device(sim):
    # Megatron's MLP by hand over tp; the batch split over (dp, fsdp) and the params over fsdp are
    # left to the planner, which gathers the params inside the region (FSDP) instead of
    # replicating the batch into it
    x, w1, w2, t = _mlp_case()
    tx = optim.adamw(1e-2, weight_decay=0.1)

    def make_step(model):
        def train_step(params, opt_state, x, t):
            loss, grads = vsf.value_and_grad(lambda p: (model(x, *p) - t).pow(2).mean())(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optim.apply_updates(params, updates), opt_state, loss, grads

        return train_step

    want, state, plain = (w1, w2), tx.init((w1, w2)), []
    for _ in range(3):
        want, state, loss, grads = make_step(plain_mlp)(want, state, x, t)
        plain.append((loss, grads))
    sim(8)
    mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    region = vsf.shard_map(mlp, mesh=mesh, **PARTIAL_MLP)
    p = vsf.device_put((w1, w2), (vsf.NamedSharding(mesh, P("fsdp", "tp")), vsf.NamedSharding(mesh, P("tp", "fsdp"))))
    s = optim.init_sharded(tx, p)
    b = vsf.device_put((x, t), vsf.NamedSharding(mesh, P(("dp", "fsdp"))))
    step = vsf.jit(make_step(region))
    lowered = step.lower(p, s, *b)
    for want_loss, want_grads in plain:
        p, s, loss, grads = step(p, s, *b)
        torch.testing.assert_close(vsf.device_get(loss), want_loss)
        for g, w in zip(vsf.device_get(grads), want_grads):
            torch.testing.assert_close(g, w)
    for got, w in zip(vsf.device_get(p), want):
        torch.testing.assert_close(got, w)
    assert step.plan_count == 1
    text = lowered.as_text()
    # the fsdp split of w1's rows enters the body as it is; the batch stays split over (dp, fsdp)
    assert "manual_in(%arg0_1:f32[4@fsdp,8@tp]) -> f32[4@fsdp,4]" in text
    assert "manual_in(%arg7_1:f32[8@(dp,fsdp),4]) -> f32[8@(dp,fsdp),4]" in text
    # inside the region only the automatic axes move values (the params' fsdp gathers, their
    # gradients' reductions); over tp only the region's own psum and its transpose run
    inside = _moved_axes(lowered.plan, inside=True)
    assert "fsdp" in inside and inside <= {"dp", "fsdp"}
    assert "tp" not in _moved_axes(lowered.plan, inside=False)
    cost = lowered.cost()
    assert [c.kind for c in cost.collectives if c.axis == "tp"] == ["all_reduce", "all_reduce"]
    # each rank's psum sums its [2 rows, 4] piece of the batch: 2(n-1)/n of 32 bytes
    assert Collective("all_reduce", "tp", (2, 4), torch.float32, 32) in cost.collectives
    assert cost.count("all_gather", "dp") == 0 and cost.count("all_gather", "fsdp") >= 1
    with CommDebugMode() as comm:
        step(p, s, *b)
    ran = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}
    assert ran == {
        "all_reduce": cost.count("all_reduce"),
        "all_gather_into_tensor": cost.count("all_gather"),
        "reduce_scatter_tensor": cost.count("reduce_scatter"),
    }


def ring_over_cp(x):
    n = vsf.ops.axis_size("cp")
    perm = [(j, (j + 1) % n) for j in range(n)]
    acc = cur = x
    for _ in range(n - 1):
        cur = vsf.ops.ppermute(cur, "cp", perm)
        acc = acc + cur
    return acc


def test_a_ring_of_ppermutes_manual_over_cp_runs_on_each_dp_piece_of_the_batch(sim):
    # x: (batch 4, sequence 8, 3), the sequence in blocks over cp=4, the batch left to the planner
    # over dp=2: each rank sums the 4 sequence blocks of its 2 rows, forward and backward
    torch.manual_seed(0)
    x, c = torch.randn(4, 8, 3), torch.randn(4, 8, 3)

    def oracle(x):
        return x.reshape(4, 4, 2, 3).sum(1, keepdim=True).expand(4, 4, 2, 3).reshape(4, 8, 3)

    xr = x.clone().requires_grad_()
    (oracle(xr) * c).sum().backward()
    sim(8)
    mesh = vsf.make_mesh((2, 4), ("dp", "cp"))
    region = vsf.shard_map(ring_over_cp, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"), axis_names=("cp",))
    step = vsf.jit(lambda x, c: _loss_and_y(region, x, c))
    args = vsf.device_put((x, c), vsf.NamedSharding(mesh, P("dp", "cp")))
    (loss, y), g = step(*args)
    torch.testing.assert_close(vsf.device_get(y), oracle(x))
    torch.testing.assert_close(vsf.device_get(loss), (oracle(x) * c).sum())
    torch.testing.assert_close(vsf.device_get(g), xr.grad)
    (loss, y), g = step.check(*args)  # checking mode: every value outside the region against one device
    torch.testing.assert_close(vsf.device_get(g), xr.grad)
    cost = step.lower(*args).cost()
    # 3 ppermutes forward, 3 back, each of this rank's [2 rows, 2 positions, 3] block
    assert [c_ for c_ in cost.collectives if c_.kind == "ppermute"] == [
        Collective("ppermute", "cp", (2, 2, 3), torch.float32, 48)
    ] * 6
    assert cost.count("all_gather", "dp") == 0


def test_a_balanced_ragged_all_to_all_is_a_collective_of_the_plan_equal_to_the_eager_region(sim):
    torch.manual_seed(0)
    x = torch.randn(16, 3)
    sim(4)
    mesh = vsf.make_mesh((4,), ("i",))
    region = vsf.shard_map(
        lambda x: vsf.ops.all_to_all_v(x, "i", BALANCED) * 2, mesh=mesh, in_specs=P("i"), out_specs=P("i")
    )
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, P("i")))
    jitted = vsf.jit(region)
    torch.testing.assert_close(vsf.device_get(jitted(xs)), vsf.device_get(region(xs)))
    torch.testing.assert_close(vsf.device_get(jitted(xs)), 2 * x[balanced_rows()])
    lowered = jitted.lower(xs)
    # rank 2 keeps none of its 4 rows: 4 rows of 3 floats leave it, the most any rank sends
    assert "all_to_all_v over i (inside shard_map(<lambda>)): [4, 3] 48 B sent" in lowered.as_text()
    assert lowered.cost().collectives == (Collective("all_to_all_v", "i", (4, 3), torch.float32, 48),)


@pytest.mark.parametrize("any_order", [False, True])
def test_an_any_order_region_takes_a_dim_split_against_its_specs_order_as_it_arrives(sim, any_order):
    """A row-wise body (each row scaled by its norm) with rows ``P(("dp", "tp"))`` and the input
    arriving ``P(("tp", "dp"))``: as written the plan moves the 16x4 float rows into the region's
    order and their gradient back; with ``any_order=True`` it takes them as they arrive (the order that moves
    fewer bytes, both planned) and moves nothing. Gradients are one device's either way."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))

    def body(rows):
        return rows * rows.norm(dim=1, keepdim=True)

    def loss(x):
        region = vsf.shard_map(body, in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")), any_order=any_order)
        return (region(x) ** 2).sum()

    x1 = x.clone().requires_grad_(True)
    (body(x1) ** 2).sum().backward()  # the one-device oracle: torch autograd on the whole rows
    sim(4)
    with vsf.use_mesh(vsf.make_mesh((2, 2), ("dp", "tp"))) as mesh:
        arrived = vsf.device_put(x, vsf.NamedSharding(mesh, P(("tp", "dp"))))
        step = vsf.jit(vsf.grad(loss))
        torch.testing.assert_close(vsf.device_get(step(arrived)), x1.grad)
        moved = [(c.kind, c.axis, c.bytes) for c in step.lower(arrived).cost().collectives]
    # as written, the rows are regathered into the region's order and their gradient back into the
    # input's (a rank's 4 rows x 4 floats gathered over tp, then its 8 over dp, and sliced in the
    # other order); the result and its cotangent are used in the order they are in
    regather = [("all_gather", "tp", 4 * 4 * 4), ("all_gather", "dp", 8 * 4 * 4)]
    assert moved == ([] if any_order else regather * 2)
