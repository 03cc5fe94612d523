"""Tier 3 worker: a GPT train step under vsf.jit on real gloo processes (the traced program over
local shards), against the same steps run unsharded in each process."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vsf  # noqa: E402
from toy_models import adamw_gpt_case  # noqa: E402
from vsf import P, optim  # noqa: E402

out = Path(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(0)
params, batch, tx, train_step = adamw_gpt_case()
want, state, want_losses = params, tx.init(params), []
for _ in range(3):
    want, state, loss = train_step(want, state, *batch)
    want_losses.append(loss.item())
mesh = vsf.make_mesh((2, world // 2), ("dp", "tp"))
rules = [(r".*(qkv|fc1)\.weight", P("tp")), (r".*fc1\.bias", P("tp")), (r".*(proj|fc2)\.weight", P(None, "tp")), (r".*", P())]
p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
s = optim.init_sharded(tx, p, zero_axes=("dp",))
b = vsf.device_put(batch, vsf.NamedSharding(mesh, P("dp")))
step = vsf.jit(train_step, donate_argnums=(0, 1))
losses, reused, params_reused = [], [], []
for _ in range(3):
    before = [x.to_local().data_ptr() for x in vsf.tree.leaves(s)]
    before_params = [x.to_local().data_ptr() for x in vsf.tree.leaves(p)]
    p, s, loss = step(p, s, *b)
    reused.append(sum(x.to_local().data_ptr() in before for x in vsf.tree.leaves(s)))
    params_reused.append(sum(x.to_local().data_ptr() in before_params for x in vsf.tree.leaves(p)))
    losses.append(vsf.device_get(loss).item())
got = vsf.device_get(p)
program = next(iter(step._cache.values()))._local
report = {
    "losses": losses,
    "want_losses": want_losses,
    "max_param_err": max((got[k] - want[k]).abs().max().item() for k in want),
    "traced_ops": sum(1 for n in program.graph.nodes if n.op == "call_function"),
    "collectives_in_program": sum(1 for n in program.graph.nodes if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)),
    "planned_collectives": len(step.lower(p, s, *b).cost().collectives),
    "plan_count": step.plan_count,
    "state_leaves": len(vsf.tree.leaves(s)),
    "state_buffers_reused": reused,
    "param_leaves": len(vsf.tree.leaves(p)),
    "param_buffers_reused": params_reused,
}
(out / f"rank{rank}.json").write_text(json.dumps(report))
