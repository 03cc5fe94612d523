"""Tier 3 worker: a GPT trained 3 steps through vsf.pipeline on real gloo processes (torch's
ScheduleGPipe and Schedule1F1B over the pp groups, 4 microbatches), against the same steps run on
one device in each process. argv: out_dir, dp size (world = 2 * dp), and optionally ``inductor``:
then only 1F1B runs, every program of the step compiled by Inductor (``Pipeline(backend=...)``),
and each rank also reports which of its programs Inductor compiled and vsf.jit's warnings. Eager,
GPipe and 1F1B over pp=2 run on 4 processes (pp=2 x dp=2); on 2 processes the launch runs torch's
ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ZBV and DualPipeV (a 4-block GPT, two
one-block stages per rank),
and two layers whose forward writes buffers (tests/toy_models.py's Counted), one a stage, with 1F1B,
on 4 processes pp=4 (a 4-block GPT, one block per stage, dp=1), GPipe and 1F1B, pp=2 x cp=2 with
1F1B (each sequence split over cp inside the stages and in the activations sent between them), and
pp=2 x fsdp=2 with 1F1B (params split over fsdp where their first dim divides, the batch over fsdp).
Each run's pipe.lower (the plan the steps reuse) reports its sends and this stage's figures."""

import json
import os
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "tests")]  # this checkout's vsf, the example model
import vsf  # noqa: E402
from gpt import GPT, GPTConfig, batch_at, pipeline_stages  # noqa: E402
from toy_models import counted_case, counted_pipelined  # noqa: E402
from vsf import P, optim  # noqa: E402

out, dp = Path(sys.argv[1]), int(sys.argv[2])
backend = sys.argv[3] if len(sys.argv) > 3 else "eager"
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
tx = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-3, weight_decay=0.1))
STEPS, BATCH = 3, 8


def one_device(model, params):
    p, s, losses = params, tx.init(params), []
    for i in range(STEPS):
        idx, tgt = batch_at(i, BATCH, model.cfg)
        loss, g = vsf.value_and_grad(lambda q: vsf.tree.apply(model, q, idx, tgt))(p)
        u, s = tx.update(g, s, p)
        p = optim.apply_updates(p, u)
        losses.append(loss.item())
    return p, losses


def runners(jitted):
    """The runners of every program of a jitted function's plans (a differentiable one's forward and backward)."""
    return [r for c in jitted._cache.values() for r in getattr(c, "_runners", None) or (c._runner,)]


