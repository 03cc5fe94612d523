"""4 real gloo ranks, mesh (dp=2, tp=2): load a 1-process save, save the test tree, async save under mutation, resume.

Usage: ckpt_world4.py OUT, where OUT/one holds the test tree saved whole by one process. Writes OUT/a (layout A), OUT/async, OUT/run (a CheckpointManager
directory) and OUT/ckpt_world4-0/rank{r}.json with the checks each rank made.
"""

import torch

import vsf
from ckpt_common import abstract, build, layouts, mismatches, model_state, out_dir, real, train, write_result

out = out_dir()
mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
result = {}

# 0. Load the tree this test's process saved whole onto 4 ranks.
target = build(mesh, "A", abstract)
loaded = vsf.checkpoint.load(out / "one", target)
result["from_one_mismatches"] = mismatches(loaded)
result["from_one_layout_as_target"] = layouts(loaded) == layouts(target)

# 1. Save layout A; load it back without a target: leaves come back as saved.
tree = build(mesh, "A", real)
vsf.checkpoint.save(out / "a", tree)
back = vsf.checkpoint.load(out / "a")
result["as_saved_mismatches"] = mismatches(back)
result["as_saved_same_layout"] = layouts(back) == layouts(tree)

# 2. Async: mutate every tensor in place as soon as save returns; the checkpoint keeps the old values.
handle = vsf.checkpoint.save(out / "async", tree, blocking=False)
for leaf in vsf.tree.leaves(tree):
    if isinstance(leaf, torch.Tensor):
        local = leaf.to_local() if isinstance(leaf, torch.distributed.tensor.DTensor) else leaf
        local.add_(1000) if local.is_floating_point() else local.bitwise_not_()
handle.wait()
result["async_mutated_differs"] = mismatches(tree) != []
result["async_mismatches"] = mismatches(vsf.checkpoint.load(out / "async"))

# 3. Resume: train 3 steps, save (async, training goes on mutating in place), train 3 more;
#    then restore step 3 and train the same 3 steps: identical losses and params, bit for bit.
mngr = vsf.checkpoint.CheckpointManager(out / "run", max_to_keep=2, save_interval_steps=3)
state = model_state(mesh)
train(state, mesh, 3)
saved = [mngr.save(s, state, blocking=False) for s in (2, 3)]
continued = train(state, mesh, 3)
final = vsf.device_get(state["params"])
mngr.wait()
restored = mngr.restore(target=state)
resumed = train(restored, mesh, 3)
result["resume_saved_flags"] = saved
result["resume_losses"] = [continued, resumed]
result["resume_params_equal"] = all(torch.equal(final[k], v) for k, v in vsf.device_get(restored["params"]).items())
result["resume_layout_equal"] = layouts(restored) == layouts(state)

# 4. Retention (keep 2, interval 3): 4 is skipped, 6 and 9 push out 3; a forced 5 pushes out 6.
result["interval_saved"] = [mngr.save(step, state) for step in (4, 6, 9)]
result["steps_after_9"] = mngr.all_steps()
result["forced_saved"] = mngr.save(5, state, force=True)
result["steps_after_forced_5"] = mngr.all_steps()
result["latest_step"] = mngr.latest_step()
write_result(out, result)
