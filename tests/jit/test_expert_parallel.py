"""Expert parallelism (``vsf.nn.expert_parallel``) inside ``vsf.jit``: experts split over ``ep``, the
tokens dispatched to them and combined back by ragged all-to-alls whose counts the routing gives
each step. Oracle: the same mixture of experts computed densely on one device (each token's chosen
experts' weights indexed and applied), its loss and gradients (experts' weights, tokens, gates);
the exchanges' bytes against the analytic dispatch + combine volume, computed here by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import vsf
from vsf import P

TOKENS, HIDDEN, FFN, EXPERTS, K = 32, 32, 16, 8, 2


def experts(rows, offsets, w_in, w_out):
    return F.grouped_mm(
        F.silu(F.grouped_mm(rows, w_in.transpose(1, 2), offs=offsets)), w_out.transpose(1, 2), offs=offsets
    )


def dense(x, index, gates, w_in, w_out):
    out = torch.zeros_like(x)
    for k in range(index.shape[1]):
        h = F.silu(torch.einsum("th,tfh->tf", x, w_in[index[:, k]]))
        out = out + gates[:, k, None] * torch.einsum("tf,thf->th", h, w_out[index[:, k]])
    return out


def loss_of(moe):
    def loss(p):
        return (moe(p["x"], p["index"], p["gates"], p["w_in"], p["w_out"]) ** 2).sum()

    return loss


def inputs(skewed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, EXPERTS, generator=g)
    if skewed:  # every token to experts 6 and 7: one rank of ep receives every token copy
        logits[:, 6:] += 100.0
    gates, index = torch.softmax(logits, -1).topk(K, -1)
    return {
        "x": torch.randn(TOKENS, HIDDEN, generator=g),
        "gates": gates,
        "index": index,
        "w_in": torch.randn(EXPERTS, FFN, HIDDEN, generator=g) * 0.1,
        "w_out": torch.randn(EXPERTS, HIDDEN, FFN, generator=g) * 0.1,
    }


def _dispatched_like(experts_fn, p, oracle, mesh, token_axes, specs, rtol, atol):
    """``experts_fn`` run through ``vsf.nn.expert_parallel`` over ``ep`` in a jitted step on ``mesh``
    (the tokens, gates and routing split over ``token_axes``, the weights by ``specs``): its loss and
    every gradient equal ``oracle`` (the one-device loss and gradients, to ``rtol``/``atol``), each
    gradient laid out as its input. Returns the step, its inputs and the tokens' sharding."""
    want_loss, want = oracle

    def moe(x, index, gates, w_in, w_out):
        return vsf.nn.expert_parallel(
            experts_fn, x, index, gates, (w_in, w_out), axis="ep", token_axes=token_axes, mesh=mesh
        )

    step = vsf.jit(lambda q, index: vsf.value_and_grad(lambda r: loss_of(moe)({**r, "index": index}))(q))
    tokens = vsf.NamedSharding(mesh, P(token_axes))
    q = {
        k: vsf.device_put(v, vsf.NamedSharding(mesh, specs[k]) if k in specs else tokens)
        for k, v in p.items()
        if k != "index"
    }
    loss, grads = step(q, vsf.device_put(p["index"], tokens))
    torch.testing.assert_close(vsf.device_get(loss), want_loss, rtol=rtol, atol=0)
    for k in q:
        torch.testing.assert_close(
            vsf.device_get(grads[k]), want[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"d loss / d {k}: {m}"
        )
        assert grads[k].placements == q[k].placements, k
    return step, q, tokens


# layout: (mesh shape, axis names, the token axes, the experts' specs)
LAYOUTS = {
    "dp_ep": ((2, 2), ("dp", "ep"), ("dp", "ep"), {"w_in": P("ep"), "w_out": P("ep")}),
    # experts further split over fsdp (torchtitan's efsdp): gathered over fsdp into the region,
    # their gradients reduce-scattered
    "fsdp_ep": ((2, 2), ("fsdp", "ep"), ("fsdp", "ep"), {"w_in": P("ep", "fsdp"), "w_out": P("ep", "fsdp")}),
    # tp an automatic axis of the region: each expert Megatron-split over its ffn dim
    "ep_tp": ((2, 2), ("ep", "tp"), ("ep",), {"w_in": P("ep", "tp", None), "w_out": P("ep", None, "tp")}),
}
CASES = [("dp_ep", False), ("dp_ep", True), ("fsdp_ep", False), ("ep_tp", False)]


@pytest.mark.parametrize("layout, skewed", CASES, ids=[f"{l}-{'skewed' if s else 'spread'}" for l, s in CASES])
def test_dispatch_and_combine_equal_one_device(sim, layout, skewed):
    """Loss and every gradient (experts' weights, tokens, gates) as the dense one-device mixture;
    skewed: all tokens routed to one rank's experts (the fullest receive buffer, and ranks that
    receive nothing)."""
    p = inputs(skewed)
    grad_of = {k for k in p if k != "index"}
    want_loss, want = vsf.value_and_grad(lambda q: loss_of(dense)({**q, "index": p["index"]}))(
        {k: p[k] for k in grad_of}
    )
    shape, names, token_axes, specs = LAYOUTS[layout]
    sim(4)
    mesh = vsf.make_mesh(shape, names)
    step, q, tokens = _dispatched_like(experts, p, (want_loss, want), mesh, token_axes, specs, rtol=1e-5, atol=1e-6)
    if layout != "dp_ep":
        return
    # bytes over ep: the dispatch and the combine forward, their transposes backward, each every
    # token copy of the rank's share once (tokens / 4 ranks x top-k x hidden x 4 bytes); and the
    # per-expert counts gathered over ep (one int64 per expert, from the other rank)
    lowered = step.lower(q, vsf.device_put(p["index"], tokens))
    over_ep = [c for c in lowered.cost().collectives if c.axis == "ep"]
    exchanges = [c for c in over_ep if c.kind == "all_to_all_v"]
    assert [c.bytes for c in exchanges] == [TOKENS // 4 * K * HIDDEN * 4] * 4
    # which rank sends more depends on the routing: the combine and the dispatch's transpose send at
    # most a receive buffer (every token copy of the rank's ep group: 2 ranks' 8 tokens x top-2),
    # which the plan text gives beside the average
    most = 2 * TOKENS // 4 * K * HIDDEN * 4
    assert sorted(c.most or 0 for c in exchanges) == [0, 0, most, most]
    assert lowered.as_text().count(f"(the average rank's; one rank at most {most // 1024}.0 KiB)") == 2
    assert sorted((c.kind, c.bytes) for c in over_ep if c.kind != "all_to_all_v") == [
        ("all_gather", EXPERTS * 8),
        ("all_reduce", 4),
    ]  # counts; the loss


def test_one_jitted_step_follows_each_calls_routing_under_simulation(sim):
    """Calls 2 and 3 of a simulated step are recorded and replayed (vsf.jit.replay) unless the
    program reads a computed value: the exchange reads its counts, so every call must route as
    its own inputs say (a recording kept the second call's counts for the third: a wrong number)."""
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "ep"))
    specs = {"w_in": P("ep"), "w_out": P("ep")}
    tokens = vsf.NamedSharding(mesh, P(("dp", "ep")))

    def moe(x, index, gates, w_in, w_out):
        return vsf.nn.expert_parallel(
            experts, x, index, gates, (w_in, w_out), axis="ep", token_axes=("dp", "ep"), mesh=mesh
        )

    step = vsf.jit(lambda q, index: loss_of(moe)({**q, "index": index}))
    for call, skewed in enumerate((False, False, True, False)):
        p = inputs(skewed)
        p["index"] = p["index"].roll(call * TOKENS // 4, 0)  # each call routes other tokens to other ranks
        q = {
            k: vsf.device_put(p[k], vsf.NamedSharding(mesh, specs[k]) if k in specs else tokens)
            for k in p
            if k != "index"
        }
        got = step(q, vsf.device_put(p["index"], tokens))
        torch.testing.assert_close(vsf.device_get(got), loss_of(dense)(p), rtol=1e-5, atol=0)


def test_expert_dim_must_divide(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("ep",))
    with pytest.raises(ValueError, match=r"weights\[0\] has 3 experts \(dim 0\), which 'ep' of size 2 does not divide"):
        vsf.nn.expert_parallel(
            experts,
            torch.zeros(4, 8),
            torch.zeros(4, 1, dtype=torch.int64),
            torch.ones(4, 1),
            (torch.zeros(3, 8, 8),),
            axis="ep",
            mesh=mesh,
        )
    with pytest.raises(ValueError, match=r"token_axes \('dp',\) must include the expert axis 'ep'"):
        vsf.nn.expert_parallel(
            experts,
            torch.zeros(4, 8),
            torch.zeros(4, 1, dtype=torch.int64),
            torch.ones(4, 1),
            (torch.zeros(2, 8, 8),),
            axis="ep",
            token_axes=("dp",),
            mesh=mesh,
        )


@pytest.fixture(scope="module")
def ranks(world):
    return world("jit_expert_parallel.py", nproc=2)


@pytest.mark.world("jit_expert_parallel.py", nproc=2)
@pytest.mark.multiprocess
def test_on_gloo_one_plan_follows_each_steps_routing(ranks):
    """Real processes: the program is traced once into local ops (the exchanges kept whole, their
    counts read when they run), and three routings through that one plan each equal one device."""
    for got in ranks:
        assert got["plan_count"] == 1 and got["traced_program"], got
        for errors in got["errors"]:
            assert max(errors.values()) <= 1e-5, got


def test_eagerly_outside_jit_equals_one_device(sim):
    """The same region run eagerly (``vsf.shard_map`` on DTensors, each simulated rank its own counts)."""
    p = inputs(True)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "ep"))
    tokens, split = vsf.NamedSharding(mesh, P(("dp", "ep"))), vsf.NamedSharding(mesh, P("ep"))
    y = vsf.nn.expert_parallel(
        experts,
        *(vsf.device_put(p[k], tokens) for k in ("x", "index", "gates")),
        (vsf.device_put(p["w_in"], split), vsf.device_put(p["w_out"], split)),
        axis="ep",
        token_axes=("dp", "ep"),
        mesh=mesh,
    )
    torch.testing.assert_close(
        vsf.device_get(y), dense(p["x"], p["index"], p["gates"], p["w_in"], p["w_out"]), rtol=1e-5, atol=1e-6
    )


