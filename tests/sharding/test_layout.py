"""Layout = JAX's (docs/architecture.md, Placements): ``devices_indices_map`` against JAX, uneven dims by hand, scale.

JAX runs on 64 virtual CPU devices (``XLA_FLAGS`` is set in conftest.py before jax starts); a
JAX mesh over ``jax.devices()[:n]`` has device ids ``0..n-1`` row-major, so device id == rank.
"""

from __future__ import annotations

import math
from types import ModuleType

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

import vsf
from vsf import P
from vsf._compat import StridedShard

AXIS_NAMES = ("pp", "dp", "fsdp", "cp", "tp", "ep", "sp")
SCALE_SIZES = (4, 8, 8, 2, 2)
SCALE_NAMES = ("pp", "dp", "fsdp", "cp", "tp")


def _jax() -> ModuleType:
    """JAX, imported by the tests that compare with it (not when the file is collected: every
    pytest-xdist worker collects it, and the import takes 1.5 s)."""
    import jax

    return jax


def test_jax_has_64_devices_with_ids_in_order():
    assert [d.id for d in _jax().devices()] == list(range(64))


def _bounds(index, shape):
    """A tuple of slices as ``(start, stop)`` pairs (JAX writes an unsharded dim as ``slice(None)``)."""
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


@st.composite
def layouts(draw, max_devices=64):
    """A mesh (1-5 axes, size-1 axes included, names and order random), a spec and a divisible shape."""
    ndim = draw(st.integers(1, 5) if draw(st.booleans()) else st.integers(4, 5))
    sizes = draw(
        st.lists(st.sampled_from([1, 1, 2, 2, 3, 4, 8]), min_size=ndim, max_size=ndim).filter(
            lambda s: math.prod(s) <= max_devices
        )
    )
    names = tuple(draw(st.permutations(AXIS_NAMES))[:ndim])
    rank = draw(st.integers(0, 4) if draw(st.booleans()) else st.integers(1, 4))
    # Each mesh axis shards one tensor dim or none; the order of axes within a dim is random,
    # so multi-axis entries come both in mesh order and against it.
    owner = [draw(st.sampled_from([None, *range(rank), *range(rank)])) if rank else None for _ in names]
    order = draw(st.permutations(range(ndim)))
    entries = []
    for dim in range(rank):
        axes = tuple(names[i] for i in order if owner[i] == dim)
        entries.append(None if not axes else axes[0] if len(axes) == 1 and draw(st.booleans()) else axes)
    used = max([d + 1 for d, e in enumerate(entries) if e is not None], default=0)
    spec_len = draw(st.integers(used, rank))  # trailing Nones written out or omitted
    size_of = dict(zip(names, sizes))
    shape = tuple(
        math.prod(size_of[a] for a in ((e,) if isinstance(e, str) else e or ())) * draw(st.integers(1, 3))
        for e in entries
    )
    return sizes, names, entries[:spec_len], shape


@settings(max_examples=150)
@given(layouts())
@example(((2, 1, 2, 2, 4), SCALE_NAMES, [("tp", "dp"), None, ("fsdp", "pp")], (16, 3, 4)))
@example(((2, 2, 2, 2, 2), SCALE_NAMES, [("cp", "fsdp", "dp"), ("tp", "pp")], (8, 4)))
@example(((4, 4, 4), ("a", "b", "c"), [None, ("c", "a", "b")], (1, 64)))
def test_devices_indices_map_equals_jax(layout):
    sizes, names, entries, shape = layout
    n = math.prod(sizes)
    jax = _jax()
    jax_mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(sizes), names)
    want = jax.sharding.NamedSharding(jax_mesh, jax.sharding.PartitionSpec(*entries))
    with vsf.simulate(n, compute=False):
        mesh = vsf.make_mesh(sizes, names)
        got = vsf.NamedSharding(mesh, P(*entries))
        got_map = got.devices_indices_map(shape)
        assert {r: _bounds(i, shape) for r, i in got_map.items()} == {
            d.id: _bounds(i, shape) for d, i in want.devices_indices_map(shape).items()
        }
        assert got.shard_shape(shape) == want.shard_shape(shape)
        assert all(got.shard_shape(shape, r) == want.shard_shape(shape) for r in range(n))
        assert got.is_fully_replicated == want.is_fully_replicated


# -- uneven dims, by hand ------------------------------------------------------------------


def _rows(s: vsf.NamedSharding, shape):
    return [(i[0].start, i[0].stop) for _, i in sorted(s.devices_indices_map(shape).items())]


def test_uneven_single_axis_follows_torch_chunk():
    s = vsf.NamedSharding(vsf.Mesh((4,), ("x",)), P("x"))
    assert _rows(s, (5,)) == [(0, 2), (2, 4), (4, 5), (5, 5)]  # 2, 2, 1, 0 rows
    assert _rows(s, (6,)) == [(0, 2), (2, 4), (4, 6), (6, 6)]  # torch.chunk(6, 4): 2, 2, 2, 0
    assert [s.shard_shape((5, 3), r) for r in range(4)] == [(2, 3), (2, 3), (1, 3), (0, 3)]
    assert s.shard_shape((5, 3)) == (2, 3)


