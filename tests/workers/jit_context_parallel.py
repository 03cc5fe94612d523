"""Tier 3 worker: the toy GPT (causal SDPA) with its two sequences each split over cp = 4 real gloo
processes, SGD steps under vsf.jit (the traced program over local shards), against the same steps
run unsharded in each process. argv: out_dir, then the tokens' layout: ``balanced`` (each process
runs only the causal blocks it sees) or ``contiguous``; keys and values gathered, then passed
around a ring."""

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
tokens = (torch.randint(0, 32, (2, 16)), torch.randint(0, 32, (2, 16)))


def step(p, idx, tgt):
    loss, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, tgt))(p)
    return vsf.tree.map(lambda w, g: w - 0.1 * g, p, grads), loss


want, want_losses = params, []
for _ in range(3):
    want, loss = step(want, *tokens)
    want_losses.append(loss.item())
mesh = vsf.make_mesh((world,), ("cp",))
contiguous = vsf.device_put(tokens, vsf.NamedSharding(mesh, P(None, "cp")))
balanced = vsf.device_put(tokens, vsf.NamedSharding(mesh, P(None, vsf.balanced("cp"))))
sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def run(arg: int, b: tuple) -> tuple[list[float], float, list[str]]:
    """Three jitted steps in ``vsf.config.context_parallel``'s mode on tokens ``b``: their losses,
    the largest param difference from the unsharded steps, and placement ``arg`` of each attention
    node."""
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    jitted = vsf.jit(step)
    losses = []
    for _ in range(3):
        p, loss = jitted(p, *b)
        losses.append(vsf.device_get(loss).item())
    got = vsf.device_get(p)
    plan = jitted.lower(p, *b).plan
    err = max((got[k] - want[k]).abs().max().item() for k in want)
    return losses, err, [str(pl.ins[arg]) for n, pl in plan.nodes.items() if n.target is sdpa]


layout = sys.argv[2]
tokens_as = {"contiguous": contiguous, "balanced": balanced}[layout]
losses, err, queries = run(0, tokens_as)
# the same steps with keys and values passed around a ring of ppermutes
vsf.config.context_parallel = "ring"
ring_losses, ring_err, ring_keys = run(1, tokens_as)
report = {
    "losses": losses,
    "want_losses": want_losses,
    "max_param_err": err,
    "query_placements": queries,
    "ring_losses": ring_losses,
    "ring_max_param_err": ring_err,
    "ring_key_placements": ring_keys,
}
(out / f"rank{rank}.json").write_text(json.dumps(report))
