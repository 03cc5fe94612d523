"""Meshes, specs and layouts: ``Mesh``, ``P``, ``NamedSharding``, rules, placement and inspection.

The ragged spec entry is ``vsf.ragged(...)`` (a :class:`RaggedShard`); ``vsf.sharding.ragged``
is the module that moves ragged values, ``vsf.sharding.eager`` computes on them (elementwise,
sum, mean, norm), and :func:`ragged_plan` / :func:`gather_group` pack a pytree for flat-buffer FSDP.
:func:`make_array_from_callback` and :func:`make_array_from_process_local_data` build a global
value from what each process holds (its slice: :func:`process_slice`).
The balanced layout of a causal sequence is ``vsf.balanced("cp")`` (a :class:`BalancedShard`);
a fused weight's pieces each split over an axis are ``vsf.packed("tp", parts)`` (a :class:`PackedShard`).
"""

from vsf.sharding.mesh import Mesh, current_mesh, make_mesh, mesh_of, use_mesh
from vsf.sharding.named import BalancedPlacement, NamedSharding, RaggedPlacement, sharding_of
from vsf.sharding.packing import gather_group, ragged_plan, reduce_scatter_group
from vsf.sharding.make_array import make_array_from_callback, make_array_from_process_local_data, process_slice
from vsf.sharding.put import device_get, device_put, from_local
from vsf.sharding.rules import logical_to_mesh, match
from vsf.sharding.spec import UNCONSTRAINED, BalancedShard, P, PackedShard, PartitionSpec, RaggedShard

__all__ = [
    "UNCONSTRAINED",
    "BalancedPlacement",
    "BalancedShard",
    "Mesh",
    "NamedSharding",
    "P",
    "PackedShard",
    "PartitionSpec",
    "RaggedPlacement",
    "RaggedShard",
    "current_mesh",
    "device_get",
    "device_put",
    "from_local",
    "gather_group",
    "logical_to_mesh",
    "make_array_from_callback",
    "make_array_from_process_local_data",
    "make_mesh",
    "match",
    "mesh_of",
    "process_slice",
    "ragged_plan",
    "reduce_scatter_group",
    "sharding_of",
    "use_mesh",
]
