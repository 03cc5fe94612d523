"""Tier 3 worker: checkpoints of a pipelined GPT on 4 real gloo processes (pp=2 x dp=2).

argv: out_dir. Trains 2 steps through vsf.pipeline (each rank holds only its stage's params and
optimizer state), saves them, loads them onto a plain 4-rank mesh (no pp), saves that layout
shifted by one, loads it back onto the pipeline's layout, and tries wrong targets. Every rank
writes out_dir/rank{r}.json.
"""

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # this checkout's vsf, and the example model
import vsf  # noqa: E402
from gpt import GPT, GPTConfig, batch_at, pipeline_stages  # noqa: E402
from vsf import P, optim  # noqa: E402

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
cfg = GPTConfig(vocab=16, seq=8, dim=16, heads=2, layers=2, period=4)
model = GPT(cfg)
params = vsf.tree.from_module(model)
specs = {k: P("dp") for k in params}
tx = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-3, weight_decay=0.1))
mesh = vsf.make_mesh((2, 2), ("pp", "dp"))
fns, loss_fn, prefixes = pipeline_stages(model, 2)
pipe = vsf.pipeline.Pipeline(
    fns, loss_fn, prefixes, mesh=mesh, microbatches=4, schedule="1f1b", batch=P("dp"), tied=("wte.weight",)
)


layout = pipe.layout(params, specs)


def init_pp():
    p, _ = pipe.place(params, specs)
    return {"params": p, "opt": optim.init_sharded(tx, p, zero_axes=("dp",))}


def flat(state):
    """Every leaf this rank holds, whole, by key path."""
    return {vsf.tree.keystr(k): vsf.device_get(v) for k, v in vsf.tree.leaves_with_path(state)}


def everyone(mine):
    """The union of every rank's ``mine`` (each leaf from the first rank holding it)."""
    every = [None] * 4
    torch.distributed.all_gather_object(every, mine)
    return {k: v for d in reversed(every) for k, v in d.items()}


def mismatches(got, want):
    return sorted(k for k in want if k not in got or not torch.equal(got[k], want[k])) + sorted(set(got) - set(want))


def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


state = init_pp()
for i in range(2):
    loss, grads = pipe.value_and_grad(state["params"], *batch_at(i, 8, cfg), layout=layout)
    updates, state["opt"] = tx.update(grads, state["opt"], state["params"])
    state["params"] = optim.apply_updates(state["params"], updates)
mine = flat(state)
ref = everyone(mine)
vsf.checkpoint.save(out / "pp2", state)
saved = vsf.checkpoint.format.read_checkpoint(out / "pp2").leaves
result = {
    "held": sorted(mine),
    "saved": {r.path: [list(r.shape), list(r.sharding.mesh.devices) if r.sharding else None] for r in saved},
    "ref_shapes": {k: list(v.shape) for k, v in ref.items()},
}

# pp=2 -> a plain 4-rank mesh: the target is eval_shape of the one-mesh init
flat_mesh = vsf.make_mesh((4,), ("dp",))


def init_flat():
    p = vsf.device_put(params, vsf.NamedSharding.tree(flat_mesh, specs))
    return {"params": p, "opt": optim.init_sharded(tx, p, zero_axes=("dp",))}


one = vsf.checkpoint.load(out / "pp2", vsf.eval_shape(init_flat))
result["pp2_to_flat"] = mismatches(flat(one), ref)
result["flat_meshes"] = sorted({str(vsf.sharding.named.sharding_of(x).mesh.shape) for x in vsf.tree.leaves(one)})

# a plain-mesh checkpoint (shifted by one) -> the pipeline's layout, targets from eval_shape of its init
shifted = vsf.tree.map(lambda x: x + 1, one)
vsf.checkpoint.save(out / "flat", shifted)
back = vsf.checkpoint.load(out / "flat", vsf.eval_shape(init_pp))
got = flat(back)
result["flat_to_pp2"] = mismatches(got, {k: ref[k] + 1 for k in mine})
result["flat_to_pp2_held"] = sorted(got)
result["flat_to_pp2_none_where"] = sorted(
    vsf.tree.keystr(k) for k, v in vsf.tree.flatten_with_path(back, is_leaf=lambda x: x is None)[0] if v is None
)


# resume: one more step from the loaded pp=2 checkpoint is the live run's next step
def step(state):
    loss, grads = pipe.value_and_grad(state["params"], *batch_at(2, 8, cfg), layout=layout)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optim.apply_updates(state["params"], updates), "opt": opt}, vsf.device_get(loss)


resumed, resumed_loss = step(vsf.checkpoint.load(out / "pp2", vsf.eval_shape(init_pp)))
live, live_loss = step(state)
result["resume_loss_equal"] = bool(torch.equal(resumed_loss, live_loss))
result["resume_mismatches"] = mismatches(flat(resumed), flat(live))

# wrong targets
abstract = vsf.eval_shape(init_pp)
bad = {**abstract, "params": dict(abstract["params"])}
if bad["params"]["lnf.weight"] is not None:
    s = bad["params"]["lnf.weight"]
    bad["params"]["lnf.weight"] = vsf.ShapeDtypeStruct((17,), s.dtype, s.sharding)
result["wrong_shape"] = error_of(lambda: vsf.checkpoint.load(out / "pp2", bad))
lacking = {**abstract, "params": {k: v for k, v in abstract["params"].items() if k != "blocks.1.fc2.weight"}}
result["missing_leaf"] = error_of(lambda: vsf.checkpoint.load(out / "pp2", lacking))
nowhere = {**abstract, "params": {**abstract["params"], "blocks.1.fc1.weight": None}}
result["none_everywhere"] = error_of(lambda: vsf.checkpoint.load(out / "pp2", nowhere))
(out / f"rank{rank}.json").write_text(json.dumps(result))
