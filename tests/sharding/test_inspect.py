"""Looking at placed values: ``typeof``, ``debug.shards`` and ``debug.visualize_sharding``."""

from __future__ import annotations

import pytest
import torch

import vsf
from vsf import P

NAMES = ("pp", "dp", "fsdp", "cp", "tp")


@pytest.mark.parametrize(
    "spec, dtype, want",
    [
        (P("dp", "tp"), torch.float32, "f32[8@dp,4@tp]"),
        (P(None, "fsdp"), torch.bfloat16, "bf16[8,4@fsdp]"),
        (P(("tp", "dp")), torch.int64, "i64[8@(tp,dp),4]"),
        (P(("dp", "fsdp"), "tp"), torch.float16, "f16[8@(dp,fsdp),4@tp]"),
        (P(None, "tp", unreduced="dp"), torch.float32, "f32[8,4@tp]{U:dp}"),
        (P(unreduced=("tp", "dp")), torch.float64, "f64[8,4]{U:dp,tp}"),
        (P("pp", "cp"), torch.float32, "f32[8,4]"),  # size-1 axes hold no split
    ],
)
def test_typeof_of_placed_values(sim, spec, dtype, want):
    sim(8)
    mesh = vsf.make_mesh((1, 2, 2, 1, 2), NAMES)
    x = vsf.device_put(torch.zeros(8, 4, dtype=dtype), vsf.NamedSharding(mesh, spec))
    assert vsf.typeof(x) == want


def test_typeof_of_plain_tensors():
    assert vsf.typeof(torch.zeros(3, 2)) == "f32[3,2]"
    assert vsf.typeof(torch.zeros((), dtype=torch.bool)) == "bool[]"
    assert vsf.typeof(torch.zeros(5, dtype=torch.uint8)) == "u8[5]"
    with pytest.raises(TypeError, match="typeof expects a tensor, got list"):
        vsf.typeof([1.0])


def test_type_string_of_placements_no_spec_expresses(sim):
    # dp and fsdp split dim 0 in mesh order, tp splits each of their pieces again, strided by 4:
    # no P(...) entry orders the axes that way, so the text gives DTensor's own terms
    from torch.distributed.tensor import Partial, Shard

    from vsf._compat import StridedShard
    from vsf.sharding.inspect import type_string

    sim(8, compute=False)
    mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    placements = (Shard(0), Shard(0), StridedShard(0, split_factor=4))
    assert type_string((32, 16), torch.float32, mesh, placements) == "f32[32@<dp,fsdp,tp/sf4>,16]"
    assert (
        type_string((32, 16), torch.float32, mesh, (Partial(), Shard(0), StridedShard(0, split_factor=2)))
        == "f32[32@<fsdp,tp/sf2>,16]{U:dp}"
    )


def test_shards_lists_every_simulated_rank_with_its_index_and_data(sim):
    sim(4)
    mesh = vsf.make_mesh((4,), ("x",))
    full = torch.arange(10.0).reshape(5, 2)
    got = vsf.debug.shards(vsf.device_put(full, vsf.NamedSharding(mesh, P("x"))))
    assert [(s.rank, s.index) for s in got] == [
        (0, (slice(0, 2), slice(0, 2))),
        (1, (slice(2, 4), slice(0, 2))),
        (2, (slice(4, 5), slice(0, 2))),
        (3, (slice(5, 5), slice(0, 2))),
    ]
    assert [s.data.tolist() for s in got] == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]], [[8.0, 9.0]], []]


def test_shards_of_a_replicated_axis_and_of_a_plain_tensor(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    got = vsf.debug.shards(vsf.device_put(torch.arange(4.0), vsf.NamedSharding(mesh, P("dp"))))
    assert [(s.rank, s.data.tolist()) for s in got] == [
        (0, [0.0, 1.0]),
        (1, [0.0, 1.0]),
        (2, [2.0, 3.0]),
        (3, [2.0, 3.0]),
    ]
    plain = vsf.debug.shards(torch.ones(2))
    assert [(s.rank, s.index) for s in plain] == [(r, (slice(0, 2),)) for r in range(4)]


PICTURES = {
    "1d uneven": (
        (4,),
        ("x",),
        (5,),
        P("x"),
        [
            "f32[5@x] on {'x': 4}",
            "  0:2   2:4   4:5 ",
            "┌─────┬─────┬─────┐",
            "│  0  │  1  │  2  │",
            "└─────┴─────┴─────┘",
            "empty shards (uneven split): ranks 3",
        ],
    ),
    "1d replicated over dp": (
        (2, 2),
        ("dp", "tp"),
        (10,),
        P("tp"),
        [
            "f32[10@tp] on {'dp': 2, 'tp': 2}",
            "  0:5    5:10 ",
            "┌──────┬──────┐",
            "│ 0,2  │ 1,3  │",
            "└──────┴──────┘",
        ],
    ),
    "2d": (
        (2, 2),
        ("dp", "tp"),
        (6, 4),
        P("tp", "dp"),
        [
            "f32[6@tp,4@dp] on {'dp': 2, 'tp': 2}",
            "        0:2   2:4 ",
            "      ┌─────┬─────┐",
            "[0:3] │  0  │  2  │",
            "      ├─────┼─────┤",
            "[3:6] │  1  │  3  │",
            "      └─────┴─────┘",
        ],
    ),
    "2d unreduced": (
        (2, 2),
        ("dp", "tp"),
        (3, 4),
        P(None, "dp", unreduced="tp"),
        [
            "f32[3,4@dp]{U:tp} on {'dp': 2, 'tp': 2}",
            "        0:2   2:4 ",
            "      ┌─────┬─────┐",
            "[0:3] │ 0,1 │ 2,3 │",
            "      └─────┴─────┘",
            "each block is an unreduced partial sum over tp",
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(PICTURES))
def test_visualize_sharding_pictures(sim, case):
    sizes, names, shape, spec, picture = PICTURES[case]
    sim(4)
    mesh = vsf.make_mesh(sizes, names)
    x = vsf.device_put(torch.zeros(shape), vsf.NamedSharding(mesh, spec))
    assert vsf.debug.visualize_sharding(x) == "\n".join(picture)


def test_visualize_plain_tensors_and_bad_ranks(sim):
    sim(4)
    assert vsf.debug.visualize_sharding(torch.zeros(3)).splitlines()[3] == "│ 0-3 │"  # every simulated rank
    with pytest.raises(ValueError, match=r"draws 1D or 2D tensors, got 3D \(shape \(2, 2, 2\)\)"):
        vsf.debug.visualize_sharding(torch.zeros(2, 2, 2))
