"""vsf.pipeline under vsf.simulate: a GPT split into stages over pp (GPipe, 1F1B and interleaved, alone
and with dp / tp inside the stages) trains with the losses and params of the same steps on one device;
a step all-reduces the dp-replicated params' gradients once (DDP's bytes, whatever the number of
microbatches) and reduce-scatters fsdp-split ones once; the in-order runner plays torch's schedule order; bad splits are errors that name the
key path."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

import vsf
from vsf import P, _compat, optim
from vsf.pipeline import schedule as sched

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig, batch_at, pipeline_stages  # noqa: E402
from toy_models import counted_case, counted_pipelined  # noqa: E402

BATCH, STEPS = 8, 2
TX = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-3, weight_decay=0.1))
MEGATRON = [(r".*(qkv|fc1)\.weight", P("tp")), (r".*(proj|fc2)\.weight", P(None, "tp")), (r".*", P())]
TP_SPLIT = re.compile(r".*(qkv|fc1|proj|fc2)\.weight")  # the leaves MEGATRON splits over tp


def _model(layers: int) -> tuple[GPT, dict[str, torch.Tensor]]:
    model = GPT(GPTConfig(vocab=16, seq=8, dim=16, heads=2, layers=layers, period=4))
    return model, vsf.tree.from_module(model)


def _one_device(
    model: GPT, params: dict[str, torch.Tensor]
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    p, s, losses, first = params, TX.init(params), [], None
    for i in range(STEPS):
        idx, tgt = batch_at(i, BATCH, model.cfg)
        loss, g = vsf.value_and_grad(lambda q: vsf.tree.apply(model, q, idx, tgt))(p)
        first = g if first is None else first
        u, s = TX.update(g, s, p)
        p = optim.apply_updates(p, u)
        losses.append(loss.item())
    return losses, first, p


SWEEP = pytest.mark.sweep  # every schedule and every layout runs by default; these combinations in the sweep
CASES = [  # (pp, dp, tp, schedule, microbatches): each simulated step runs every op once per rank
    pytest.param(2, 1, 1, "gpipe", 8, marks=SWEEP),
    (2, 2, 1, "gpipe", 2),
    (2, 2, 1, "1f1b", 4),
    (2, 1, 2, "1f1b", 4),
    pytest.param(2, 2, 2, "1f1b", 4, marks=SWEEP),
    pytest.param(2, 2, 1, "interleaved", 4, marks=SWEEP),
    (4, 1, 1, "1f1b", 4),
    (2, 1, 1, "interleaved", 4),  # 2 stages on each pp rank: 4 stages of one block
    pytest.param(
        2, 1, 1, "zb", 4, marks=SWEEP
    ),  # the interleaved zero-bubble schedule: each backward's weight part deferred
    (2, 2, 1, "zb", 2),
    (2, 1, 1, "zbv", 4),  # V-shaped: stages 0 and 3 on pp rank 0, 1 and 2 on rank 1
    (2, 2, 1, "dualpipev", 4),  # DualPipe-V: full backwards and I/W pairs, overlapped F and B
]


@pytest.mark.parametrize(
    "pp,dp,tp,schedule,m",
    CASES,
    ids=[f"pp{v[0]}-dp{v[1]}-tp{v[2]}-{v[3]}-m{v[4]}" for v in (getattr(c, "values", c) for c in CASES)],
)
def test_pipelined_training_equals_one_device(sim, pp, dp, tp, schedule, m):
    stages = pp * (2 if schedule in sched.INTERLEAVED else 1)
    model, params = _model(layers=stages)
    want_losses, want_grads, want = _one_device(model, params)
    fns, loss_fn, prefixes = pipeline_stages(model, stages)
    sim(pp * dp * tp)
    mesh = vsf.make_mesh((pp, dp, tp), ("pp", "dp", "tp"))
    pipe = vsf.pipeline.Pipeline(
        fns, loss_fn, prefixes, mesh=mesh, microbatches=m, schedule=schedule, batch=P("dp"), tied=("wte.weight",)
    )
    p, layout = pipe.place(params, vsf.sharding.match(params, MEGATRON))
    s = TX.init(p)
    lowered = pipe.lower(
        p, *batch_at(0, BATCH, model.cfg), layout=layout
    )  # plans every stage; the steps reuse the plans

    def train_step(params, opt_state, idx, targets):
        loss, grads = pipe.value_and_grad(params, idx, targets, layout=layout)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss, grads

    losses = []
    for i in range(STEPS):
        p, s, loss, grads = train_step(p, s, *batch_at(i, BATCH, model.cfg))
        losses.append(vsf.device_get(loss).item())
        if i == 0:
            first = vsf.device_get(grads)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=0)
    for k in want:  # gradients of the first step (tied wte: both stages' parts summed), params after the last
        torch.testing.assert_close(first[k], want_grads[k], rtol=1e-5, atol=1e-7, msg=lambda e, k=k: f"grad {k}: {e}")
        # AdamW's step normalises each element's gradient: where a gradient is ~0 its rounding
        # decides the step, so params are compared to 3% of the learning rate (1e-3); a wrong
        # gradient moves its elements by the whole learning rate (zb-m2 and dualpipev-m4 each
        # had one element of blocks.1.attn.qkv.weight 1.1e-5 and 1.5e-5 away, first-step
        # gradients within 1e-7)
        torch.testing.assert_close(
            vsf.device_get(p[k]), want[k], rtol=1e-5, atol=3e-5, msg=lambda e, k=k: f"param {k}: {e}"
        )
    # each stage's params and Adam moments live on its pp coordinate's ranks only
    ranks = lambda k: tuple(
        range(pipe.rank_of(layout.split.owner[k]) * dp * tp, (pipe.rank_of(layout.split.owner[k]) + 1) * dp * tp)
    )  # noqa: E731
    for k, v in p.items():
        assert vsf.sharding.named.sharding_of(v).mesh.devices == ranks(k), k
    moments = [
        (k, name, leaf)
        for name, leaf in ((vsf.tree.keystr(path), leaf) for path, leaf in vsf.tree.leaves_with_path(s))
        for k in params
        if name.endswith(f"[{k!r}]")
    ]
    assert len(moments) == 2 * len(params)  # Adam's mu and nu
    for k, name, leaf in moments:
        assert vsf.sharding.named.sharding_of(leaf).mesh.devices == ranks(k), name
    # the runner played each rank's actions in torch's schedule order (stage s on pp rank
    # pipe.rank_of(s); test_stage_order_is_torchs compares that order with torch's)
    assert [[a for a in pipe.order if pipe.rank_of(a[0]) == rank] for rank in range(pp)] == sched.rank_actions(
        schedule, pp, stages, m
    )
    assert all(
        not pending for pending in pipe._deferred.values()
    )  # (zero bubble: every weight part ran, in its "W" or "B" action)
    _check_lowered(lowered, pipe, model.cfg, vsf.debug.memory_report(p), stages, dp, schedule, m)
    for c in lowered.cost().stages:
        assert c.comm_bytes["dp"] == _ddp_bytes(
            params, layout.split.names[c.stage], dp, tp, m, last=c.stage == stages - 1
        ), c.stage
        if tp == 1:  # one bucket (with tp, the tied head's gradient is unreduced over tp as well: its own)
            assert c.reduce.count("all_reduce", "dp") == (dp > 1), c.stage


def _ddp_bytes(params, names, dp, tp, m, last):
    """Hand-computed bytes one rank of a stage sends over dp a step: its params' gradients (the
    leaves ``names``, owned and lent, each rank's tp shard of them) all-reduced once, as DDP does
    (ring: ``2(n-1)/n`` of them), and on the last stage the loss's mean, whose sum and token count
    (two f32) are all-reduced once a microbatch."""
    ring = 2 * (dp - 1) / dp
    grads = sum(params[k].numel() * 4 // (tp if TP_SPLIT.match(k) else 1) for k in names)
    return ring * grads + (m * ring * 2 * 4 if last else 0)


def _check_lowered(lowered, pipe, cfg, held, pp, dp, schedule, m):
    """pipe.lower's sends and memory against hand-computed bytes (shape x dtype x microbatches).
    (``pp``: the number of stages, two per pp rank under the interleaved schedule)"""
    ranks = pp // 2 if schedule in sched.INTERLEAVED else pp
    assert all(prog.plan_count == 1 for prog in pipe._programs.values())  # the plans shown are the plans that ran
    assert all(prog.plan_count == 1 for prog in pipe._reducers.values())
    act = (BATCH // m // dp, cfg.seq, cfg.dim)  # a microbatch's rows over dp, replicated over tp
    per_mb, wte = BATCH // m // dp * cfg.seq * cfg.dim * 4, cfg.vocab * cfg.dim * 4
    # stage s on rank s % ranks, or in a V (stages s and 2 ranks - 1 - s on rank s): nothing is
    # sent between a rank's own stages (the V's turn, and its tied first and last stages)
    rank = (lambda s: min(s, 2 * ranks - 1 - s)) if schedule in ("zbv", "dualpipev") else (lambda s: s % ranks)  # noqa: E731
    apart = [s for s in range(pp - 1) if rank(s) != rank(s + 1)]
    tied = [("tied wte.weight", 0, pp - 1, (cfg.vocab, cfg.dim), wte, 1)] if rank(0) != rank(pp - 1) else []
    want = (
        tied
        + [("activation", s, s + 1, act, per_mb, m) for s in apart]
        + [("activation gradient", s + 1, s, act, per_mb, m) for s in reversed(apart)]
        + [("gradient of tied " + w[0][len("tied ") :], w[2], w[1], *w[3:]) for w in tied]
        + [("loss", pp - 1, r, (), 4, 1) for r in range(ranks) if r != rank(pp - 1)]  # broadcast to the other pp ranks
    )
    assert [(x.what, x.src, x.dst, x.shape, x.bytes, x.count) for x in lowered.sends] == want
    cost = lowered.cost()
    assert [c.stage for c in cost.stages] == list(range(pp)) and sorted(lowered.stages) == list(range(pp))
    for c in cost.stages:
        out = [w for w in want if w[1] == c.stage]
        assert c.comm_bytes["pp"] == sum(w[4] * w[5] for w in out), c.stage
        # memory_report counts the placed shards themselves: a rank holds its stages' params
        assert sum(d.param_bytes for d in cost.stages if d.ranks == c.ranks) == max(held[r] for r in c.ranks), c.stage
        assert c.borrowed_bytes == (wte if c.stage == pp - 1 else 0)
        if schedule not in sched.INTERLEAVED:
            assert c.in_flight == (m if schedule == "gpipe" else min(m, pp - c.stage))
        # replicated params, batch over dp: a microbatch's backward leaves their gradients unreduced
        # (torch sums them into .grad), the step's one reduction all-reduces them
        assert c.program.comm_bytes["dp"] == 0, c.stage
    text = lowered.as_text()
    assert f"pipeline of {pp} stages over pp" in text and f"{schedule}, {m} microbatches a step" in text
    shown = f"{per_mb} B" if per_mb < 1024 else f"{per_mb / 1024:.1f} KiB"
    assert re.search(rf"activation +stage 0 -> 1 +f32\[{','.join(map(str, act))}\] +{shown} x {m} = ", text)
    assert text.count("differentiated by torch autograd") == pp + 1  # each stage's programs, and the loss's


def test_dp_gradients_are_reduced_once_a_step_whatever_the_microbatches(sim):
    # DDP's bytes over dp a step, as many microbatches as there are: the first stage's are its
    # params' all-reduce alone, the same for m = 2 and m = 4
    model, params = _model(layers=2)
    fns, loss_fn, prefixes = pipeline_stages(model, 2)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("pp", "dp"))
    dp_bytes = {}
    for m in (2, 4):
        pipe = vsf.pipeline.Pipeline(
            fns, loss_fn, prefixes, mesh=mesh, microbatches=m, batch=P("dp"), tied=("wte.weight",)
        )
        p, layout = pipe.place(params)
        lowered = pipe.lower(p, *batch_at(0, BATCH, model.cfg), layout=layout)
        dp_bytes[m] = [c.comm_bytes["dp"] for c in lowered.cost().stages]
        assert dp_bytes[m] == [_ddp_bytes(params, layout.split.names[s], 2, 1, m, last=s == 1) for s in range(2)]
        assert re.search(r"gradients reduced once a step: dp 1\d\.\d KiB", lowered.as_text())
    assert (
        dp_bytes[2][0]
        == dp_bytes[4][0]
        == sum(v.numel() * 4 for k, v in params.items() if k.startswith(tuple(prefixes[0])))
    )


def test_fsdp_inside_stages_trains_like_one_device_and_reduce_scatters_once_a_step(sim):
    """pp=2 x fsdp=2, params split over fsdp where their first dim divides, the batch over fsdp: the
    losses, first gradients and params of one device. As FSDP2 does under torch's schedules, a
    stage gathers its split params once a step and keeps them gathered through the microbatches,
    its backward leaves its gradients whole and unreduced over fsdp (torch sums the microbatches'
    into ``.grad``), and the step's reduction reduce-scatters them once. Hand-computed bytes: the
    gather sends ``(n-1)/n`` of each split param, the reduction ``(n-1)/n`` of each split gradient
    and ``2(n-1)/n`` of each replicated one, a microbatch's programs nothing over fsdp but the
    loss's sums, for m = 2 and m = 4; with ``reshard_after_forward`` there is no gather and each
    microbatch's programs gather the params themselves."""
    model, params = _model(layers=2)
    want_losses, want_grads, want = _one_device(model, params)
    fns, loss_fn, prefixes = pipeline_stages(model, 2)
    specs = {k: P("fsdp") if v.shape[0] % 2 == 0 else P() for k, v in params.items()}
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("pp", "fsdp"))
    for m, reshard in ((2, False), (4, True), (4, False)):
        pipe = vsf.pipeline.Pipeline(
            fns,
            loss_fn,
            prefixes,
            mesh=mesh,
            microbatches=m,
            batch=P("fsdp"),
            tied=("wte.weight",),
            reshard_after_forward=reshard,
        )
        p, layout = pipe.place(params, specs)
        for c in pipe.lower(p, *batch_at(0, BATCH, model.cfg), layout=layout).cost().stages:
            names = layout.split.names[c.stage]
            gathered = sum(params[k].numel() * 4 // 2 for k in names if specs[k] == P("fsdp"))
            once = sum(params[k].numel() * 4 // 2 if specs[k] == P("fsdp") else params[k].numel() * 4 for k in names)
            assert c.reduce.comm_bytes["fsdp"] == once, (m, c.stage)
            loss = 2 * 4 if c.stage == 1 else 0  # the loss's sum and token count (two f32), all-reduced a microbatch
            if reshard:
                assert c.gather is None and c.gathered_bytes == 0 and c.program.comm_bytes["fsdp"] > 0
            else:
                assert c.gather.comm_bytes["fsdp"] == gathered and c.gathered_bytes == gathered, (m, c.stage)
                assert c.program.comm_bytes["fsdp"] == 0, (m, c.stage)
            assert (
                c.comm_bytes["fsdp"] == (0 if reshard else gathered) + m * (c.program.comm_bytes["fsdp"] + loss) + once
            ), (m, c.stage)
        if m == 4:
            _trains_like_one_device(pipe, p, layout, specs, model.cfg, want_losses, want_grads, want)


@pytest.mark.parametrize("schedule,stages", [("1f1b", 2), pytest.param("zbv", 4, marks=SWEEP)])
def test_state_written_in_forward_is_carried_through_the_microbatches_like_one_device(sim, schedule, stages):
    """Stages whose forward writes buffers (a row count and a sum of the rows seen, ``add_`` under
    ``no_grad``), pp=2 x dp=2, 2 microbatches: each stage's program returns the buffers it wrote,
    each microbatch's forward reads what the one before wrote, and after 3 AdamW steps the losses,
    params and buffers are torch's on one device (the whole batch at once: 3 x 8 rows counted, each
    layer's input rows summed; on dp each rank sums its rows and the plan adds the partial sums).
    The state lives on its stage's ranks, and each stage's program moves nothing over dp but its
    microbatch's row sum, all-reduced (8 f32; the gradients are reduced once a step)."""
    model, batches, (want_losses, want_params, want_buffers) = counted_case(stages)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("pp", "dp"))
    losses, params, state, lowered = counted_pipelined(model, batches, mesh, schedule)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=0)
    got_params, got_state = vsf.device_get(params), vsf.device_get(state)
    for k, v in want_params.items():
        torch.testing.assert_close(got_params[k], v, rtol=1e-5, atol=1e-6, msg=lambda e, k=k: f"param {k}: {e}")
    for k, v in want_buffers.items():
        torch.testing.assert_close(got_state[k], v, rtol=1e-5, atol=1e-6, msg=lambda e, k=k: f"buffer {k}: {e}")
    assert want_buffers["0.rows"].item() == 3 * 8
    assert vsf.sharding.named.sharding_of(state["1.total"]).mesh.devices == (2, 3)  # stage 1 on pp rank 1
    for s in range(stages):  # a microbatch's row sum, partial on each dp rank, all-reduced (8 f32), nothing else
        assert [(c.kind, c.axis, c.bytes) for c in lowered.stages[s].cost().collectives] == [("all_reduce", "dp", 32)]


