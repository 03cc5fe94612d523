"""Global values from what each process holds (``make_array_from_callback``,
``make_array_from_process_local_data``) and the cross-process value check of ``device_put``:
simulated ranks against ``torch.chunk``'s layout oracle (tests/layout_oracle.py), and 4 real gloo
processes (tier 3, ``tests/workers/data_world.py``, mesh dp=2 x tp=2) against one device."""

from __future__ import annotations

import pytest
import torch

import vsf
from vsf import P
from vsf.sharding import fingerprint
from layout_oracle import expected_shard

SIZES, NAMES = (2, 2), ("dp", "tp")


def _full(*shape: int) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)  # every element distinct


def _locals(x: torch.Tensor) -> list[torch.Tensor]:
    return [s.data for s in vsf.debug.shards(x)]


def _asking(full: torch.Tensor, asked: list) -> object:
    return lambda index: asked.append(index) or full[index]


@pytest.mark.parametrize(
    "entries, shape",
    [
        (("dp", "tp"), (8, 6, 4)),
        ((("tp", "dp"),), (8, 6, 4)),  # against mesh order: a strided shard
        ((None, ("dp", "tp")), (5, 6, 4)),  # uneven over two axes: 2, 2, 2, 0 columns
        ((), (5, 3)),  # replicated: asked once for every rank
        (("dp",), (5, 3)),  # uneven: 3 | 2 rows, asked once per dp row
        (("tp", "dp"), (3, 1)),  # empty shards
    ],
)
def test_the_callback_builds_every_shard_asked_once_per_distinct_index(sim, entries, shape):
    sim(4)
    mesh = vsf.make_mesh(SIZES, NAMES)
    full, asked = _full(*shape), []
    x = vsf.make_array_from_callback(shape, vsf.NamedSharding(mesh, P(*entries)), _asking(full, asked))
    want = [expected_shard(full, SIZES, NAMES, entries, r) for r in range(4)]
    assert all(torch.equal(got, w) for got, w in zip(_locals(x), want))
    distinct = {(tuple(w.shape), tuple(w.flatten().tolist())) for w in want}
    assert len(asked) == len({tuple((s.start, s.stop) for s in i) for i in asked}) == len(distinct)
    assert torch.equal(vsf.device_get(x), full)


@pytest.mark.parametrize(
    "spec",
    [
        P(vsf.ragged("dp", (1, 3)), "tp"),  # rows 2 | 6
        P(vsf.ragged("dp", (1, 2), dims=2)),  # 48 flattened rows 16 | 32: partial rows of dim 1
        P("dp", None, vsf.balanced("tp")),  # chunks 0, 3 | 1, 2 of the last dim
        P("dp", vsf.packed("tp", 3)),  # rows 0, 2, 4 | 1, 3, 5 of dim 1
    ],
)
def test_ragged_balanced_and_packed_shards_are_asked_for_as_global_boxes(sim, spec):
    sim(4)
    mesh = vsf.make_mesh(SIZES, NAMES)
    full, asked = _full(8, 6, 4), []
    s = vsf.NamedSharding(mesh, spec)
    x = vsf.make_array_from_callback(full.shape, s, _asking(full, asked))
    assert all(torch.equal(a, b) for a, b in zip(_locals(x), _locals(vsf.device_put(full, s))))  # device_put's own cut
    assert all(len(i) == 3 and all(0 <= sl.start <= sl.stop <= n for sl, n in zip(i, full.shape)) for i in asked)
    assert torch.equal(vsf.device_get(x), full)


