"""RaggedShard as a spec entry: P, NamedSharding, device_put/device_get, inspection, on simulated ranks.

Oracles: hand-computed layouts and strings, and ``ops_oracles.expected_local`` (rows of the
flattened leading dims from the definition, later dims cut with ``torch.chunk``), which shares
no code with vsf's layout.
"""

from __future__ import annotations

import collections
import math
import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

import vsf
from vsf import P, RaggedShard, _compat
from vsf.ops import backend
from vsf.sharding import NamedSharding, RaggedPlacement, sharding_of
from test_ragged import MESHES
from workers.ops_oracles import expected_local, per_rank, ragged_case

ragged = vsf.ragged


# -- the spec entry -----------------------------------------------------------------------------------


def test_spec_entry_value_semantics():
    r = ragged("fsdp", units=(1, 2, 1, 0))
    p = P(r, None, "tp")
    assert repr(p) == "P(RaggedShard('fsdp', units=(1, 2, 1, 0), dims=1, block=1), None, 'tp')"
    assert eval(repr(p), {"P": P, "RaggedShard": RaggedShard}) == p
    assert pickle.loads(pickle.dumps(p)) == p and hash(pickle.loads(pickle.dumps(p))) == hash(p)
    assert p != P(ragged("fsdp", units=(1, 2, 0, 1)), None, "tp")
    assert p.ragged == r and P("fsdp").ragged is None
    assert p.axes == ("fsdp", "tp") and p.entry_axes(0) == ("fsdp",) and p.entry_axes(1) == ()
    assert P(ragged("fsdp", (1, 1), dims=2), None).normalized() == P(ragged("fsdp", (1, 1), dims=2))


