"""vsf: JAX-style functional sharding for PyTorch.

Name a mesh, say how each leaf of a pytree is laid out on it with a ``P`` spec, and vsf places
it as DTensors (NCCL on CUDA, gloo on CPU, or simulated ranks in one process)::

    import torch, vsf
    from vsf import P

    with vsf.simulate(8):
        mesh = vsf.make_mesh((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"))
        params = {"w": torch.randn(16, 8), "b": torch.zeros(8)}
        params = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {"w": P("fsdp", "tp"), "b": P()}))
        print(vsf.typeof(params["w"]))          # f32[16@fsdp,8@tp]
"""

from vsf import (
    checkpoint,
    config,
    debug,
    errors,
    nn,
    ops,
    optim,
    pipeline,
    random,
    remat_policies,
    sharding,
    stages,
    tree,
)
from vsf.errors import (
    ApplyError,
    CorruptCheckpointError,
    HigherOrderGradError,
    NotACheckpointError,
    PlanCheckError,
    PlanError,
    PlanMismatch,
    TraceError,
)
from vsf.abstract import ShapeDtypeStruct, eval_shape
from vsf.func import checkpoint_name, grad, remat, shard_map, value_and_grad, with_sharding_constraint
from vsf.jit import jit
from vsf.runtime import simulate
from vsf.sharding import (
    BalancedShard,
    Mesh,
    NamedSharding,
    P,
    PackedShard,
    PartitionSpec,
    RaggedShard,
    device_get,
    device_put,
    make_array_from_callback,
    make_array_from_process_local_data,
    make_mesh,
    use_mesh,
)
from vsf.sharding.inspect import typeof
from vsf.sharding.spec import balanced, packed, ragged

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``vsf.launch`` is imported on first use, so ``python -m vsf.launch`` runs it fresh."""
    if name == "launch":
        import importlib

        return importlib.import_module("vsf.launch")
    raise AttributeError(f"module 'vsf' has no attribute {name!r}")


__all__ = [
    "ApplyError",
    "BalancedShard",
    "CorruptCheckpointError",
    "HigherOrderGradError",
    "Mesh",
    "NamedSharding",
    "NotACheckpointError",
    "P",
    "PackedShard",
    "PartitionSpec",
    "PlanCheckError",
    "PlanError",
    "PlanMismatch",
    "RaggedShard",
    "ShapeDtypeStruct",
    "TraceError",
    "balanced",
    "checkpoint",
    "checkpoint_name",
    "config",
    "debug",
    "errors",
    "device_get",
    "device_put",
    "eval_shape",
    "grad",
    "jit",
    "launch",
    "make_array_from_callback",
    "make_array_from_process_local_data",
    "make_mesh",
    "nn",
    "optim",
    "pipeline",
    "ops",
    "packed",
    "ragged",
    "random",
    "remat",
    "remat_policies",
    "shard_map",
    "sharding",
    "simulate",
    "stages",
    "tree",
    "typeof",
    "use_mesh",
    "value_and_grad",
    "with_sharding_constraint",
]