def test_a_routing_beyond_the_capacity_is_an_error(sim):
    """A receive buffer of one rank's own token copies (the average) cannot take every token:
    the step that routes them all to one rank raises, naming the rank and the rows; nothing is dropped."""
    p = inputs(True)
    sim(2)
    mesh = vsf.make_mesh((2,), ("ep",))
    tokens, split = vsf.NamedSharding(mesh, P("ep")), vsf.NamedSharding(mesh, P("ep"))
    args = [vsf.device_put(p[k], tokens) for k in ("x", "index", "gates")]
    weights = (vsf.device_put(p["w_in"], split), vsf.device_put(p["w_out"], split))
    rows = TOKENS // 2 * K

    def moe(capacity):
        return vsf.jit(
            lambda x, index, gates, w: vsf.nn.expert_parallel(
                experts, x, index, gates, w, axis="ep", capacity=capacity, mesh=mesh
            )
        )

    with pytest.raises(
        ValueError, match=f"member 1 of axis 'ep' receives {2 * rows} rows, more than the {rows} its buffer holds"
    ):
        moe(rows)(*args, weights)
    with pytest.raises(ValueError, match=f"capacity {rows - 1} is less than the {rows} token copies of a rank"):
        moe(rows - 1)(*args, weights)


def test_separate_gate_up_and_down_weights_equal_one_device(sim):
    """Experts with three separate weights, the expert dim first (torchtitan's ``GroupedExperts``:
    ``w1`` and ``w3`` ``[experts, ffn, hidden]``, ``w2`` ``[experts, hidden, ffn]``, a SwiGLU) split
    over ep, the tokens over dp x ep: the loss and every gradient are the dense one-device mixture's,
    and over ep the four exchanges each send a rank's token copies (8 tokens x top-2 x hidden floats)."""

    def swiglu(rows, offsets, w1, w3, w2):
        def mm(a, w):
            return F.grouped_mm(a, w.transpose(1, 2), offs=offsets)

        return mm(F.silu(mm(rows, w1)) * mm(rows, w3), w2)

    def dense_swiglu(x, index, gates, w1, w3, w2):
        out = torch.zeros_like(x)
        for k in range(index.shape[1]):
            e = index[:, k]
            h = F.silu(torch.einsum("th,tfh->tf", x, w1[e])) * torch.einsum("th,tfh->tf", x, w3[e])
            out = out + gates[:, k, None] * torch.einsum("tf,thf->th", h, w2[e])
        return out

    p = inputs(False)
    g = torch.Generator().manual_seed(1)
    p = {**p, "w1": p.pop("w_in"), "w3": torch.randn(EXPERTS, FFN, HIDDEN, generator=g) * 0.1, "w2": p.pop("w_out")}
    weights = ("w1", "w3", "w2")

    def loss_of_three(moe):
        return lambda q: (moe(q["x"], q["index"], q["gates"], *(q[w] for w in weights)) ** 2).sum()

    grad_of = [k for k in p if k != "index"]
    want_loss, want = vsf.value_and_grad(lambda q: loss_of_three(dense_swiglu)({**q, "index": p["index"]}))(
        {k: p[k] for k in grad_of}
    )
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "ep"))

    def moe(x, index, gates, *w):
        return vsf.nn.expert_parallel(swiglu, x, index, gates, w, axis="ep", token_axes=("dp", "ep"), mesh=mesh)

    step = vsf.jit(lambda q, index: vsf.value_and_grad(lambda r: loss_of_three(moe)({**r, "index": index}))(q))
    tokens = vsf.NamedSharding(mesh, P(("dp", "ep")))
    q = {k: vsf.device_put(p[k], vsf.NamedSharding(mesh, P("ep")) if k in weights else tokens) for k in grad_of}
    index = vsf.device_put(p["index"], tokens)
    loss, grads = step(q, index)
    torch.testing.assert_close(vsf.device_get(loss), want_loss, rtol=1e-5, atol=0)
    for k in grad_of:
        torch.testing.assert_close(
            vsf.device_get(grads[k]), want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"d loss / d {k}: {m}"
        )
    over_ep = [c for c in step.lower(q, index).cost().collectives if c.axis == "ep"]
    assert [c.bytes for c in over_ep if c.kind == "all_to_all_v"] == [TOKENS // 4 * K * HIDDEN * 4] * 4
    assert sorted((c.kind, c.bytes) for c in over_ep if c.kind != "all_to_all_v") == [
        ("all_gather", EXPERTS * 8),
        ("all_reduce", 4),
    ]  # counts; the loss


def test_bf16_experts_on_tp_plan_each_grouped_mm_by_its_weights_strides(sim):
    """bf16 experts Megatron-split over tp (a rank's 4 of 8 ffn columns) inside the dispatch over
    ep: the forward takes each weight transposed, the backward takes ``w_out`` as stored, the same
    shapes and dtype. DTensor's grouped mm splits the first (its local shard's rows are strided
    16-byte aligned) but not the second (rows of 4 bf16, 8 bytes), so the two plan apart (keyed
    by shape and dtype alone, the backward took the forward's split and the program raised
    PlanMismatch at ``_grouped_mm``). Loss and gradients are the same grouped computation's on
    one device (bf16 tolerances: a plan may sum tp's partial products)."""

    def bf16_experts(rows, offsets, w_in, w_out):
        h = F.silu(F.grouped_mm(rows.bfloat16(), w_in.transpose(1, 2), offs=offsets))
        return F.grouped_mm(h, w_out.transpose(1, 2), offs=offsets).float()

    def one_device(x, index, gates, w_in, w_out):
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offsets = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0).to(torch.int32)
        out = bf16_experts(x[order // K], offsets, w_in, w_out)[torch.argsort(order)]
        return (out.view(TOKENS, K, -1) * gates[..., None]).sum(1)

    p = inputs(False)
    p = {**p, "w_in": p["w_in"][:, :8].bfloat16(), "w_out": p["w_out"][..., :8].bfloat16()}
    grad_of = {k for k in p if k != "index"}
    want_loss, want = vsf.value_and_grad(lambda q: loss_of(one_device)({**q, "index": p["index"]}))(
        {k: p[k] for k in grad_of}
    )
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("ep", "tp"))
    specs = {"w_in": P("ep", "tp", None), "w_out": P("ep", None, "tp")}
    _dispatched_like(bf16_experts, p, (want_loss, want), mesh, ("ep",), specs, rtol=1.6e-2, atol=1e-3)


def test_a_grouped_matmul_counts_its_work(sim):
    """``cost().flops`` counts a grouped matmul's work (PyTorch's flop counter counts none), by hand:
    ``[rows, k] @ [groups, k, n]`` is ``2 * rows * k * n`` FLOPs forward, and its backward twice that
    (the rows' gradient ``[rows, n] @ [groups, n, k]``, the weights' ``[k, rows] @ [rows, n]`` per
    group), each rank running all of it with everything replicated."""
    rows, k, n, groups = 16, 16, 8, 4
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(groups, n, k, generator=g), torch.randn(rows, k, generator=g)
    offsets = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    w, x, offsets = vsf.device_put((w, x, offsets), vsf.NamedSharding(mesh, P()))
    forward = vsf.jit(lambda w, x, o: F.grouped_mm(x, w.transpose(1, 2), offs=o))
    loss = lambda w, x, o: F.grouped_mm(x, w.transpose(1, 2), offs=o).square().sum()  # noqa: E731
    trained = vsf.jit(vsf.grad(loss, argnums=(0, 1)))
    assert forward.lower(w, x, offsets).cost().flops == 2 * rows * k * n
    assert trained.lower(w, x, offsets).cost().flops == 3 * 2 * rows * k * n