@pytest.mark.parametrize(
    "make,message",
    [
        (
            lambda: P(ragged("fsdp", (1, 1)), "fsdp"),
            r"mesh axis 'fsdp' is used twice in P\(RaggedShard.*by dim 0 and by dim 1",
        ),
        (lambda: P(None, ragged("fsdp", (1, 1))), "must be the first entry of a P, got .* at dim 1"),
        (
            lambda: P(ragged("fsdp", (1, 1), dims=2), "tp"),
            r"flattens dims 0..1 into rows, so their other entries must be None; dim 1 is 'tp'",
        ),
        (lambda: P(ragged("fsdp", (1, 1)), unreduced="fsdp"), "'fsdp' in P.* both shards dim 0 and is unreduced"),
        (lambda: ragged("fsdp", (1, -1)), r"units must be >= 0, got \(1, -1\) \(rank 1\)"),
        (lambda: P((ragged("fsdp", (1, 1)),)), "must name mesh axes as strings"),
    ],
)
def test_spec_errors(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


# -- layout ------------------------------------------------------------------------------------------


def test_named_sharding_layout_by_hand(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    r = ragged("fsdp", (1, 3))
    s = NamedSharding(mesh, P(r, "tp"))
    assert s.ragged == r and s.placements == (RaggedPlacement(r), Shard(1))
    assert s.devices_indices_map((8, 6)) == {  # rank = 2 fsdp + tp; rows 2 | 6
        0: (slice(0, 2), slice(0, 3)),
        1: (slice(0, 2), slice(3, 6)),
        2: (slice(2, 8), slice(0, 3)),
        3: (slice(2, 8), slice(3, 6)),
    }
    assert [s.shard_shape((8, 6), k) for k in range(4)] == [(2, 3), (2, 3), (6, 3), (6, 3)]
    assert s.shard_shape((8, 6)) == (6, 3)
    blocks = NamedSharding(mesh, P(ragged("fsdp", (3, 1), dims=2, block=4)))  # 2*8 = 16 rows, 4 blocks: 3 | 1
    assert blocks.index((2, 8, 5), 1) == (slice(0, 12), slice(0, 5))
    assert blocks.index((2, 8, 5), 2) == (slice(12, 16), slice(0, 5))
    assert blocks.index_view(torch.zeros(2, 8, 5)).shape == (16, 5)
    one = vsf.Mesh((1, 4), ("fsdp", "tp"))  # a ragged split over a size-1 axis holds everything
    whole = NamedSharding(one, P(ragged("fsdp", (1,), dims=2)))
    assert whole.ragged is None and whole.index((2, 3), 0) == (slice(0, 2), slice(0, 3))


def test_bad_input_names_the_key_path(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    with pytest.raises(
        ValueError,
        match=r"the spec at w: RaggedShard\('fsdp', units=\(1, 1, 1\).*has 3 units but mesh axis 'fsdp' has 2 ranks",
    ):
        NamedSharding.tree(mesh, {"w": P(ragged("fsdp", (1, 1, 1)))})
    with vsf.use_mesh(mesh):
        with pytest.raises(
            ValueError, match=r"device_put of \['a'\]\[0\] .*has 3 units but mesh axis 'fsdp' has 2 ranks"
        ):
            vsf.device_put({"a": [torch.ones(4, 2)]}, {"a": [P(ragged("fsdp", (1, 1, 1)))]})
        with pytest.raises(
            ValueError, match=r"device_put of a\.w .*a block of 3 rows does not divide the 4 rows of dims 0..0"
        ):
            vsf.device_put({"a": {"w": torch.ones(4, 2)}}, {"a": {"w": P(ragged("fsdp", (1, 1), block=3))}})
        with pytest.raises(
            ValueError, match=r"device_put of b .*flattens 3 leading dims but the tensor has shape \(4, 2\)"
        ):
            vsf.device_put({"b": torch.ones(4, 2)}, {"b": P(ragged("fsdp", (1, 1), dims=3))})
        x = vsf.device_put(torch.ones(4, 3), P("fsdp"))  # 3 columns over tp=2: groups differ under simulation
        with pytest.raises(
            ValueError, match="under vsf.simulate a ragged redistribution over 'fsdp' needs the other mesh axes"
        ):
            vsf.device_put(x, P(ragged("fsdp", (1, 1)), "tp"))


# -- looking at ragged values --------------------------------------------------------------------------


def test_typeof_shards_visualize_and_memory_by_hand(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    full = torch.arange(48.0).reshape(8, 6)
    x = vsf.device_put(full, NamedSharding(mesh, P(ragged("fsdp", (1, 3)), "tp")))
    assert vsf.typeof(x) == "f32[8@fsdp~(1,3),6@tp]"
    assert sharding_of(x) == NamedSharding(mesh, P(ragged("fsdp", (1, 3)), "tp"))
    shards = vsf.debug.shards(x)
    assert [(s.rank, s.index) for s in shards] == [
        (0, (slice(0, 2), slice(0, 3))),
        (1, (slice(0, 2), slice(3, 6))),
        (2, (slice(2, 8), slice(0, 3))),
        (3, (slice(2, 8), slice(3, 6))),
    ]
    assert all(torch.equal(s.data, full[s.index]) for s in shards)
    assert vsf.debug.memory_report(x) == {0: 2 * 3 * 4, 1: 2 * 3 * 4, 2: 6 * 3 * 4, 3: 6 * 3 * 4}
    assert vsf.debug.visualize_sharding(x).splitlines() == [
        "f32[8@fsdp~(1,3),6@tp] on {'fsdp': 2, 'tp': 2}",
        "        0:3   3:6 ",
        "      ┌─────┬─────┐",
        "[0:2] │  0  │  1  │",
        "      ├─────┼─────┤",
        "[2:8] │  2  │  3  │",
        "      └─────┴─────┘",
    ]
    b = vsf.device_put(
        torch.zeros(2, 8, 5, dtype=torch.bfloat16), NamedSharding(mesh, P(ragged("fsdp", (3, 1), dims=2, block=4)))
    )
    assert vsf.typeof(b) == "bf16[2*8@fsdp~(3,1)x4,5]"
    assert vsf.debug.memory_report(b) == {0: 12 * 5 * 2, 1: 12 * 5 * 2, 2: 4 * 5 * 2, 3: 4 * 5 * 2}
    flat = vsf.debug.visualize_sharding(vsf.device_put(full, NamedSharding(mesh, P(ragged("fsdp", (3, 1), dims=2)))))
    assert flat.splitlines()[3:] == [
        "│  0,1  │  2,3  │",
        "└───────┴───────┘",
        "slices are of the 2 leading dims flattened into rows",
    ]


# -- device_put / device_get: every redistribution, any rank, 1D/2D/5D meshes ----------------------------------


@pytest.mark.parametrize("name", list(MESHES))
def test_device_put_round_trips_are_exact(name):
    """Replicate -> Ragged(u1) -> Shard -> Ragged(u2) -> Replicate through device_put, another axis
    (when the mesh has one) splitting a later dim; every local shard against the oracle."""
    sizes, names = MESHES[name]
    with vsf.simulate(math.prod(sizes)):
        mesh = vsf.make_mesh(sizes, names)
        n = mesh.axis_size("fsdp")
        other = next((a for a in names if a != "fsdp" and mesh.axis_size(a) > 1), None)

        @settings(max_examples=12, deadline=None, derandomize=True)
        @given(st.data())
        def run(data):
            shape, r1, r2, d = ragged_case(lambda lo, hi: data.draw(st.integers(lo, hi)), n, "fsdp")
            shape, ndim, later = list(shape), len(shape), max(r1.dims, r2.dims)
            split = other is not None and later < ndim and data.draw(st.booleans())
            rest = [None] * (ndim - 1)
            shard = [None] * ndim
            if split:  # the other axis splits a later dim evenly (simulation needs it)
                rest[later - 1] = shard[later] = other
                shape[later] = mesh.axis_size(other) * data.draw(st.integers(1, 2))
                d = d if d != later else 0
            shard[d] = "fsdp"
            steps = [P(r1, *rest), P(*shard), P(r2, *rest), P()]
            with _compat.local_mode_disabled():
                full = torch.randn(shape)
            x = full
            for spec in steps:
                x = vsf.device_put(x, NamedSharding(mesh, spec))
                assert sharding_of(x) == NamedSharding(mesh, spec)
                got = per_rank(x.to_local())
                with _compat.local_mode_disabled():
                    for rank in mesh.devices:
                        want = expected_local(full, sizes, names, list(spec), rank)
                        assert torch.equal(got[rank], want), (
                            f"{spec} on rank {rank}: {tuple(got[rank].shape)} vs {tuple(want.shape)}"
                        )
                assert torch.equal(vsf.device_get(x), full), spec

        run()


def test_partial_and_ragged_to_ragged_move_once(sim, monkeypatch):
    """Partial -> Ragged is one ragged reduce-scatter, Ragged -> Ragged one all-to-all,
    Replicate -> Ragged a local slice, Ragged -> Partial refused."""
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "fsdp"))
    calls = collections.Counter()
    for fn in ("exchange", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        original = getattr(backend, fn)
        monkeypatch.setattr(backend, fn, lambda *a, _f=original, _n=fn, **k: (calls.update([_n]), _f(*a, **k))[1])
    full = torch.randn(6, 4)
    r1, r2 = NamedSharding(mesh, P(ragged("fsdp", (1, 2)), None)), NamedSharding(mesh, P(ragged("fsdp", (2, 1))))
    x = vsf.device_put(full, r1)
    assert calls == {}
    partial = vsf.device_put(full, NamedSharding(mesh, P(unreduced=("fsdp",))))
    y = vsf.device_put(partial, r2)
    assert calls == {"exchange": 1}
    z = vsf.device_put(x, r2)
    assert calls == {"exchange": 2}
    assert torch.equal(vsf.device_get(y), full) and torch.equal(vsf.device_get(z), full)
    with pytest.raises(ValueError, match="cannot make a reduced value unreduced"):
        vsf.device_put(x, NamedSharding(mesh, P(unreduced=("fsdp",))))
    grads = vsf.device_put(full, NamedSharding(mesh, P(ragged("fsdp", (1, 2)), unreduced=("dp",))))  # HSDP-style
    calls.clear()
    w = vsf.device_put(grads, r1)
    assert calls == {"all_reduce": 1}  # a psum over dp; the ragged rows stay where they are
    assert torch.equal(vsf.device_get(w), full)


def test_accessors_save_as_is_and_reload_as_shard(sim):
    """What a checkpoint needs: each rank's rows, the RaggedShard, the global shape, and the way
    back (from_local). Saved pieces are put together by their index and reloaded as Shard."""
    sim(4)
    mesh = vsf.make_mesh((4,), ("fsdp",))
    full = torch.randn(3, 8, 2)
    s = NamedSharding(mesh, P(ragged("fsdp", (2, 0, 1, 1), dims=2, block=2)))
    x = vsf.device_put(full, s)
    spec = sharding_of(x).spec
    assert (spec.ragged.axis, spec.ragged.units, spec.ragged.dims, spec.ragged.block) == ("fsdp", (2, 0, 1, 1), 2, 2)
    assert [p.ragged for p in x.placements if isinstance(p, RaggedPlacement)] == [spec.ragged]
    assert tuple(x.shape) == (3, 8, 2)
    saved = {piece.rank: (piece.index, piece.data.clone()) for piece in vsf.debug.shards(x)}  # as a checkpoint would
    assert {k: i[0] for k, (i, _) in saved.items()} == {
        0: slice(0, 12),
        1: slice(12, 12),
        2: slice(12, 18),
        3: slice(18, 24),
    }
    with _compat.local_mode_disabled():
        rebuilt = torch.zeros(24, 2)
        for index, data in saved.values():
            rebuilt[index] = data
    assert torch.equal(rebuilt.reshape(3, 8, 2), full)
    as_shard = vsf.device_put(rebuilt.reshape(3, 8, 2), NamedSharding(mesh, P(None, "fsdp")))
    back = vsf.device_put(as_shard, s)
    assert torch.equal(vsf.device_get(back), full)
    again = vsf.sharding.from_local(x.to_local(), s, x.shape)
    assert sharding_of(again) == s and torch.equal(vsf.device_get(again), full)