def test_uneven_multi_axis_entry_in_mesh_order_splits_major_axis_first():
    mesh = vsf.Mesh((2, 2), ("dp", "fsdp"))
    s = vsf.NamedSharding(mesh, P(("dp", "fsdp")))
    # dp splits 5 rows 3 | 2, then fsdp splits each: 2 | 1 and 1 | 1.
    assert _rows(s, (5,)) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    # 7 rows on three axes of 2: 4 | 3 -> 2 | 2, 2 | 1 -> 1 | 1, 1 | 1, 1 | 1, 1 | 0.
    s3 = vsf.NamedSharding(vsf.Mesh((2, 2, 2), ("a", "b", "c")), P(("a", "b", "c")))
    assert [hi - lo for lo, hi in _rows(s3, (7,))] == [1, 1, 1, 1, 1, 1, 1, 0]


def test_uneven_two_dims():
    mesh = vsf.Mesh((2, 3), ("dp", "tp"))
    m = vsf.NamedSharding(mesh, P("dp", "tp")).devices_indices_map((5, 4))
    cols = [(0, 2), (2, 4), (4, 4)]
    want = {dp * 3 + tp: ((lo, hi), cols[tp]) for dp, (lo, hi) in enumerate([(0, 3), (3, 5)]) for tp in range(3)}
    assert {r: _bounds(i, (5, 4)) for r, i in m.items()} == want


def test_uneven_entry_against_mesh_order_is_an_error_naming_dim_axes_and_sizes():
    mesh = vsf.Mesh((2, 3), ("dp", "tp"))
    s = vsf.NamedSharding(mesh, P(None, ("tp", "dp")))
    with pytest.raises(ValueError) as e:
        s.devices_indices_map((4, 9))
    msg = str(e.value)
    for part in ("P(None, ('tp', 'dp'))", "dim 1", "size 9", "6 ways", "tp=3", "dp=2", "('dp', 'tp')"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match="dim 1 of size 9"):
        s.check((4, 9), where="['w']")
    assert s.shard_shape((4, 12)) == (4, 2)  # the same entry over a divisible dim is fine


# -- placements ------------------------------------------------------------------------------


def test_placements_use_strided_shard_only_against_mesh_order():
    mesh = vsf.Mesh((2, 1, 4), ("dp", "pp", "tp"))  # the DeviceMesh has dims (dp, tp)
    assert mesh.device_axes == ("dp", "tp")
    assert vsf.NamedSharding(mesh, P(("dp", "tp"))).placements == (Shard(0), Shard(0))
    assert vsf.NamedSharding(mesh, P(("tp", "pp", "dp"))).placements == (StridedShard(0, split_factor=4), Shard(0))
    assert vsf.NamedSharding(mesh, P(None, "tp", unreduced=("dp",))).placements == (Partial(), Shard(1))
    assert vsf.NamedSharding(mesh, P("pp")).placements == (Replicate(), Replicate())


# -- scale: a 1024-rank 5D mesh, planning only ------------------------------------------------


def _scale_coordinate(r: int) -> dict[str, int]:
    return {"pp": r // 256, "dp": r // 32 % 8, "fsdp": r // 4 % 8, "cp": r // 2 % 2, "tp": r % 2}


def test_1024_rank_5d_mesh_layout_and_placements(sim):
    sim(1024, compute=False)
    mesh = vsf.make_mesh(SCALE_SIZES, SCALE_NAMES)
    assert mesh.shape == dict(zip(SCALE_NAMES, SCALE_SIZES)) and mesh.size == 1024
    s = vsf.NamedSharding(mesh, P(("tp", "dp"), "fsdp", None, "pp"))
    shape = (64, 24, 3, 10)
    assert s.placements == (Shard(3), StridedShard(0, split_factor=2), Shard(1), Replicate(), Shard(0))
    m = s.devices_indices_map(shape)
    assert sorted(m) == list(range(1024))
    pp_rows = [(0, 3), (3, 6), (6, 9), (9, 10)]  # torch.chunk(10, 4)
    for r in (0, 1, 2, 5, 37, 333, 514, 1023):
        c = _scale_coordinate(r)
        row0 = (c["tp"] * 8 + c["dp"]) * 4  # (tp, dp) split 16 ways, tp major
        want = ((row0, row0 + 4), (c["fsdp"] * 3, c["fsdp"] * 3 + 3), (0, 3), pp_rows[c["pp"]])
        assert _bounds(m[r], shape) == want, r
        assert mesh.coordinate(r) == c
        assert s.shard_shape(shape, r) == tuple(hi - lo for lo, hi in want)
    assert s.shard_shape(shape) == (4, 3, 3, 3)
    assert sum(math.prod(s.shard_shape(shape, r)) for r in range(1024)) == math.prod(shape) * 2  # cp replicates


def test_1024_rank_device_put_reports_rank0_shard(sim):
    sim(1024, compute=False)
    mesh = vsf.make_mesh(SCALE_SIZES, SCALE_NAMES)
    x = vsf.device_put(torch.empty(64, 24), vsf.NamedSharding(mesh, P(("dp", "fsdp"), "tp")))
    assert vsf.typeof(x) == "f32[64@(dp,fsdp),24@tp]"
    assert tuple(x.to_local().shape) == (1, 12)
    assert vsf.sharding.sharding_of(x) == vsf.NamedSharding(mesh, P(("dp", "fsdp"), "tp"))
    with pytest.raises(RuntimeError, match="planning-only"):
        vsf.device_get(x)
