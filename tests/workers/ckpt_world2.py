"""2 real gloo ranks, mesh (x=2): load the 4-rank checkpoint resharded, save layout B, then die mid-save.

Usage: ckpt_world2.py OUT, where OUT/a was written by ckpt_world4.py. Loads OUT/a onto this
mesh in several ways, saves OUT/b, commits step 1 of the manager directory OUT/run2, writes
OUT/ckpt_world2-0/rank{r}.json, and then rank 1 SIGKILLs itself as soon as it has written the
first bytes of step 2, so the run fails; the test checks what that left on disk.
"""

import functools
import os
import signal

import torch

import vsf
from ckpt_common import Adam, abstract, build, error_of, layouts, mismatches, out_dir, real, write_result
from vsf.checkpoint import storage

out = out_dir()
mesh = vsf.make_mesh((2,), ("x",))
mngr = vsf.checkpoint.CheckpointManager(out / "run2")
result = {}


def adam_init(params):
    """An optax-style init: zeros like the params, and a step count."""
    return Adam(
        vsf.tree.map(torch.zeros_like, params),
        vsf.tree.map(torch.zeros_like, params),
        torch.zeros([], dtype=torch.int32),
    )


def step_tree(step):
    """What step ``step`` of OUT/run2 holds: layout B, floats shifted by the step."""
    return build(mesh, "B", functools.partial(real, step=step))


def die_while_writing():
    """Rank 1 SIGKILLs itself as soon as it has written its first bytes of data."""
    write = storage._ChecksumStream.write

    def write_then_die(self, b):
        n = write(self, b)
        os.kill(os.getpid(), signal.SIGKILL)
        return n

    if vsf.runtime.rank() == 1:
        storage._ChecksumStream.write = write_then_die


target = build(mesh, "B", abstract)

# 1. Targets of ShapeDtypeStructs on another mesh, other specs, half the ranks.
loaded = vsf.checkpoint.load(out / "a", target)
result["structs_mismatches"] = mismatches(loaded)
result["structs_layout_as_target"] = layouts(loaded) == layouts(target)

# 2. The optimizer part of the target from eval_shape of an init function (nothing allocated).
abstract_opt = vsf.eval_shape(adam_init, target["params"])
result["eval_shape_opt_is_struct"] = all(isinstance(x, vsf.ShapeDtypeStruct) for x in vsf.tree.leaves(abstract_opt))
result["eval_shape_opt_equals_target"] = abstract_opt == target["opt"]
result["eval_shape_mismatches"] = mismatches(vsf.checkpoint.load(out / "a", dict(target, opt=abstract_opt)))

# 3. Live arrays as the target: their layout is taken, their values are not touched.
live = build(mesh, "B", lambda path, shape, dtype, s: torch.zeros_like(real(path, shape, dtype, s)))
loaded = vsf.checkpoint.load(out / "a", live)
result["live_mismatches"] = mismatches(loaded)
result["live_layout_as_target"] = layouts(loaded) == layouts(live)
result["live_untouched"] = all(
    not x.any() for x in vsf.tree.leaves(vsf.device_get(live)) if isinstance(x, torch.Tensor)
)

# 4. Without a target, a checkpoint from another mesh size is refused, naming both.
result["no_target_error"] = error_of(lambda: vsf.checkpoint.load(out / "a"))

# 5. Save layout B here (the test loads it on one process).
vsf.checkpoint.save(out / "b", build(mesh, "B", real))

# 6. Commit step 1, then die while writing step 2.
mngr.save(1, step_tree(1))
result["steps_before_kill"] = mngr.all_steps()
write_result(out, result)
die_while_writing()
mngr.save(2, step_tree(2))
raise AssertionError(f"rank {vsf.runtime.rank()} survived the kill")
