"""Tier 3 worker: a Hugging Face model of the zoo (argv: out_dir, family name: ``gpt2``, ``llama``
or ``mixtral``) cut into two pipeline stages (``zoo.pipeline_stages``) and trained 3 steps by torch's
Schedule1F1B over pp=2 real gloo processes (2 microbatches, the zoo's AdamW), against the whole
model trained by ``torch.optim.AdamW`` on one device in each process. Mixtral (8 experts, top-2)
runs on pp=2 x ep=2 (4 processes), its experts ``P("ep")`` and the batch over ep: each stage's
program sends its microbatch's tokens to the experts. Each process reports its losses, the
oracle's, the params it holds, and those not within the zoo's tolerance of the oracle's; and from
its ``pipe.lower``, the bytes of its stage's exchanges over ep and the stages that gather params."""

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "models")]  # this checkout's vsf, and the zoo
import vsf  # noqa: E402
import zoo  # noqa: E402

out, name = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
experts = name == "mixtral"
family = zoo.moe(name, 8) if experts else zoo.families()[name]
want_losses, want_params = zoo.torch_run(family)
model, batches = zoo.built(family)
params = vsf.tree.from_module(model)
fns, prefixes, tied = zoo.pipeline_stages(name, model)
mesh = vsf.make_mesh((2, 2), ("pp", "ep")) if experts else vsf.make_mesh((2,), ("pp",))
batch = vsf.P("ep") if experts else vsf.P()
pipe = vsf.pipeline.Pipeline(
    fns, zoo.causal_lm_loss, prefixes, mesh=mesh, microbatches=2, schedule="1f1b", batch=batch, tied=tied
)
split = (".experts.gate_up_proj", ".experts.down_proj")
placed = pipe.place(params, {k: vsf.P("ep") if experts and k.endswith(split) else vsf.P() for k in params})
lowered = pipe.lower(placed[0], batches[0]["input_ids"], batches[0]["labels"], layout=placed[1])
p, losses = zoo.train_pipelined(pipe, zoo.adamw(), placed, batches)
got = {k: vsf.device_get(v) for k, v in p.items() if v is not None}
report = {
    "losses": [x.item() for x in losses],
    "want_losses": [x.item() for x in want_losses],
    "held": sorted(got),
    "max_param_err": max((got[k] - want_params[k]).abs().max().item() for k in got),
    "not_close": zoo.not_close(got, want_params),
    "exchanges": [c.bytes for st in lowered.stages.values() for c in st.cost().collectives if c.kind == "all_to_all_v"],
    "gathers": sorted(lowered.gathers),
}
(out / f"rank{rank}.json").write_text(json.dumps(report))
