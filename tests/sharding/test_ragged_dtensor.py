"""Carrying a RaggedShard value as a DTensor: what DTensor keeps, and that it refuses (loudly,
never silently) what it cannot compute. These pin the PyTorch behaviour vsf's design relies on."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate

import vsf
from vsf import P
from vsf.sharding.ragged import RaggedPlacement, ragged, reshard
from workers.ops_oracles import expected_piece, per_rank


@pytest.fixture
def ragged_dtensor(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "fsdp"))
    r = ragged("fsdp", (3, 0))
    full = torch.arange(24.0).reshape(6, 4)
    with vsf.use_mesh(mesh):
        dt = vsf.sharding.from_local(
            reshard(full, full.shape, Replicate(), r), vsf.NamedSharding(mesh, P(r)), full.shape
        )
    return dt, r, full, mesh


def test_dtensor_keeps_placement_shape_and_ragged_locals(ragged_dtensor):
    dt, r, full, mesh = ragged_dtensor
    assert isinstance(dt, DTensor)
    assert dt.placements == (Replicate(), RaggedPlacement(r))
    assert dt.shape == (6, 4)
    for rank, local in per_rank(dt.to_local()).items():
        assert torch.equal(local, expected_piece(full, r, mesh.coordinate(rank)["fsdp"], 2))


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t * 2,
        torch.relu,
        lambda t: t.sum(),
        lambda t: t.full_tensor(),
        lambda t: t.redistribute(t.device_mesh, [Replicate(), Replicate()]),
    ],
)
def test_dtensor_ops_refuse_ragged_placements(ragged_dtensor, op):
    with pytest.raises(RuntimeError, match="not supported|Expected Shard"):
        op(ragged_dtensor[0])


def test_placement_value_semantics():
    r = ragged("fsdp", (1, 2))
    assert RaggedPlacement(r) == RaggedPlacement(ragged("fsdp", (1, 2)))
    assert hash(RaggedPlacement(r)) == hash(RaggedPlacement(ragged("fsdp", (1, 2))))
    assert RaggedPlacement(r) != RaggedPlacement(ragged("fsdp", (2, 1)))
    assert repr(RaggedPlacement(r)) == "RaggedPlacement(RaggedShard('fsdp', units=(1, 2), dims=1, block=1))"
