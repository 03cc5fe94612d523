"""RaggedShard: the value object, its layout, and redistributions on simulated ranks and on 4 real
gloo processes (tier 3, ``multiprocess``).

Oracles: hand-computed layouts, ``torch.chunk`` for ``Shard``, and the full tensor itself
(every redistribution must hand each rank exactly its slice of it, ``workers/ops_oracles.py``).
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard
from workers.ops_oracles import as_local, check_simulated, expected_piece, per_rank, ragged_case, reshard_case

import vsf
from vsf import P, _compat
from vsf.sharding.ragged import RaggedShard, ragged, reshard


# -- the value object -------------------------------------------------------------------------------
def test_value_semantics():
    r = ragged("fsdp", (1, 2, 1, 0), dims=2, block=4)
    assert r == RaggedShard("fsdp", [1, 2, 1, 0], dims=2, block=4)
    assert hash(r) == hash(RaggedShard("fsdp", (1, 2, 1, 0), dims=2, block=4))
    assert r != ragged("fsdp", (1, 2, 1, 0), dims=2) and r != ragged("dp", (1, 2, 1, 0), dims=2, block=4)
    assert repr(r) == "RaggedShard('fsdp', units=(1, 2, 1, 0), dims=2, block=4)"
    assert eval(repr(r), {"RaggedShard": RaggedShard}) == r
    assert pickle.loads(pickle.dumps(r)) == r
    with pytest.raises(AttributeError, match="immutable"):
        r.units = (1,)  # type: ignore[misc]


@pytest.mark.parametrize(
    "args,kwargs,error,message",
    [
        (("fsdp", (1, -2, 1)), {}, ValueError, r"units must be >= 0, got \(1, -2, 1\) \(rank 1\)"),
        (("fsdp", (0, 0)), {}, ValueError, "all zero"),
        (("fsdp", ()), {}, ValueError, "needs one unit count per rank"),
        (("fsdp", (1.5, 1)), {}, TypeError, "sequence of ints"),
        (("fsdp", 3), {}, TypeError, "sequence of ints"),
        (("", (1,)), {}, TypeError, "mesh axis name"),
        (("fsdp", (1, 1)), {"dims": 0}, ValueError, "dims must be a positive int"),
        (("fsdp", (1, 1)), {"block": 0}, ValueError, "block must be a positive int"),
    ],
)
def test_bad_construction(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        RaggedShard(*args, **kwargs)


def test_layout_by_hand():
    r = ragged("fsdp", (1, 2, 1, 0))
    assert r.row_counts((8, 3)) == (2, 4, 2, 0)
    assert [r.row_range((8, 3), i) for i in range(4)] == [(0, 2), (2, 6), (6, 8), (8, 8)]
    assert r.local_shape((8, 3), 1) == (4, 3)
    blocks = ragged("fsdp", (3, 1), dims=2, block=4)  # 2*8 = 16 rows = 4 blocks of 4: 3 and 1
    assert blocks.row_counts((2, 8, 5)) == (12, 4)
    assert blocks.local_shape((2, 8, 5), 0) == (12, 5)
    assert ragged("fsdp", (2, 2)).row_counts((8,)) == (4, 4)  # element-wise on a 1D tensor


@pytest.mark.parametrize(
    "r,shape,message",
    [
        (ragged("fsdp", (1, 1, 1)), (8, 3), "has 3 units but mesh axis 'fsdp' has 4 ranks"),
        (ragged("fsdp", (1, 1, 1, 1), block=3), (8, 3), "a block of 3 rows does not divide the 8 rows of dims 0..0"),
        (
            ragged("fsdp", (1, 2, 1, 1)),
            (8, 3),
            r"8 blocks of 1 rows \(shape \(8, 3\)\) cannot be split in proportion \(1, 2, 1, 1\)",
        ),
        (ragged("fsdp", (1, 1, 1, 1), dims=3), (8, 3), "flattens 3 leading dims but the tensor has shape"),
    ],
)
def test_bad_layout(r, shape, message):
    with pytest.raises(ValueError, match=message):
        r.check(shape, 4, where="['w']")
    with pytest.raises(ValueError, match=r"for \['w'\]"):
        r.check(shape, 4, where="['w']")


def test_composes_with_shard_on_trailing_dims(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    got = vsf.NamedSharding(mesh, P(ragged("fsdp", (1, 3)), "tp")).devices_indices_map((8, 6))
    assert got == {
        0: (slice(0, 2), slice(0, 3)),
        1: (slice(0, 2), slice(3, 6)),
        2: (slice(2, 8), slice(0, 3)),
        3: (slice(2, 8), slice(3, 6)),
    }
    with pytest.raises(ValueError, match="mesh axis 'fsdp' is used twice in P.*by dim 0 and by dim 1"):
        P(ragged("fsdp", (1, 3)), "fsdp")


# -- redistribution -----------------------------------------------------------------------------------


def assert_layout(
    t: torch.Tensor, fulls: dict[int, torch.Tensor], layout, mesh: vsf.Mesh, axis: str, step: str, exact: bool = True
) -> None:
    got = per_rank(t)
    with _compat.local_mode_disabled():
        for rank in mesh.devices:
            want = expected_piece(fulls[rank], layout, mesh.coordinate(rank)[axis], mesh.axis_size(axis))
            assert got[rank].shape == want.shape, (
                f"{step}: rank {rank} holds {tuple(got[rank].shape)}, expected {tuple(want.shape)}"
            )
            if exact:
                assert torch.equal(got[rank], want), f"{step}: rank {rank} holds other values than its piece"
            else:
                torch.testing.assert_close(got[rank], want, msg=f"{step}: rank {rank}")


MESHES = {
    "1d": ((4,), ("fsdp",)),
    "2d": ((2, 3), ("dp", "fsdp")),
    "5d": ((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp")),
}


@pytest.mark.parametrize("name", list(MESHES))
def test_round_trips_are_exact(name):
    """Replicate -> Ragged(u1) -> Shard(d) -> Ragged(u2) -> Replicate, and Partial <-> Ragged."""
    sizes, names = MESHES[name]
    with vsf.simulate(math.prod(sizes)):
        mesh = vsf.make_mesh(sizes, names)
        n = mesh.axis_size("fsdp")
        other = next((a for a in names if a != "fsdp" and mesh.axis_size(a) > 1), None)

        @settings(max_examples=20, deadline=None, derandomize=True)
        @given(st.data(), st.booleans())
        def run(data, shard_other):
            shape, r1, r2, d = ragged_case(lambda lo, hi: data.draw(st.integers(lo, hi)), n, "fsdp")
            # with another axis sharding the tensor too, each fsdp group holds its own value
            scale = {r: 1 + (mesh.coordinate(r)[other] if other and shard_other else 0) for r in mesh.devices}
            with _compat.local_mode_disabled():
                full = torch.randn(shape)
                fulls = {r: full * scale[r] for r in mesh.devices}
                parts = {r: fulls[r] * (1 + mesh.coordinate(r)["fsdp"]) for r in mesh.devices}
                summed = {r: fulls[r] * sum(range(1, n + 1)) for r in mesh.devices}
            group_shape = tuple(shape)
            with vsf.use_mesh(mesh):
                x = as_local(dict(fulls))
                steps = [
                    (r1, "Replicate->Ragged"),
                    (Shard(d), "Ragged->Shard"),
                    (r2, "Shard->Ragged"),
                    (Replicate(), "Ragged->Replicate"),
                ]
                src = Replicate()
                for dst, step in steps:
                    x = reshard(x, group_shape, src, dst)
                    assert_layout(x, fulls, dst, mesh, "fsdp", step)
                    src = dst
                # Partial -> Ragged sums the partial values; Ragged -> Partial sums back to the value
                y = reshard(as_local(parts), group_shape, Partial(), r1)
                assert_layout(y, summed, r1, mesh, "fsdp", "Partial->Ragged", exact=False)
                z = reshard(reshard(y, group_shape, r1, Partial()), group_shape, Partial(), r2)
                assert_layout(z, summed, r2, mesh, "fsdp", "Ragged->Partial->Ragged", exact=False)

        run()


@pytest.mark.parametrize("name", ["1d", "2d"])
def test_reshard_values_and_gradients(name):
    """Each redistribution, and its backward (the transposed redistribution), against the oracle."""
    sizes, names = MESHES[name]
    with vsf.simulate(math.prod(sizes)):
        mesh = vsf.make_mesh(sizes, names)
        n = mesh.axis_size("fsdp")

        @settings(max_examples=6, deadline=None, derandomize=True)
        @given(st.data())
        def run(data):
            shape, r1, r2, d = ragged_case(lambda lo, hi: data.draw(st.integers(lo, hi)), n, "fsdp")
            steps = [
                (Replicate(), r1),
                (r1, Shard(d)),
                (Shard(d), r2),
                (r2, Replicate()),
                (Partial(), r1),
                (r1, Partial()),
                (r1, r2),
            ]
            with vsf.use_mesh(mesh):
                for src, dst in steps:
                    check_simulated(reshard_case(shape, src, dst, "fsdp", n), mesh)

        run()


def test_reshard_errors(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "fsdp"))
    x = torch.ones(4, 2)
    with vsf.use_mesh(mesh):
        with pytest.raises(ValueError, match="use DTensor.redistribute"):
            reshard(x, (4, 2), Replicate(), Shard(0))
        with pytest.raises(ValueError, match=r"name \['dp', 'fsdp'\]"):
            reshard(x, (4, 2), ragged("dp", (1, 1)), ragged("fsdp", (1, 1)))
        with pytest.raises(ValueError, match="has 3 units but mesh axis 'fsdp' has 2 ranks"):
            reshard(x, (4, 2), Replicate(), ragged("fsdp", (1, 1, 1)))
        with pytest.raises(ValueError, match="Shard.*names dim 2"):
            reshard(x, (4, 2), ragged("fsdp", (1, 1)), Shard(2))


# -- on 4 real gloo processes ------------------------------------------------------------------
# RaggedShard on 4 real gloo processes (tier 3), one torchrun launch: reshard and device_put
# round trips, Muon on ragged params, the grouped all-gather.

NPROC = 4


@pytest.fixture(scope="module")
def reports(world):
    return world("ops_ragged.py")


@pytest.mark.world("ops_ragged.py")
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_round_trips_are_exact_across_processes(reports, mesh):
    for rank, report in enumerate(reports):
        assert report[mesh]["cases"] == 40
        assert report[mesh]["failures"] == [], f"rank {rank}: {report[mesh]['failures'][:5]}"


@pytest.mark.world("ops_ragged.py")
@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_device_put_round_trips_are_exact(reports, mesh):
    for rank, report in enumerate(reports):
        assert report[mesh]["put_cases"] == 16
        assert report[mesh]["put_failures"] == [], f"rank {rank}: {report[mesh]['put_failures'][:5]}"


@pytest.mark.world("ops_ragged.py")
@pytest.mark.multiprocess
def test_muon_on_ragged_params_equals_one_device_and_each_matrix_runs_on_one_rank(reports):
    everywhere = []
    for rank, report in enumerate(reports):
        assert all(report["muon"]["equal"].values()), (rank, report["muon"]["equal"])
        assert all(r == rank for r, _ in report["muon"]["orthogonalized"])  # a process reports only itself
        everywhere += [tuple(x) for x in report["muon"]["orthogonalized"]]
    by_leaf = {path: {r for r, p in everywhere if p == path} for _, path in everywhere}
    assert sorted(by_leaf) == ["a", "c", "d", "e"] and all(len(ranks) == 1 for ranks in by_leaf.values())
    assert len(everywhere) == 4 * 3  # 4 matrices x 3 steps, each once


@pytest.mark.world("ops_ragged.py")
@pytest.mark.multiprocess
def test_gather_group_is_one_collective(reports):
    for report in reports:
        assert report["muon"]["gather_exact"] and report["muon"]["gather_collectives"] == 1
