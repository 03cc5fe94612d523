"""Tier 3 worker on 2 real gloo processes, against plain torch autograd unsharded in each process:
a GPT block under vsf.jit differentiated by torch autograd (Megatron tp=2, a plain activation, two
calls accumulating; the traced forward and backward programs over local shards), then two jitted
stages run forward and backward by torch.distributed.pipelining's 1F1B schedule (pp=2).

Usage: jit_autograd.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vsf  # noqa: E402
from toy_models import Block, GPTConfig  # noqa: E402
from vsf import P  # noqa: E402

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
torch.manual_seed(0)
block = Block(GPTConfig(dim=16, heads=2, seq=8))
params = vsf.tree.from_module(block)
x = torch.randn(4, 8, 16)
fn = lambda p, x: vsf.tree.apply(block, p, x)  # noqa: E731

ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
ref_x = x.clone().requires_grad_(True)
for _ in range(2):  # two steps, gradients accumulated
    (fn(ref, ref_x) ** 2).sum().backward()

megatron = {
    "attn.qkv.weight": P("tp"),
    "attn.qkv.bias": P("tp"),
    "attn.proj.weight": P(None, "tp"),
    "fc1.weight": P("tp"),
    "fc1.bias": P("tp"),
    "fc2.weight": P(None, "tp"),
}
mesh = vsf.make_mesh((2,), ("tp",))
p = vsf.tree.map(
    lambda t: t.requires_grad_(True),
    vsf.device_put(params, vsf.NamedSharding.tree(mesh, {k: megatron.get(k, P()) for k in params})),
)
xs = x.clone().requires_grad_(True)  # a plain activation
g = vsf.jit(fn)
for _ in range(2):
    (g(p, xs) ** 2).sum().backward()
report = {
    "max_grad_err": max((vsf.device_get(p[k].grad) - ref[k].grad).abs().max().item() for k in params),
    "max_scale": max(ref[k].grad.abs().max().item() for k in params),
    "x_grad_err": (xs.grad - ref_x.grad).abs().max().item(),
    "x_grad_plain": not isinstance(xs.grad, torch.distributed.tensor.DTensor),
    "grad_placements_match": all(p[k].grad.placements == p[k].placements for k in params),
    "plan_count": g.plan_count,
    "traced_programs": [r.local is not None for r in g._cache[next(iter(g._cache))]._runners],
}

# torch's own pipeline engine on the same 2 processes (pp=2): each stage a jitted MLP on its
# 1-rank sub-mesh, run forward and backward per microbatch by Schedule1F1B (4 microbatches):
# PipelineStage calls torch.autograd.backward on the stage outputs and reads the inputs' .grad
torch.manual_seed(1)
stages = [{"w1": torch.randn(8, 16) / 3, "w2": torch.randn(16, 8) / 3} for _ in range(2)]
x, y = torch.randn(8, 8), torch.randn(8, 8)
mlp = lambda p, h: F.gelu(h @ p["w1"]) @ p["w2"]  # noqa: E731
ref = [{k: v.clone().requires_grad_(True) for k, v in w.items()} for w in stages]
for xm, ym in zip(x.chunk(4), y.chunk(4)):
    ((mlp(ref[1], mlp(ref[0], xm)) - ym) ** 2).mean().backward()  # the schedule backpropagates each microbatch's loss
stage_mesh = vsf.make_mesh((2, 1), ("pp", "tp"))["tp"]
mine = vsf.tree.map(lambda t: t.requires_grad_(True), vsf.device_put(stages[rank], vsf.NamedSharding(stage_mesh, P())))
jitted = vsf.jit(mlp)


class Stage(torch.nn.Module):
    def forward(self, h):
        return jitted(mine, h).to_local()  # the engine sends plain tensors between stages


schedule = Schedule1F1B(
    PipelineStage(Stage(), rank, 2, torch.device("cpu")), 4, loss_fn=lambda out, tgt: ((out - tgt) ** 2).mean()
)
schedule.step(x) if rank == 0 else schedule.step(target=y)
report["pipeline_max_grad_err"] = max(
    (vsf.device_get(mine[k].grad) - ref[rank][k].grad).abs().max().item() for k in mine
)
report["pipeline_max_scale"] = max(ref[rank][k].grad.abs().max().item() for k in mine)
report["pipeline_plan_count"] = jitted.plan_count
(out / f"rank{rank}.json").write_text(json.dumps(report))
