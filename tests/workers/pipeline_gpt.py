"""Tier 3 worker: a GPT trained 3 steps through vsf.pipeline on real gloo processes (torch's
ScheduleGPipe and Schedule1F1B over the pp groups, 4 microbatches), against the same steps run on
one device in each process. argv: out_dir, dp size (world = 2 * dp)."""

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]   # this checkout's vsf, and the example model
import vsf  # noqa: E402
from gpt import GPT, GPTConfig, batch_at, pipeline_stages  # noqa: E402
from vsf import P, optim  # noqa: E402

out, dp = Path(sys.argv[1]), int(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
cfg = GPTConfig(vocab=16, seq=8, dim=16, heads=2, layers=2, period=4)
model = GPT(cfg)
params = vsf.tree.from_module(model)
tx = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-3, weight_decay=0.1))
STEPS, BATCH = 3, 8


def one_device():
    p, s, losses = params, tx.init(params), []
    for i in range(STEPS):
        idx, tgt = batch_at(i, BATCH, cfg)
        loss, g = vsf.value_and_grad(lambda q: vsf.tree.apply(model, q, idx, tgt))(p)
        u, s = tx.update(g, s, p)
        p = optim.apply_updates(p, u)
        losses.append(loss.item())
    return p, losses


want, want_losses = one_device()
mesh = vsf.make_mesh((2, dp), ("pp", "dp"))
fns, loss_fn, prefixes = pipeline_stages(model, 2)
report = {"want_losses": want_losses}
for schedule in ("gpipe", "1f1b"):
    pipe = vsf.pipeline.Pipeline(fns, loss_fn, prefixes, mesh=mesh, microbatches=4, schedule=schedule, batch=P("dp"), tied=("wte.weight",))
    p = pipe.place(params)
    s = tx.init(p)

    def train_step(params, opt_state, idx, targets):
        loss, grads = pipe.value_and_grad(params, idx, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(STEPS):
        p, s, loss = train_step(p, s, *batch_at(i, BATCH, cfg))
        losses.append(vsf.device_get(loss).item())
    got = {k: vsf.device_get(v) for k, v in p.items() if v is not None}
    report[schedule] = {
        "losses": losses,
        "held": sorted(got),
        "max_param_err": max((got[k] - want[k]).abs().max().item() for k in got),
        "max_param_rel": max(((got[k] - want[k]).abs() / want[k].abs().clamp(min=1e-3)).max().item() for k in got),
        "ranks_of_lnf": list(vsf.sharding.named.sharding_of(p["lnf.weight"]).mesh.devices) if p["lnf.weight"] is not None else None,
        "mu_held": sorted(k for k, v in s[1].mu.items() if v is not None),
    }
(out / f"rank{rank}.json").write_text(json.dumps(report))
