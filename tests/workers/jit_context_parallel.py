"""Tier 3 worker: the toy GPT (causal SDPA) with its one sequence split over cp = 4 real gloo
processes, SGD steps under vsf.jit (the traced program over local shards), against the same steps
run unsharded in each process."""

import json
import os
import sys
from pathlib import Path

import torch

# the checkout's own vsf (an installed one may be another checkout's) and the tests' models
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
import vsf  # noqa: E402
from toy_models import GPT, GPTConfig  # noqa: E402
from vsf import P  # noqa: E402

out = Path(sys.argv[1])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(0)
model = GPT(GPTConfig(vocab=32, seq=16, dim=16, heads=2, layers=2, tied=False, sdpa=True))
params = vsf.tree.from_module(model)
tokens = (torch.randint(0, 32, (1, 16)), torch.randint(0, 32, (1, 16)))


def step(p, idx, tgt):
    loss, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, tgt))(p)
    return vsf.tree.map(lambda w, g: w - 0.1 * g, p, grads), loss


want, want_losses = params, []
for _ in range(3):
    want, loss = step(want, *tokens)
    want_losses.append(loss.item())
mesh = vsf.make_mesh((world,), ("cp",))
p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
b = vsf.device_put(tokens, vsf.NamedSharding(mesh, P(None, "cp")))
jitted = vsf.jit(step)
losses = []
for _ in range(3):
    p, loss = jitted(p, *b)
    losses.append(vsf.device_get(loss).item())
got = vsf.device_get(p)
plan = jitted.lower(p, *b).plan
sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
report = {
    "losses": losses,
    "want_losses": want_losses,
    "max_param_err": max((got[k] - want[k]).abs().max().item() for k in want),
    "query_placements": [str(pl.ins[0]) for n, pl in plan.nodes.items() if n.target is sdpa],
}
(out / f"rank{rank}.json").write_text(json.dumps(report))

# the same steps with keys and values passed around a ring of ppermutes
vsf.config.context_parallel = "ring"
p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
ring = vsf.jit(step)
ring_losses = []
for _ in range(3):
    p, loss = ring(p, *b)
    ring_losses.append(vsf.device_get(loss).item())
got = vsf.device_get(p)
ring_plan = ring.lower(p, *b).plan
report.update({
    "ring_losses": ring_losses,
    "ring_max_param_err": max((got[k] - want[k]).abs().max().item() for k in want),
    "ring_key_placements": [str(pl.ins[1]) for n, pl in ring_plan.nodes.items() if n.target is sdpa],
})
(out / f"rank{rank}.json").write_text(json.dumps(report))
