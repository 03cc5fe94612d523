"""The one place where vsf touches private PyTorch APIs.

Everything that a PyTorch upgrade may rename or change lives here: the fake process group,
``LocalTensorMode`` / ``LocalTensor`` (simulated ranks with real numbers), ``_StridedShard``
(a multi-axis spec entry whose order differs from the mesh order) and ``FakeTensorMode``
(shapes without data, for ``vsf.eval_shape``). Other modules import these
names from here only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed._local_tensor import (
    LocalTensor,
    LocalTensorMode,
    enabled_local_tensor_mode,
    maybe_disable_local_tensor_mode,
)
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    "FakeTensorMode",
    "with_local_tensor",
    "LocalTensor",
    "LocalTensorMode",
    "StridedShard",
    "active_local_mode",
    "init_fake_process_group",
    "local_mode_disabled",
    "local_shards",
    "make_local",
    "quiet_redistribute",
    "single_rank_device_mesh",
]


def init_fake_process_group(world_size: int) -> None:
    """Initialise the default process group as PyTorch's fake backend of ``world_size`` ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


@contextlib.contextmanager
def quiet_redistribute() -> Iterator[None]:
    """Silence DTensor's advice to flatten mesh dims while vsf gathers a value on purpose."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def single_rank_device_mesh(device_type: str, rank: int, name: str) -> DeviceMesh:
    """A one-rank DeviceMesh that creates no communicator (a sub-mesh of size-1 axes)."""
    return DeviceMesh(device_type, torch.tensor([rank]), mesh_dim_names=(name,), _init_backend=False)


def active_local_mode() -> LocalTensorMode | None:
    """The enabled ``LocalTensorMode`` (simulated ranks with real numbers), if any."""
    return enabled_local_tensor_mode()


@contextlib.contextmanager
def local_mode_disabled() -> Iterator[None]:
    """Temporarily run plain (non-simulated) tensor code, e.g. to build a DeviceMesh."""
    with maybe_disable_local_tensor_mode():
        yield


def local_shards(t: torch.Tensor, rank: int) -> dict[int, torch.Tensor]:
    """Per-rank values of ``t``: every simulated rank for a ``LocalTensor``, else ``{rank: t}``."""
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    return {rank: t}


def with_local_tensor(x: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``x``'s layout (mesh, placements, global shape) over ``local``, which may
    live on another device than the mesh (a host copy staged for an async checkpoint)."""
    return DTensor(local, x._spec, requires_grad=False)


def make_local(per_rank: dict[int, torch.Tensor]) -> torch.Tensor:
    """Build a ``LocalTensor`` holding ``per_rank[r]`` on simulated rank ``r``."""
    return LocalTensor({r: v.detach() for r, v in per_rank.items()})
