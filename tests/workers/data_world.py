"""Tier-3 worker on 4 gloo processes, mesh (dp=2, tp=2), against one device (see
tests/sharding/test_make_array.py and tests/checkpoint/test_hf.py).

Per-process data: each process passes its dp rows of a batch (``make_array_from_process_local_data``,
inferred, uneven and whole-dim shapes), a jitted loss on it against the one-device loss, the
mistakes it must name on every process (3 rows where 4 belong, replicas passing different data,
each process's half given to ``device_put``, on the whole mesh and on a sub-mesh), and the indices
``make_array_from_callback`` asks for. Hugging Face weights: rank 0 saves a tiny Llama with
``save_pretrained`` (sharded files); every process builds the model on the meta device, loads the
checkpoint into (dp, tp) shardings reading its slices, runs a jitted forward against the model's
own, and exports the params with ``save_hf``, which ``from_pretrained`` reads back.

Usage: data_world.py OUT_DIR
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import vsf
from vsf import P

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
dp = mesh.coordinate(rank)["dp"]
rows = vsf.NamedSharding(mesh, P("dp"))
report: dict = {"rank": rank, "dp": dp}


def error(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


# -- per-process data --------------------------------------------------------------------------
torch.manual_seed(0)
x, t = torch.randn(8, 6), torch.arange(8 * 3).reshape(8, 3)
w = torch.randn(6, 2)
mine = vsf.sharding.process_slice(rows, x.shape)
report["slice"] = [[s.start, s.stop] for s in mine]
batch = vsf.make_array_from_process_local_data(rows, {"x": x[mine], "t": t[vsf.sharding.process_slice(rows, t.shape)]})
report["batch"] = {
    k: {"typeof": vsf.typeof(v), "local": list(v.to_local().shape), "equal": torch.equal(vsf.device_get(v), full)}
    for (k, v), full in zip(batch.items(), (x, t))
}
loss = vsf.jit(lambda w, x: ((x @ w) ** 2).mean())(vsf.device_put(w, vsf.NamedSharding(mesh, P())), batch["x"])
report["loss"], report["loss_one_device"] = vsf.device_get(loss).item(), ((x @ w) ** 2).mean().item()

x7 = torch.randn(7, 6)  # 4 + 3 rows: the shares differ, so the global shape is given
uneven = vsf.make_array_from_process_local_data(rows, x7[vsf.sharding.process_slice(rows, x7.shape)], (7, 6))
report["uneven"] = {"local": list(uneven.to_local().shape), "equal": torch.equal(vsf.device_get(uneven), x7)}
whole = vsf.make_array_from_process_local_data(rows, x, x.shape)  # every process passes all rows: each keeps its own
report["whole_dim"] = {"local": list(whole.to_local().shape), "equal": torch.equal(vsf.device_get(whole), x)}

short = x[mine][:3] if dp == 1 else x[mine]  # the dp=1 processes hold 3 rows where 4 belong
report["short_inferred"] = error(lambda: vsf.make_array_from_process_local_data(rows, short))
report["short_given"] = error(lambda: vsf.make_array_from_process_local_data(rows, {"x": short}, {"x": (8, 6)}))
report["dtype_differs"] = error(
    lambda: vsf.make_array_from_process_local_data(rows, x[mine].double() if dp == 1 else x[mine])
)
report["replicas_differ"] = error(
    lambda: vsf.make_array_from_process_local_data(rows, x[mine] + mesh.coordinate(rank)["tp"])
)
report["halves_put"] = error(lambda: vsf.device_put({"batch": x[mine]}, rows))
report["same_put"] = torch.equal(vsf.device_get(vsf.device_put({"batch": x}, rows))["batch"], x)
vsf.config.check_across_processes = False
report["halves_put_unchecked"] = list(vsf.device_put(x[mine], rows).shape)  # silently the wrong global shape
vsf.config.check_across_processes = True
tp_group = vsf.NamedSharding(mesh["tp"], P())  # a sub-mesh: compared over its own ranks only
report["sub_mesh_same"] = error(lambda: vsf.device_put(torch.full((3,), float(dp)), tp_group))
report["sub_mesh_differ"] = error(lambda: vsf.device_put(torch.full((3,), float(rank)), tp_group))

asked = []
by_callback = vsf.make_array_from_callback(
    (8, 6), vsf.NamedSharding(mesh, P("dp", "tp")), lambda index: asked.append(index) or x[index]
)
report["callback"] = {
    "asked": [[[s.start, s.stop] for s in index] for index in asked],
    "equal": torch.equal(vsf.device_get(by_callback), x),
}

# -- Hugging Face weights ------------------------------------------------------------------------
config = transformers.LlamaConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)  # the same weights on every process
if rank == 0:
    model.save_pretrained(out / "hf", max_shard_size="8KB")
dist.barrier()
with torch.device("meta"):
    empty = transformers.LlamaForCausalLM(config)
vsf.checkpoint.materialize_buffers(empty)
shapes = vsf.tree.from_module(empty)
specs = vsf.sharding.match(
    shapes,
    [
        (r".*(q|k|v|gate|up)_proj\.weight", P("tp", "dp")),
        (r".*(o|down)_proj\.weight", P("dp", "tp")),
        (r".*embed_tokens\.weight", P("dp")),
        (r".*", P()),
    ],
)
target = vsf.tree.map(lambda s, p: vsf.ShapeDtypeStruct(s.shape, s.dtype, vsf.NamedSharding(mesh, p)), shapes, specs)
params = vsf.checkpoint.load(out / "hf", target)
own = vsf.tree.from_module(model)
gathered = vsf.device_get(params)
report["hf"] = {
    "files": sorted(p.name for p in (out / "hf").glob("*.safetensors")),
    "equal": {k: torch.equal(gathered[k], own[k]) for k in own},
    "local_shapes_ok": all(
        tuple(params[k].to_local().shape) == target[k].sharding.shard_shape(target[k].shape, rank) for k in own
    ),
    "q_proj": vsf.typeof(params["model.layers.0.self_attn.q_proj.weight"]),
}
ids = torch.randint(0, 32, (4, 8))
logits = vsf.jit(lambda p, i: vsf.tree.apply(empty, p, i).logits)(params, vsf.device_put(ids, rows))
report["hf"]["logits_err"] = (vsf.device_get(logits) - model(ids).logits).abs().max().item()
vsf.checkpoint.save_hf(out / "export", params, config=config, max_shard_bytes=4096)
back = transformers.LlamaForCausalLM.from_pretrained(out / "export")
report["hf"]["export_files"] = len(list((out / "export").glob("*.safetensors")))
report["hf"]["export_equal"] = all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())

(out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