def test_state_errors_name_the_stage_and_the_entry(sim):
    """A stage writing state another stage holds, a stage given state that returns no written
    state, and state without its layout are errors saying what was expected and where."""
    model, ((x, t), *_), _ = counted_case(2)
    sim(2)
    mesh = vsf.make_mesh((2,), ("pp",))
    buffers = vsf.tree.from_module(model, params=False, buffers=True)

    def steals(p, state, x):
        return x, {"1.rows": state["0.rows"]}

    def forgets(p, state, x):
        return x

    for stage, error, match in (
        (
            steals,
            ValueError,
            r"pipeline stage 0 wrote state \['1.rows'\], which is not its own \(its state: \['0.rows', '0.total'\]\)",
        ),
        (
            forgets,
            TypeError,
            r"pipeline stage 0 was given state, so its function must return \(output, written state\), a dict; got a tensor",
        ),
    ):
        pipe = vsf.pipeline.Pipeline(
            [stage, stage], torch.nn.functional.mse_loss, [["0."], ["1."]], mesh=mesh, microbatches=2
        )
        p, layout = pipe.place(vsf.tree.from_module(model))
        state = pipe.place(buffers, state=True)
        with pytest.raises(error, match=match):
            pipe.value_and_grad(p, x, t, layout=layout, state=state)
    with pytest.raises(
        TypeError,
        match=r"state must be the pair \(state, layout\) that pipe.place\(buffers, state=True\) returned \(or the step returned\); got dict",
    ):
        pipe.value_and_grad(p, x, t, layout=layout, state=state[0])