def test_simulated_ranks_holding_one_shard_do_not_share_memory(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.make_array_from_callback((3,), vsf.NamedSharding(mesh, P()), lambda index: torch.zeros(3))
    a, b = _locals(x)
    a.add_(1)  # what an in-place optimizer step does to one rank's copy
    assert torch.equal(b, torch.zeros(3))


def test_the_callback_s_mistakes_are_named(sim):
    sim(4)
    mesh = vsf.make_mesh(SIZES, NAMES)
    full = _full(8, 4)
    rows = vsf.NamedSharding(mesh, P("dp"))
    with pytest.raises(
        ValueError,
        match=r"returned shape \(3, 4\) for index \[0:4, 0:4\] \(of rank 0's shard of the global shape \(8, 4\)\), "
        r"which has shape \(4, 4\): dim 0 has 3 elements where the index has 4",
    ):
        vsf.make_array_from_callback((8, 4), rows, lambda index: full[index][:3])
    with pytest.raises(
        TypeError,
        match=r"returned torch.float32 for index \[0:4, 0:4\] and torch.int64 for index \[4:8, 0:4\]; pass dtype=",
    ):
        vsf.make_array_from_callback(
            (8, 4), rows, lambda index: full[index] if index[0].start == 0 else full[index].long()
        )
    casted = vsf.make_array_from_callback((8, 4), rows, lambda index: full[index].numpy(), dtype=torch.bfloat16)
    assert torch.equal(vsf.device_get(casted), full.bfloat16())
    with pytest.raises(ValueError, match=r"unreduced over \('tp',\); a value made from data is reduced"):
        vsf.make_array_from_callback(
            (8, 4), vsf.NamedSharding(mesh, P("dp", unreduced=("tp",))), lambda index: full[index]
        )


def test_process_local_data_of_the_one_simulated_process_is_the_whole_value(sim):
    sim(4)
    mesh = vsf.make_mesh(SIZES, NAMES)
    full = _full(8, 4)
    rows = vsf.NamedSharding(mesh, P("dp"))
    assert vsf.sharding.process_slice(rows, full.shape) == (slice(0, 8), slice(0, 4))
    x = vsf.make_array_from_process_local_data({"x": rows}, {"x": full})["x"]
    assert vsf.typeof(x) == "f32[8@dp,4]" and torch.equal(vsf.device_get(x), full)
    with pytest.raises(
        ValueError,
        match=r"make_array_from_process_local_data of x: this one process holds every rank, so its local "
        r"data is the whole value; global_shape must be None or its shape \(8, 4\), got \(16, 4\)",
    ):
        vsf.make_array_from_process_local_data(rows, {"x": full}, {"x": (16, 4)})


# -- device_put's check: the same value everywhere ------------------------------------------------


def test_fingerprints_tell_values_apart_whatever_the_reduction_order():
    x = torch.randn(1000)
    same = fingerprint.fingerprint(x)
    assert torch.equal(same, fingerprint.fingerprint(x.clone()))
    changed, swapped = x.clone(), x.clone()
    changed[517] = torch.nextafter(changed[517], torch.tensor(1e9))  # one element, one ulp
    swapped[[10, 11]] = swapped[[11, 10]]
    for other in (changed, swapped, x.reshape(10, 100), x.double(), x[:999]):
        assert not torch.equal(same, fingerprint.fingerprint(other))
    assert fingerprint.describe(fingerprint.fingerprint(torch.zeros(4, 3, dtype=torch.int64))) == "(4, 3) torch.int64"
    assert fingerprint.fingerprint(torch.zeros(0, dtype=torch.bool)).shape == (fingerprint.WIDTH,)


def test_device_put_refuses_a_value_the_simulated_ranks_disagree_on(sim):
    sim(4)
    mesh = vsf.make_mesh(SIZES, NAMES)
    per_rank = torch.zeros(8, 4) + vsf.ops.axis_index("dp", mesh=mesh)  # each dp row of ranks its own value
    with pytest.raises(ValueError, match=r"^device_put of batch.x: the processes passed different values"):
        vsf.device_put({"batch": {"x": per_rank}}, vsf.NamedSharding(mesh, P("dp")))
    with pytest.raises(
        ValueError,
        match=r"rank 2's value differs from rank 0's \(both \(8, 4\) torch.float32\) \(and 1 more rank\)\. "
        r".*use vsf.make_array_from_process_local_data",
    ):
        vsf.device_put(per_rank, vsf.NamedSharding(mesh, P("dp")))
    agreed = torch.zeros(8, 4) + vsf.ops.axis_index("dp", mesh=mesh) * 0
    assert torch.equal(vsf.device_get(vsf.device_put(agreed, vsf.NamedSharding(mesh, P("dp")))), torch.zeros(8, 4))


def test_the_check_can_be_switched_off(sim, monkeypatch):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    per_rank = torch.zeros(4) + vsf.ops.axis_index("dp", mesh=mesh)
    monkeypatch.setattr(vsf.config, "check_across_processes", False)
    x = vsf.device_put(per_rank, vsf.NamedSharding(mesh, P("dp")))  # each rank keeps its own value's rows
    assert torch.equal(vsf.device_get(x), torch.tensor([0.0, 0.0, 1.0, 1.0]))


# -- on 4 real gloo processes (tests/workers/data_world.py) -----------------------------------------


@pytest.fixture(scope="module")
def ranks(world):
    return world("data_world.py")


@pytest.mark.world("data_world.py")
@pytest.mark.multiprocess
def test_each_process_passes_its_rows_and_the_loss_is_one_device_s(ranks):
    for r, got in enumerate(ranks):
        dp = r // 2
        assert got["slice"] == [[4 * dp, 4 * dp + 4], [0, 6]]
        assert got["batch"] == {
            "x": {"typeof": "f32[8@dp,6]", "local": [4, 6], "equal": True},
            "t": {"typeof": "i64[8@dp,3]", "local": [4, 3], "equal": True},
        }
        assert got["loss"] == pytest.approx(got["loss_one_device"], rel=1e-6)
        assert got["uneven"] == {"local": [[4, 6], [3, 6]][dp], "equal": True}  # global (7, 6) given
        assert got["whole_dim"] == {"local": [4, 6], "equal": True}  # every process passed all rows
        assert got["callback"] == {"asked": [[[4 * dp, 4 * dp + 4], [3 * (r % 2), 3 * (r % 2) + 3]]], "equal": True}


@pytest.mark.world("data_world.py")
@pytest.mark.multiprocess
def test_a_wrong_local_shape_is_named_on_every_process(ranks):
    for got in ranks:  # the dp=1 processes (ranks 2, 3) pass 3 rows where 4 belong
        assert got["short_given"] == (
            "make_array_from_process_local_data of x: rank 2 passes local data of shape (3, 6): dim 0 has 3 elements, "
            "but the rank's shard of the global shape (8, 6) has 4 there (or the whole dim, 8)"
        )
        assert got["short_inferred"].startswith(
            "make_array_from_process_local_data of <root>: the processes' local data imply different global shapes: "
            "rank 2 passes (3, 6), implying (6, 6), and rank 0 passes (4, 6), implying (8, 6)."
        )
        assert (
            got["dtype_differs"]
            == "make_array_from_process_local_data of <root>: rank 2 passes torch.float64 and rank 0 torch.float32; every process must pass one dtype"
        )
        assert (
            "ranks 0 and 1 hold the same shard [0:4, 0:6] of the global (8, 6) under P('dp') (replicas), but passed different data"
            in got["replicas_differ"]
        )


@pytest.mark.world("data_world.py")
@pytest.mark.multiprocess
def test_device_put_of_each_process_s_half_is_refused_unless_switched_off(ranks):
    for got in ranks:
        assert got["halves_put"].startswith(
            "device_put of batch: the processes passed different values: rank 2's value differs from rank 0's"
        )
        assert "vsf.make_array_from_process_local_data" in got["halves_put"]
        assert got["same_put"]
        assert got["halves_put_unchecked"] == [4, 6]  # the silent mistake the check exists for
        assert got["sub_mesh_same"] is None  # a tp sub-mesh compares its own ranks only
        first = 2 * got["dp"]
        assert (
            f"rank {first + 1}'s value differs from rank {first}'s (both (3,) torch.float32)" in got["sub_mesh_differ"]
        )
