"""Tier 3 worker: a GPT block under vsf.jit differentiated by torch autograd on 2 real gloo
processes (Megatron tp=2, a plain activation; the traced forward and backward programs over local
shards, two calls accumulating), against the same block
run by plain torch autograd unsharded in each process.

Usage: jit_autograd.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch

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

megatron = {"attn.qkv.weight": P("tp"), "attn.qkv.bias": P("tp"), "attn.proj.weight": P(None, "tp"), "fc1.weight": P("tp"), "fc1.bias": P("tp"), "fc2.weight": P(None, "tp")}
mesh = vsf.make_mesh((2,), ("tp",))
p = vsf.tree.map(lambda t: t.requires_grad_(True), vsf.device_put(params, vsf.NamedSharding.tree(mesh, {k: megatron.get(k, P()) for k in params})))
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
(out / f"rank{rank}.json").write_text(json.dumps(report))
