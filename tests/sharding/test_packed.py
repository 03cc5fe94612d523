"""The packed layout of a fused dim (``vsf.packed("tp", parts)``): the dim is ``parts`` equal
consecutive pieces, each split contiguously over the axis, rank ``i`` holding slice ``i`` of every
piece (transformers' "packed_colwise", Mixtral's ``gate_up_proj``). Oracle: the rows each rank
holds written out by hand from positions, and the original tensor after round trips."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.distributed.tensor import Shard

import vsf
from vsf import P
from vsf import _compat
from vsf.sharding import sharding_of


def test_the_spec_entry_is_an_immutable_value():
    p = vsf.packed("tp", 2)
    assert p == vsf.PackedShard("tp", parts=2) and hash(p) == hash(vsf.PackedShard("tp", 2))
    assert p != vsf.packed("tp", 3) and p != vsf.packed("dp", 2) and p != "tp"
    assert eval(repr(p), {"PackedShard": vsf.PackedShard}) == p
    spec = P("ep", p, None)
    assert pickle.loads(pickle.dumps(spec)) == spec and repr(spec) == "P('ep', PackedShard('tp', parts=2), None)"
    assert spec.axes == ("ep", "tp") and spec.packed == {1: p} and spec.entry_axes(1) == ("tp",)
    assert spec.without(("tp",)) == P("ep", None, None)
    with pytest.raises(AttributeError):
        p.parts = 3
    with pytest.raises(ValueError, match="'tp' is used twice"):
        P("tp", p)


@pytest.mark.parametrize(
    "make, error, message",
    [
        (
            lambda: vsf.packed("tp", 1),
            ValueError,
            r"parts must be an int >= 2 .* got 1; one piece is the plain split 'tp'",
        ),
        (lambda: vsf.packed("tp", 2.0), ValueError, r"parts must be an int >= 2 .* got 2\.0"),
        (lambda: vsf.packed("", 2), TypeError, r"PackedShard needs a mesh axis name, got ''"),
    ],
)
def test_bad_entries_are_refused(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("n, parts", [(2, 2), (4, 2), (2, 3)])
def test_each_rank_holds_its_slice_of_every_piece_and_the_round_trips_give_the_original(sim, n, parts):
    rows = parts * n * 2  # every piece: 2 rows per rank
    w = torch.arange(2 * rows * 3).view(2, rows, 3)
    sim(2 * n)
    mesh = vsf.make_mesh((2, n), ("ep", "tp"))
    s = vsf.NamedSharding(mesh, P("ep", vsf.packed("tp", parts), None))
    placed = vsf.device_put({"gate_up": w}, s)["gate_up"]
    assert tuple(placed.placements) == (Shard(0), _compat.StridedShard(1, split_factor=parts))
    assert vsf.typeof(placed) == f"i64[2@ep,{rows}@tp~pk{parts},3]"
    assert sharding_of(placed) == s
    piece = rows // parts
    for rank, local in _compat.local_shards(placed.to_local(), 0).items():
        e, i = divmod(rank, n)
        held = [k * piece + 2 * i + j for k in range(parts) for j in range(2)]  # rows 2i, 2i+1 of each piece
        assert local.tolist() == w[e : e + 1, held].tolist(), rank
        assert s.index_view(w)[s.index(w.shape, rank)].tolist() == local.tolist(), rank
        assert s.shard_shape(w.shape, rank) == (1, parts * 2, 3)
    torch.testing.assert_close(vsf.device_get(placed), w, rtol=0, atol=0)
    contiguous = vsf.device_put(placed, vsf.NamedSharding(mesh, P("ep", "tp")))
    torch.testing.assert_close(vsf.device_get(contiguous), w, rtol=0, atol=0)
    again = vsf.device_put(contiguous, s)
    assert tuple(again.placements) == tuple(placed.placements)
    torch.testing.assert_close(vsf.device_get(again), w, rtol=0, atol=0)


def test_devices_indices_map_slices_the_view_with_each_ranks_rows_together(sim):
    """``devices_indices_map`` indexes :meth:`NamedSharding.index_view`, as a balanced split's does:
    rank 1 of 2 holds rows 2..4 and 6..8 of 8, which the view puts at 4..8."""
    sim(2)
    s = vsf.NamedSharding(vsf.make_mesh((2,), ("tp",)), P(vsf.packed("tp", 2)))
    assert s.devices_indices_map((8, 5)) == {0: (slice(0, 4), slice(0, 5)), 1: (slice(4, 8), slice(0, 5))}
    assert s.index_view(torch.arange(8)).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert vsf.packed("tp", 2).ranges(8, 2, 1) == ((2, 4), (6, 8))


def test_a_dim_that_is_not_parts_equal_even_pieces_is_refused_naming_the_leaf(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    with pytest.raises(
        ValueError,
        match=r"device_put of gate_up \(tensor of shape \(6, 4\)\): PackedShard\('tp', parts=2\) for dim 0 \(shape \(6, 4\)\): a dim of size 6 "
        r"is not 2 equal pieces each split evenly over tp=2 ranks; make it a multiple of 2 \* 2 = 4",
    ):
        vsf.device_put({"gate_up": torch.zeros(6, 4)}, vsf.NamedSharding(mesh, P(vsf.packed("tp", 2))))


def test_a_packed_entry_beside_a_ragged_or_balanced_one_is_refused(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    with pytest.raises(ValueError, match="holds a ragged and a packed entry"):
        vsf.NamedSharding(mesh, P(vsf.ragged("fsdp", (1, 1)), vsf.packed("tp", 2)))
    with pytest.raises(ValueError, match="holds a balanced and a packed entry"):
        vsf.NamedSharding(mesh, P(vsf.balanced("fsdp"), vsf.packed("tp", 2)))


def test_over_an_axis_of_one_rank_it_holds_everything(sim):
    sim(2)
    mesh = vsf.make_mesh((2, 1), ("ep", "tp"))
    placed = vsf.device_put(torch.arange(12.0).view(2, 6), vsf.NamedSharding(mesh, P("ep", vsf.packed("tp", 2))))
    assert vsf.typeof(placed) == "f32[2@ep,6]"
    torch.testing.assert_close(vsf.device_get(placed), torch.arange(12.0).view(2, 6), rtol=0, atol=0)