def test_a_zero_bubble_step_that_raises_leaves_the_next_step_one_devices(sim, monkeypatch):
    """A zb step stopped midway, by an error raised in a backward after the stage's program had
    handed over its weight part (here: torch.autograd.backward raising once its third call is
    done), leaves nothing behind for the next step: the steps after it give one device's losses,
    gradients and params."""
    model, params = _model(layers=4)
    want_losses, want_grads, want = _one_device(model, params)
    fns, loss_fn, prefixes = pipeline_stages(model, 4)
    sim(2)
    pipe = vsf.pipeline.Pipeline(
        fns, loss_fn, prefixes, mesh=vsf.make_mesh((2,), ("pp",)), microbatches=4, schedule="zb", tied=("wte.weight",)
    )
    p, layout = pipe.place(params)
    real, calls, pending_then = torch.autograd.backward, [], []

    def failing(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            pending_then.append(sum(map(len, pipe._deferred.values())))
            raise RuntimeError("the backward failed")

    with monkeypatch.context() as patch:
        patch.setattr(torch.autograd, "backward", failing)
        with pytest.raises(RuntimeError, match="the backward failed"):
            pipe.value_and_grad(p, *batch_at(0, BATCH, model.cfg), layout=layout)
    assert pending_then == [1]  # the weight part its "W" action never ran
    _trains_like_one_device(pipe, p, layout, {k: P() for k in params}, model.cfg, want_losses, want_grads, want)


def test_an_inductor_pipeline_runs_eagerly_under_simulation_after_one_warning_a_program(sim):
    """``backend="inductor"`` reaches every program of the step (real processes compile them:
    tests/jit/test_inductor.py); simulated ranks are LocalTensors, which Inductor does not
    compile, so each program runs as ``"eager"`` after one warning naming that reason: each
    stage's forward and backward, the loss's, and each stage's gradient reduction, 8 in all."""
    model, params = _model(layers=2)
    want_losses, want_grads, want = _one_device(model, params)
    fns, loss_fn, prefixes = pipeline_stages(model, 2)
    sim(2)
    pipe = vsf.pipeline.Pipeline(
        fns,
        loss_fn,
        prefixes,
        mesh=vsf.make_mesh((2,), ("pp",)),
        microbatches=2,
        tied=("wte.weight",),
        backend="inductor",
    )
    p, layout = pipe.place(params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trains_like_one_device(pipe, p, layout, {k: P() for k in params}, model.cfg, want_losses, want_grads, want)
    messages = [str(w.message) for w in caught if "vsf.jit" in str(w.message)]
    assert len(messages) == 8, messages
    assert all("runs as backend='eager' here: simulated ranks run as LocalTensors" in m for m in messages), messages


def _trains_like_one_device(pipe, p, layout, specs, cfg, want_losses, want_grads, want):
    """``pipe`` trained ``STEPS`` steps from ``p`` gives one device's losses, first gradients and
    params, and the params keep their ``specs``."""
    s, losses = TX.init(p), []
    for i in range(STEPS):
        loss, grads = pipe.value_and_grad(p, *batch_at(i, BATCH, cfg), layout=layout)
        if i == 0:
            first = vsf.device_get(grads)
        updates, s = TX.update(grads, s, p)
        p = optim.apply_updates(p, updates)
        losses.append(vsf.device_get(loss).item())
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=0)
    for k in want:
        assert vsf.sharding.named.sharding_of(p[k]).spec == specs[k], k
        torch.testing.assert_close(first[k], want_grads[k], rtol=1e-5, atol=1e-7, msg=lambda e, k=k: f"grad {k}: {e}")
        torch.testing.assert_close(
            vsf.device_get(p[k]), want[k], rtol=1e-5, atol=1e-5, msg=lambda e, k=k: f"param {k}: {e}"
        )


@pytest.mark.parametrize("schedule,cls", [("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 5)])
def test_stage_order_is_torchs(schedule, cls, p, m):
    ours = sched.stage_actions(schedule, p, m)
    theirs = _compat.pipeline_order(cls, p, m)
    for rank in range(p):
        want = [(k, mb) for _, k, mb in theirs[rank]]
        if sorted(want) != sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)]):
            # torch's IR of Schedule1F1B numbers the last rank's microbatches from 1 (a bug in
            # _get_pipeline_order, not in its runtime, which runs 1F1B: min(m, p - s) forwards first)
            assert schedule == "1f1b" and rank == p - 1
            continue
        assert ours[rank] == want, rank
    in_flight = []
    for acts in ours:
        live = peak = 0
        for k, _ in acts:
            live += 1 if k == "F" else -1
            peak = max(peak, live)
        in_flight.append(peak)
    assert in_flight == ([m] * p if schedule == "gpipe" else [min(m, p - s) for s in range(p)])


@pytest.mark.parametrize(
    "schedule,p,want",
    [
        ("1f1b", 4, [0, 1, 2, 3]),
        ("interleaved", 2, [0, 1, 0, 1]),
        ("zb", 3, [0, 1, 2, 0, 1, 2]),  # Megatron's loop: stage s on rank s % p
        ("zbv", 2, [0, 1, 1, 0]),
        ("dualpipev", 4, [0, 1, 2, 3, 3, 2, 1, 0]),  # a V: stages s and 2p - 1 - s on rank s
    ],
)
def test_each_stage_runs_on_its_schedules_rank(sim, schedule, p, want):
    stages = len(want)
    model, params = _model(layers=stages)
    fns, loss_fn, prefixes = pipeline_stages(model, stages)
    sim(p)
    pipe = vsf.pipeline.Pipeline(
        fns,
        loss_fn,
        prefixes,
        mesh=vsf.make_mesh((p,), ("pp",)),
        microbatches=max(4, stages),
        schedule=schedule,
        tied=("wte.weight",),
    )
    assert [pipe.rank_of(s) for s in range(stages)] == want
    assert [pipe.meshes[s].devices for s in range(stages)] == [(r,) for r in want]
    # torch's order runs each stage's forwards and backwards (or input and weight parts) on its rank
    for rank, acts in enumerate(pipe.actions()):
        assert {s for s, _, _ in acts} == {s for s, r in enumerate(want) if r == rank}, rank


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_bubble_is_the_theory(schedule, v, p, m):
    # forward and backward of equal cost: each rank idles (p - 1) / (v m + p - 1) of the step
    # (Megatron's interleaved schedule: v stages per rank divide the bubble by about v)
    assert sched.bubble(sched.rank_actions(schedule, p, v * p, m), 1.0, 1.0) == pytest.approx(
        [(p - 1) / (v * m + p - 1)] * p
    )


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("forward,backward", [(1.0, 2.0), (1.0, 1.0)])
def test_zero_bubble_leaves_the_papers_bubble(v, p, m, forward, backward):
    # ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): with each backward split into an
    # input part and a weight part W (here half of it), a rank idles (p - 1)(F + B - 2W) of a step
    # of v m (F + B) work; the interleaved 1F1B idles (p - 1)(F + B) of it
    w = backward / 2
    idle = (p - 1) * (forward + backward - 2 * w)
    want = idle / (v * m * (forward + backward) + idle)
    assert sched.bubble(sched.rank_actions("zb", p, v * p, m), forward, backward) == pytest.approx([want] * p)


def test_bad_splits_are_errors_naming_the_key_path(sim):
    model, params = _model(layers=2)
    fns, loss_fn, prefixes = pipeline_stages(model, 2)
    fns4, loss4, prefixes4 = pipeline_stages(_model(layers=4)[0], 4)
    sim(2)
    mesh = vsf.make_mesh((2,), ("pp",))

    def pipe(prefixes=prefixes, tied=("wte.weight",), **kw):
        args = {"mesh": mesh, "microbatches": 4, "tied": tied, **kw}
        return vsf.pipeline.Pipeline(fns[: len(prefixes)], loss_fn, prefixes, **args)

    with pytest.raises(ValueError, match=r"'wte\.weight' is in stages \[0, 1\].*tied"):
        pipe(tied=()).place(params)
    with pytest.raises(ValueError, match=r"'lnf\.weight' is in no pipeline stage"):
        pipe([prefixes[0], [p for p in prefixes[1] if p != "lnf."]]).place(params)
    with pytest.raises(ValueError, match=r"prefix 'blocks\.7\.' matches no param"):
        pipe([prefixes[0], [*prefixes[1], "blocks.7."]]).place(params)
    with pytest.raises(ValueError, match=r"pp axis has size 2 but the pipeline has 1 stages"):
        pipe([prefixes[0] + prefixes[1]], tied=())
    with pytest.raises(ValueError, match=r"'blocks\.0\.fc1\.weight' has the spec P\('pp'\)"):
        pipe().place(params, {k: P("pp") if k == "blocks.0.fc1.weight" else P() for k in params})
    with pytest.raises(ValueError, match=r"backend must be one of \('eager', 'inductor'\) \(vsf.jit's\), got 'xla'"):
        pipe(backend="xla")
    with pytest.raises(
        ValueError,
        match=r"unknown pipeline schedule 'zb-h2'; expected one of \['1f1b', 'dualpipev', 'gpipe', 'interleaved', 'zb', 'zbv'\]",
    ):
        pipe(schedule="zb-h2")
    with pytest.raises(
        ValueError,
        match=r"the zbv schedule runs two stages on each of the 2 pp ranks \(stages s and 3 - s on rank s\): give 4 stages; got 2",
    ):
        pipe(schedule="zbv")
    with pytest.raises(
        ValueError, match=r"ScheduleDualPipeV needs at least as many microbatches as stages \(4\); got 2"
    ):
        vsf.pipeline.Pipeline(
            fns4, loss4, prefixes4, mesh=mesh, microbatches=2, schedule="dualpipev", tied=("wte.weight",)
        )
    with pytest.raises(ValueError, match=r"the zb schedule runs 2 or more stages on each of the 2 pp ranks"):
        pipe(schedule="zb")
    with pytest.raises(
        ValueError,
        match=r"interleaved schedule runs 2 or more stages on each of the 2 pp ranks: give a multiple of 2 stages, at least 4; got 2",
    ):
        pipe(schedule="interleaved")
    good = pipe()
    p, layout = good.place(params)
    idx, tgt = batch_at(0, 6, model.cfg)
    with pytest.raises(ValueError, match=r"inputs\[0\] has 6 rows .*4 microbatches must divide"):
        good.value_and_grad(p, idx, tgt, layout=layout)
    with pytest.raises(
        TypeError,
        match=r"layout must be the Layout this pipeline's place\(params, specs\) returned with the params; got NoneType",
    ):
        good.value_and_grad(p, idx, tgt, layout=None)
