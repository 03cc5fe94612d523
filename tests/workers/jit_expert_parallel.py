"""Tier 3 worker on 2 real gloo processes: vsf.nn.expert_parallel over ``ep`` inside vsf.jit (the
program traced once into local ops and collectives, the counted exchanges kept whole and their
counts read as it runs), one plan called with three routings (spread, all tokens to one rank's
experts, spread again), each against the dense mixture on one device (tests/jit/test_expert_parallel.py).

Usage: jit_expert_parallel.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "jit"))
import vsf  # noqa: E402
from test_expert_parallel import dense, experts, inputs, loss_of  # noqa: E402
from vsf import P  # noqa: E402

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
mesh = vsf.make_mesh((2,), ("ep",))


def moe(x, index, gates, w_in, w_out):
    return vsf.nn.expert_parallel(experts, x, index, gates, (w_in, w_out), axis="ep", mesh=mesh)


step = vsf.jit(lambda q, index: vsf.value_and_grad(lambda r: loss_of(moe)({**r, "index": index}))(q))
tokens = vsf.NamedSharding(mesh, P("ep"))
errors = []
for skewed in (False, True, False):
    p = inputs(skewed)
    keys = sorted(k for k in p if k != "index")
    want_loss, want = vsf.value_and_grad(lambda q: loss_of(dense)({**q, "index": p["index"]}))({k: p[k] for k in keys})
    q = {k: vsf.device_put(p[k], vsf.NamedSharding(mesh, P("ep")) if k.startswith("w") else tokens) for k in keys}
    loss, grads = step(q, vsf.device_put(p["index"], tokens))
    errors.append(
        {
            "loss": abs(vsf.device_get(loss).item() - want_loss.item()) / want_loss.abs().item(),
            **{k: ((vsf.device_get(grads[k]) - want[k]).abs().max() / want[k].abs().max()).item() for k in keys},
        }
    )
report = {
    "errors": errors,
    "plan_count": step.plan_count,
    "traced_program": step._cache[next(iter(step._cache))]._runner.local is not None,
}
(out / f"rank{rank}.json").write_text(json.dumps(report))
