"""Meshes, specs and layouts: ``Mesh``, ``P``, ``NamedSharding``, rules, placement and inspection."""

from vsf.sharding.mesh import Mesh, current_mesh, make_mesh, mesh_of, use_mesh
from vsf.sharding.named import NamedSharding, sharding_of
from vsf.sharding.put import device_get, device_put
from vsf.sharding.rules import logical_to_mesh, match
from vsf.sharding.spec import UNCONSTRAINED, P, PartitionSpec

__all__ = [
    "UNCONSTRAINED",
    "Mesh",
    "NamedSharding",
    "P",
    "PartitionSpec",
    "current_mesh",
    "device_get",
    "device_put",
    "logical_to_mesh",
    "make_mesh",
    "match",
    "mesh_of",
    "sharding_of",
    "use_mesh",
]
