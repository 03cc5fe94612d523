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
rules = [
    (r".*(qkv|fc1)\.weight", P("tp")),
    (r".*fc1\.bias", P("tp")),
    (r".*(proj|fc2)\.weight", P(None, "tp")),
    (r".*", P()),
]
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
program = next(iter(step._cache.values()))._runner.local
report = {
    "losses": losses,
    "want_losses": want_losses,
    "max_param_err": max((got[k] - want[k]).abs().max().item() for k in want),
    "traced_ops": sum(1 for n in program.graph.nodes if n.op == "call_function"),
    "collectives_in_program": sum(
        1 for n in program.graph.nodes if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)
    ),
    "planned_collectives": len(step.lower(p, s, *b).cost().collectives),
    "plan_count": step.plan_count,
    "state_leaves": len(vsf.tree.leaves(s)),
    "state_buffers_reused": reused,
    "param_leaves": len(vsf.tree.leaves(p)),
    "param_buffers_reused": params_reused,
}
(out / f"rank{rank}.json").write_text(json.dumps(report))

# a manual region (vsf.shard_map inside vsf.jit): the Megatron MLP by hand in a jitted SGD step,
# and a ring of ppermutes, against the same math unsharded in this process
torch.manual_seed(1)
x, w1, w2, t = torch.randn(8, 4), torch.randn(4, 8) / 2, torch.randn(8, 4) / 2, torch.randn(8, 4)
sgd = optim.sgd(0.1)


def sgd_step(model):
    def train_step(params, opt_state, x, t):
        loss, grads = vsf.value_and_grad(lambda p: (model(x, *p) - t).pow(2).mean())(params)
        updates, opt_state = sgd.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return train_step


def ring(x):
    n = vsf.ops.axis_size("tp")
    acc = cur = x
    for _ in range(n - 1):
        cur = vsf.ops.ppermute(cur, "tp", [(j, (j + 1) % n) for j in range(n)])
        acc = acc + cur
    return acc


want_w, want_state = (w1, w2), sgd.init((w1, w2))
for _ in range(2):
    want_w, want_state, _ = sgd_step(lambda x, a, b: torch.relu(x @ a) @ b)(want_w, want_state, x, t)
region = vsf.shard_map(
    lambda x, a, b: vsf.ops.psum(torch.relu(x @ a) @ b, "tp"),
    mesh=mesh,
    in_specs=(P("dp"), P(None, "tp"), P("tp")),
    out_specs=P("dp"),
)
mlp_step = vsf.jit(sgd_step(region))
w = vsf.device_put((w1, w2), (vsf.NamedSharding(mesh, P(None, "tp")), vsf.NamedSharding(mesh, P("tp"))))
ws, xt = optim.init_sharded(sgd, w), vsf.device_put((x, t), vsf.NamedSharding(mesh, P("dp")))
for _ in range(2):
    w, ws, _ = mlp_step(w, ws, *xt)
ring_region = vsf.shard_map(ring, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")))
ring_grad = vsf.jit(lambda x, c: vsf.value_and_grad(lambda x: (ring_region(x) * c).sum())(x))
c = torch.randn(8, 4)
xr = x.clone().requires_grad_()
want_ring = (xr.reshape(2, 2, 2, 4).sum(1, keepdim=True).expand(2, 2, 2, 4).reshape(8, 4) * c).sum()
want_ring.backward()
ring_loss, ring_g = ring_grad(*vsf.device_put((x, c), vsf.NamedSharding(mesh, P())))
# a region manual over tp only: dp is left to the planner (the batch stays split over dp, the
# params' dp splits are gathered inside the region); and a balanced ragged all-to-all over tp
partial = vsf.shard_map(
    lambda x, a, b: vsf.ops.psum(torch.relu(x @ a) @ b, "tp"),
    mesh=mesh,
    in_specs=(P(), P(None, "tp"), P("tp")),
    out_specs=P(),
    axis_names=("tp",),
)
partial_step = vsf.jit(sgd_step(partial))
pw = vsf.device_put((w1, w2), (vsf.NamedSharding(mesh, P("dp", "tp")), vsf.NamedSharding(mesh, P("tp", "dp"))))
pws = optim.init_sharded(sgd, pw)
for _ in range(2):
    pw, pws, _ = partial_step(pw, pws, *xt)
dispatch = vsf.shard_map(
    lambda x: vsf.ops.all_to_all_v(x, "tp", [[2, 1], [1, 2]]),
    mesh=mesh,
    in_specs=P("tp"),
    out_specs=P("tp"),
    axis_names=("tp",),
)
dispatch_grad = vsf.jit(lambda x, c: vsf.value_and_grad(lambda x: (dispatch(x) * c).sum())(x))
xd, cd = torch.randn(6, 4), torch.randn(6, 4)
xdr = xd.clone().requires_grad_()
want_dispatch = (
    xdr[[0, 1, 3, 2, 4, 5]] * cd
).sum()  # rank 0 keeps rows 0, 1 and gets row 3; rank 1 gets row 2, keeps 4, 5
want_dispatch.backward()
dispatch_loss, dispatch_g = dispatch_grad(*vsf.device_put((xd, cd), vsf.NamedSharding(mesh, P("tp", "dp"))))


def program_collectives(jitted):
    return sum(
        1
        for n in next(iter(jitted._cache.values()))._runner.local.graph.nodes
        if "_c10d_functional" in str(n.target) and "wait" not in str(n.target)
    )


report.update(
    {
        "partial_max_param_err": max((a - b).abs().max().item() for a, b in zip(vsf.device_get(pw), want_w)),
        "partial_planned_collectives": len(partial_step.lower(pw, pws, *xt).cost().collectives),
        "partial_collectives_in_program": program_collectives(partial_step),
        "dispatch_loss_err": abs(vsf.device_get(dispatch_loss).item() - want_dispatch.item()),
        "dispatch_grad_err": (vsf.device_get(dispatch_g) - xdr.grad).abs().max().item(),
        "dispatch_planned_collectives": len(
            dispatch_grad.lower(*vsf.device_put((xd, cd), vsf.NamedSharding(mesh, P("tp", "dp")))).cost().collectives
        ),
        "dispatch_collectives_in_program": program_collectives(dispatch_grad),
        "region_max_param_err": max((a - b).abs().max().item() for a, b in zip(vsf.device_get(w), want_w)),
        "ring_loss_err": abs(vsf.device_get(ring_loss).item() - want_ring.item()),
        "ring_grad_err": (vsf.device_get(ring_g) - xr.grad).abs().max().item(),
        "region_planned_collectives": len(mlp_step.lower(w, ws, *xt).cost().collectives),
        "region_collectives_in_program": program_collectives(mlp_step),
    }
)

# a tensor the function closes over (a module buffer, such as rotary frequencies) is a constant of
# the traced program: its value and the gradient through it, against the same math unsharded
freqs = torch.linspace(1.0, 0.01, 8)
xc = torch.randn(4, 8)
xcs = vsf.device_put(xc, vsf.NamedSharding(mesh, P("dp", "tp"))).requires_grad_(True)
yc = vsf.jit(lambda x: torch.sin(x * freqs).sum())(xcs)
yc.backward()
report.update(
    {
        "constant_err": (vsf.device_get(yc) - torch.sin(xc * freqs).sum()).abs().item(),
        "constant_grad_err": (vsf.device_get(xcs.grad) - torch.cos(xc * freqs) * freqs).abs().max().item(),
    }
)
(out / f"rank{rank}.json").write_text(json.dumps(report))
