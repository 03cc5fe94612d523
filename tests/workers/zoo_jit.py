"""Tier 3 worker: a model of the zoo (argv: out_dir, family name, then optionally a layout of
``zoo.LAYOUTS``, ``dp_tp`` by default, and ``vsf.jit``'s backend, ``eager`` by default) trained 3
steps through ``vsf.jit`` (``value_and_grad`` + the zoo's AdamW, params and state donated) on real
gloo processes, against the whole model trained by ``torch.optim.AdamW`` on one device in each
process: the traced local program (what a real run executes; vsf.simulate interprets the plan
instead) with the model's buffers and constants in it, run as it is or compiled by Inductor. A
family is a Hugging Face one (``zoo.families()``) or another library's (``test_libraries.FAMILIES``).
Each process reports its losses, the oracle's, the params not within the zoo's tolerance, whether
Inductor compiled the program, and the warnings vsf.jit gave."""

import json
import math
import os
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "models")]  # this checkout's vsf, and the zoo
import test_libraries  # noqa: E402
import vsf  # noqa: E402
import zoo  # noqa: E402
from vsf import optim  # noqa: E402

out, name = Path(sys.argv[1]), sys.argv[2]
layout = sys.argv[3] if len(sys.argv) > 3 else "dp_tp"
backend = sys.argv[4] if len(sys.argv) > 4 else "eager"
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
family = {**zoo.families(), **test_libraries.FAMILIES}[name]
want_losses, want_params = zoo.torch_run(family)
model, batches = zoo.built(family)
params = vsf.tree.from_module(model)
tx = zoo.adamw()
shape, axes, kind, batch_spec = zoo.LAYOUTS[layout]
if math.prod(shape) != world:
    raise ValueError(f"layout {layout!r} needs {math.prod(shape)} processes, this launch has {world}")
mesh = vsf.make_mesh(shape, axes)
p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, zoo.specs(params, kind, family)))
s = optim.init_sharded(tx, p)
step = vsf.jit(zoo.train_step(model, tx, family.loss), donate_argnums=(0, 1), backend=backend)
losses = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for batch in batches:
        p, s, loss = step(p, s, vsf.device_put(batch, vsf.NamedSharding(mesh, batch_spec)))
        losses.append(vsf.device_get(loss).item())
got = vsf.device_get(p)
(compiled,) = step._cache.values()
report = {
    "losses": losses,
    "want_losses": [x.item() for x in want_losses],
    "plan_count": step.plan_count,
    "max_param_err": max((got[k] - want_params[k]).abs().max().item() for k in want_params),
    "not_close": zoo.not_close(got, want_params),
    "compiled_by_inductor": compiled._runner.compiled_by_inductor,
    "warnings": [str(w.message) for w in caught if "vsf.jit" in str(w.message)],
}
(out / f"rank{rank}.json").write_text(json.dumps(report))
