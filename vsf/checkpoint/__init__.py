"""Checkpoints of pytrees on ``torch.distributed.checkpoint`` (DCP): resharded on load, atomic, checked, async.

``save`` writes any pytree of DTensors, plain tensors, Python scalars, strings and None (in dicts,
lists, tuples, NamedTuples and registered dataclasses); each rank writes only the shards it owns,
``RaggedShard`` and ``PackedShard`` ones as they are (:mod:`vsf.checkpoint.boxes`).
``load`` reads it back onto any mesh, specs and number of ranks, as a ``target`` tree of
:class:`vsf.ShapeDtypeStruct` (or live arrays, or :func:`vsf.eval_shape` of an init function)
says. A checkpoint directory appears only once complete (written aside, committed with a marker
holding checksums of every block of every file, then renamed), so a crash never leaves a half-written
checkpoint that could be loaded, and a damaged file is reported, never loaded.

Example::

    import vsf
    from vsf import P

    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))                  # under torchrun --nproc-per-node 4
    params = vsf.device_put({"w": torch.randn(8, 4)}, {"w": vsf.NamedSharding(mesh, P("dp", "tp"))})
    vsf.checkpoint.save("ckpt/step_100", {"params": params, "step": 100})

    mesh2 = vsf.make_mesh((2,), ("fsdp",))                      # later, on 2 ranks
    target = {"params": {"w": vsf.ShapeDtypeStruct((8, 4), torch.float32, vsf.NamedSharding(mesh2, P("fsdp")))},
              "step": 0}
    state = vsf.checkpoint.load("ckpt/step_100", target)

    # a pipeline's state (vsf.pipeline: each rank holds its stage's leaves, None at the others'):
    # saved once per leaf, with its global shape; loaded into any layout, e.g. the pipeline's own
    def init():
        p, _ = pipe.place(params, specs)
        return {"params": p, "opt": vsf.optim.init_sharded(tx, p, zero_axes=("dp",))}
    vsf.checkpoint.save("ckpt/pp", init())
    state = vsf.checkpoint.load("ckpt/pp", vsf.eval_shape(init))   # None where another stage's leaf is

    mngr = vsf.checkpoint.CheckpointManager("ckpt", max_to_keep=3, save_interval_steps=100)
    mngr.save(step, state, blocking=False)                      # copies shards, writes in the background

``load`` also reads a Hugging Face safetensors directory (``save_pretrained``'s) straight into the
target's shardings, each process reading only its slices, and ``save_hf`` writes one that
``from_pretrained`` reads; ``materialize_buffers`` recomputes the buffers of a model built on the
meta device (:mod:`vsf.checkpoint.hf` has the whole example)::

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    vsf.checkpoint.materialize_buffers(model)                   # its rotary frequencies, on the CPU
    params = vsf.checkpoint.load("llama-hf", target)            # target: ShapeDtypeStructs by parameter name
    vsf.checkpoint.save_hf("export", params, config=config)
"""

from vsf.checkpoint.format import FORMAT_VERSION
from vsf.errors import CorruptCheckpointError, NotACheckpointError
from vsf.checkpoint.loading import load
from vsf.checkpoint.manager import CheckpointManager
from vsf.checkpoint.saving import AsyncSave, async_save, save
from vsf.checkpoint.hf import save_hf
from vsf.checkpoint.meta import materialize_buffers

__all__ = [
    "FORMAT_VERSION",
    "AsyncSave",
    "CheckpointManager",
    "CorruptCheckpointError",
    "NotACheckpointError",
    "async_save",
    "load",
    "materialize_buffers",
    "save",
    "save_hf",
]