def pipelined(pp, dp, schedule, stages=None, axis="dp"):
    """The report of 3 pipelined steps of a GPT of ``stages`` (default ``pp``) blocks on a pp x
    ``axis`` mesh (``dp`` ranks over it): the batch over dp or fsdp, or each sequence over cp."""
    stages = stages or pp
    spec = P(None, "cp") if axis == "cp" else P(axis)
    model = GPT(GPTConfig(vocab=16, seq=8, dim=16, heads=2, layers=stages, period=4))
    params = vsf.tree.from_module(model)
    want, want_losses = one_device(model, params)
    mesh = vsf.make_mesh((pp, dp), ("pp", axis))
    fns, loss_fn, prefixes = pipeline_stages(model, stages)
    pipe = vsf.pipeline.Pipeline(
        fns,
        loss_fn,
        prefixes,
        mesh=mesh,
        microbatches=4,
        schedule=schedule,
        batch=spec,
        activations=spec,
        tied=("wte.weight",),
        backend=backend,
    )
    specs = {k: P("fsdp") if axis == "fsdp" and v.shape[0] % dp == 0 else P() for k, v in params.items()}
    p, layout = pipe.place(params, specs)
    s = tx.init(p)
    lowered = pipe.lower(p, *batch_at(0, BATCH, model.cfg), layout=layout)

    def train_step(params, opt_state, idx, targets):
        loss, grads = pipe.value_and_grad(params, idx, targets, layout=layout)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(STEPS):
            p, s, loss = train_step(p, s, *batch_at(i, BATCH, model.cfg))
            losses.append(vsf.device_get(loss).item())
    got = {k: vsf.device_get(v) for k, v in p.items() if v is not None}
    return {
        "want_losses": want_losses,
        "losses": losses,
        "held": sorted(got),
        "max_param_err": max((got[k] - want[k]).abs().max().item() for k in got),
        "ranks_of_lnf": list(vsf.sharding.named.sharding_of(p["lnf.weight"]).mesh.devices)
        if p["lnf.weight"] is not None
        else None,
        "mu_held": sorted(k for k, v in s[1].mu.items() if v is not None),
        "plans": [prog.plan_count for prog in pipe._programs.values()],
        "sends": [[x.what, x.src, x.dst, list(x.shape), x.bytes, x.count] for x in lowered.sends],
        "stages": [c.stage for c in lowered.cost().stages],
        "pp_bytes": sum(c.comm_bytes["pp"] for c in lowered.cost().stages),
        "dp_bytes": [c.comm_bytes.get("dp", 0) for c in lowered.cost().stages],
        "cp_bytes": [c.comm_bytes.get("cp", 0) for c in lowered.cost().stages],
        "fsdp_reduce_bytes": [c.reduce.comm_bytes.get("fsdp", 0) for c in lowered.cost().stages],
        "fsdp_gather_bytes": [c.gather.comm_bytes.get("fsdp", 0) if c.gather else 0 for c in lowered.cost().stages],
        "fsdp_program_bytes": [c.program.comm_bytes.get("fsdp", 0) for c in lowered.cost().stages],
        "gather_plans": [g.plan_count for g in pipe._gathers.values()],
        "split_param_bytes": [
            sum(params[k].numel() * 4 for k in layout.split.names[c.stage] if specs[k] != P())
            for c in lowered.cost().stages
        ],
        "whole_param_bytes": [
            sum(params[k].numel() * 4 for k in layout.split.names[c.stage] if specs[k] == P())
            for c in lowered.cost().stages
        ],
        "reducer_plans": [r.plan_count for r in pipe._reducers.values()],
        "param_bytes": sum(c.param_bytes for c in lowered.cost().stages),
        "memory": vsf.debug.memory_report(p).get(rank, 0),
        "compiled_by_inductor": [
            r.compiled_by_inductor
            for j in (*pipe._programs.values(), *pipe._reducers.values())
            for r in runners(j)
            if r.local is not None
        ],
        "warnings": [str(w.message) for w in caught if "vsf.jit" in str(w.message)],
    }


def with_state():
    """The report of 3 steps of two Counted layers, one a stage on the 2 processes (1F1B), each
    stage carrying the buffers its forward writes: against torch on one device, this rank's errors
    in the losses, params and buffers, and the state it holds."""
    model, batches, (want_losses, want_params, want_buffers) = counted_case(2)
    losses, params, state, _ = counted_pipelined(model, batches, vsf.make_mesh((2, 1), ("pp", "dp")), "1f1b")
    got = {k: vsf.device_get(v) for k, v in {**params, **state}.items() if v is not None}
    want = {**want_params, **want_buffers}
    return {
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)),
        "max_err": max((got[k].double() - want[k].double()).abs().max().item() for k in got),
        "held": sorted(got),
    }


# pp=2 with one stage a rank: under Inductor (1F1B) on 2 processes; eager on 4 (with dp, whose sends
# and stage figures are a superset of the 2-process runs')
one_stage_a_rank = ("1f1b",) if backend == "inductor" else ("gpipe", "1f1b") if world == 4 else ()
report = {schedule: pipelined(2, dp, schedule) for schedule in one_stage_a_rank}
if world == 2 and backend == "eager":  # two stages on each rank
    report.update(
        {schedule: pipelined(2, 1, schedule, stages=4) for schedule in ("interleaved", "zb", "zbv", "dualpipev")}
    )
    report["pp2-state"] = with_state()
if world == 4:
    report.update({f"pp4-{schedule}": pipelined(4, 1, schedule) for schedule in ("gpipe", "1f1b")})
    report["pp2-cp2"] = pipelined(2, 2, "1f1b", axis="cp")
    report["pp2-fsdp2"] = pipelined(2, 2, "1f1b", axis="fsdp")
(out / f"rank{rank}.json").write_text(json.dumps(report))
