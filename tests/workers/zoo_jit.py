"""Tier 3 worker: a Hugging Face model of the zoo (argv: out_dir, family name) trained 3 steps
through ``vsf.jit`` (``value_and_grad`` + the zoo's AdamW) on real gloo processes, a dp x tp mesh of
all of them (the family's Megatron rules over tp, the batch over dp), against the whole model trained
by ``torch.optim.AdamW`` on one device in each process: the traced local program (what a real run
executes; vsf.simulate interprets the plan instead) with the model's buffers and constants in it.
Each process reports its losses, the oracle's, and the params not within the zoo's tolerance."""

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "models")]   # this checkout's vsf, and the zoo
import vsf  # noqa: E402
import zoo  # noqa: E402
from vsf import P, optim  # noqa: E402

out, name = Path(sys.argv[1]), sys.argv[2]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
family = zoo.families()[name]
want_losses, want_params = zoo.torch_run(family)
model, batches = zoo.built(family)
params = vsf.tree.from_module(model)
tx = zoo.adamw()
mesh = vsf.make_mesh((2, world // 2), ("dp", "tp"))
p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, list(family.tp_rules))))
s = optim.init_sharded(tx, p)
step = vsf.jit(zoo.train_step(model, tx))
losses = []
for batch in batches:
    p, s, loss = step(p, s, vsf.device_put(batch, vsf.NamedSharding(mesh, P("dp"))))
    losses.append(vsf.device_get(loss).item())
got = vsf.device_get(p)
report = {
    "losses": losses,
    "want_losses": [x.item() for x in want_losses],
    "plan_count": step.plan_count,
    "max_param_err": max((got[k] - want_params[k]).abs().max().item() for k in want_params),
    "not_close": zoo.not_close(got, want_params),
}
(out / f"rank{rank}.json").write_text(json.dumps(report))
