"""Mesh, NamedSharding as values; make_mesh, use_mesh, simulate; sub-meshes by name."""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import vsf
from layout_oracle import expected_shard
from vsf import P

NAMES = ("pp", "dp", "fsdp", "cp", "tp")


@st.composite
def meshes(draw):
    k = draw(st.integers(1, 5))
    sizes = tuple(draw(st.lists(st.integers(1, 3), min_size=k, max_size=k)))
    names = tuple(draw(st.permutations(NAMES))[:k])
    devices = draw(st.none() | st.permutations(range(math.prod(sizes))))
    return vsf.Mesh(sizes, names, device_type=draw(st.sampled_from(["cpu", "cuda"])), devices=devices)


@given(meshes())
def test_mesh_is_a_value(mesh):
    assert eval(repr(mesh), vars(vsf)) == mesh and hash(eval(repr(mesh), vars(vsf))) == hash(mesh)
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    with pytest.raises(AttributeError, match="immutable"):
        mesh._sizes = (1,)
    grid = np.array(mesh.devices).reshape(mesh.axis_sizes)
    for pos in np.ndindex(*mesh.axis_sizes):
        assert mesh.coordinate(int(grid[pos])) == dict(zip(mesh.axis_names, pos))


@given(meshes(), st.sampled_from([P(), P("dp"), P(("tp", "pp"), None), P(None, "fsdp", unreduced="cp")]))
def test_named_sharding_is_a_value(mesh, spec):
    if not set(spec.axes) <= set(mesh.axis_names):
        with pytest.raises(ValueError, match="not in the mesh"):
            vsf.NamedSharding(mesh, spec)
        return
    s = vsf.NamedSharding(mesh, spec)
    assert eval(repr(s), vars(vsf)) == s and hash(eval(repr(s), vars(vsf))) == hash(s)
    assert pickle.loads(pickle.dumps(s)) == s
    assert s == vsf.NamedSharding(mesh, P(*spec, None, unreduced=spec.unreduced))  # trailing None is no change
    assert {s: 1}[vsf.NamedSharding(mesh, P(*spec, None, unreduced=spec.unreduced))] == 1
    with pytest.raises(AttributeError, match="immutable"):
        s._spec = P()
    assert s.is_fully_replicated == all(mesh.axis_size(a) == 1 for a in spec.axes)


def test_mesh_properties_and_hand_computed_coordinates():
    mesh = vsf.Mesh((1, 2, 2, 1, 2), NAMES)
    assert mesh.shape == {"pp": 1, "dp": 2, "fsdp": 2, "cp": 1, "tp": 2}
    assert list(mesh.shape) == list(NAMES)  # ordered
    assert mesh.axis_names == NAMES and mesh.axis_sizes == (1, 2, 2, 1, 2) and mesh.size == 8
    assert mesh.devices == tuple(range(8)) and mesh.axis_size("tp") == 2 and mesh.axis_index("fsdp") == 2
    assert mesh.coordinate(6) == {"pp": 0, "dp": 1, "fsdp": 1, "cp": 0, "tp": 0}
    assert mesh.device_axes == ("dp", "fsdp", "tp")  # size-1 axes have no DeviceMesh dim
    shuffled = vsf.Mesh((2, 2), ("tp", "dp"), devices=(3, 1, 2, 0))
    assert shuffled.coordinate(1) == {"tp": 0, "dp": 1} and shuffled.coordinate(2) == {"tp": 1, "dp": 0}
    assert "devices=(3, 1, 2, 0)" in repr(shuffled)
    with pytest.raises(ValueError, match=r"rank 9 is not in Mesh\(\(2, 2\)"):
        shuffled.coordinate(9)


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (((2, 2), ("dp",)), {}, ValueError, r"2 axis sizes \(2, 2\) but 1 axis names \('dp',\)"),
        (((2, 2), ("dp", "dp")), {}, ValueError, "axis names must be distinct"),
        (((2, 0), ("dp", "tp")), {}, ValueError, r"sizes must be positive integers, got \(2, 0\)"),
        (((2,), (3,)), {}, TypeError, "axis names must be non-empty strings"),
        (((), ()), {}, ValueError, "at least one axis"),
        (((2, 2), ("dp", "tp")), {"devices": (0, 1, 2, 2)}, ValueError, "needs 4 distinct non-negative ranks"),
    ],
)
def test_bad_meshes(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        vsf.Mesh(*args, **kwargs)


def test_unknown_axis_names_the_mesh_axes_and_sizes():
    mesh = vsf.Mesh((2, 4), ("dp", "tp"))
    with pytest.raises(
        ValueError, match=r"P\('dp', 'ep'\) names mesh axis 'ep', which is not in the mesh \{'dp': 2, 'tp': 4\}"
    ):
        vsf.NamedSharding(mesh, P("dp", "ep"))
    with pytest.raises(ValueError, match=r"unknown mesh axis 'ep'; the mesh has axes \{'dp': 2, 'tp': 4\}"):
        mesh.axis_size("ep")
    with pytest.raises(TypeError, match="needs a vsf.P spec"):
        vsf.NamedSharding(mesh, ("dp",))
    with pytest.raises(TypeError, match="needs a vsf.Mesh"):
        vsf.NamedSharding((2, 4), P())


def test_named_sharding_tree():
    mesh = vsf.Mesh((2, 4), ("dp", "tp"))
    got = vsf.NamedSharding.tree(mesh, {"w": P("dp", "tp"), "b": [P(), None]})
    assert got == {"w": vsf.NamedSharding(mesh, P("dp", "tp")), "b": [vsf.NamedSharding(mesh, P()), None]}


# -- make_mesh and simulate -----------------------------------------------------------------------


def test_make_mesh_under_simulation(sim):
    sim(8)
    mesh = vsf.make_mesh((1, 2, 2, 1, 2), NAMES)
    assert mesh == vsf.Mesh((1, 2, 2, 1, 2), NAMES, device_type="cpu")
    assert mesh.device_mesh.mesh_dim_names == ("dp", "fsdp", "tp")  # no communicator for size-1 axes
    assert mesh.device_mesh.mesh.tolist() == np.arange(8).reshape(2, 2, 2).tolist()
    assert vsf.make_mesh((1, 2, 2, 1, 2), NAMES).device_mesh is mesh.device_mesh  # built once


def test_mesh_size_must_equal_world_size(sim):
    sim(8)
    with pytest.raises(ValueError) as e:
        vsf.make_mesh((2, 2), ("dp", "tp"))
    msg = str(e.value)
    for part in ("{'dp': 2, 'tp': 2}", "has 4 ranks", "this run has 8", "--nproc-per-node 4", "vsf.simulate(4)"):
        assert part in msg, (part, msg)


def test_simulate_start_stop_and_misuse():
    s = vsf.simulate(4)
    assert repr(s) == "simulate(4, compute=True)" and not vsf.runtime.is_simulated()
    assert s.start() is s
    try:
        assert vsf.runtime.is_simulated() and vsf.runtime.world_size() == 4 and vsf.runtime.rank() == 0
        with pytest.raises(
            RuntimeError, match=r"cannot start simulate\(2, compute=False\).*inside simulate\(4, compute=True\)"
        ):
            vsf.simulate(2, compute=False).start()
        with pytest.raises(RuntimeError, match=r"simulate\(8, compute=True\) is not the running simulation"):
            vsf.simulate(8).stop()
    finally:
        s.stop()
    assert not vsf.runtime.is_simulated() and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="is not the running simulation"):
        s.stop()
    with vsf.simulate(2, compute=False) as again:
        assert again.compute is False and vsf.runtime.world_size() == 2
    for bad in (0, -1, 2.0, "4"):
        with pytest.raises(ValueError, match="positive number of ranks"):
            vsf.simulate(bad)


def test_meshes_from_a_stopped_simulation_are_forgotten():
    def run() -> tuple:
        mesh = vsf.make_mesh((1, 2, 2), ("pp", "dp", "tp"))
        x = vsf.device_put(torch.ones(4), vsf.NamedSharding(mesh, P("tp")))
        return mesh.device_mesh, torch.zeros_like(x).device_mesh, vsf.sharding.sharding_of(x * 2).mesh

    with vsf.simulate(4):
        first, _, _ = run()
    with vsf.simulate(4):
        again, op_result, mesh = run()
    assert again is not first
    # DTensor caches an op's output sharding by value: it must not hand back the old, equal DeviceMesh
    # (whose Mesh vsf no longer knows: it would come back as a foreign ('dp', 'tp') mesh)
    assert op_result is again and mesh == vsf.Mesh((1, 2, 2), ("pp", "dp", "tp"))


# -- use_mesh ---------------------------------------------------------------------------------------


def test_use_mesh_nests_and_restores():
    outer, inner = vsf.Mesh((2,), ("dp",)), vsf.Mesh((4,), ("tp",))
    assert vsf.sharding.current_mesh() is None
    with vsf.use_mesh(outer) as m:
        assert m is outer and vsf.sharding.current_mesh() is outer
        with pytest.raises(KeyError):
            with vsf.use_mesh(inner):
                assert vsf.sharding.current_mesh() is inner
                raise KeyError("boom")
        assert vsf.sharding.current_mesh() is outer
    assert vsf.sharding.current_mesh() is None
    with pytest.raises(TypeError, match="use_mesh expects a vsf.Mesh, got tuple"):
        with vsf.use_mesh((2,)):
            pass


# -- sub-meshes -------------------------------------------------------------------------------------


def test_sub_mesh_in_any_order_holds_the_ranks_of_rank0(sim):
    sim(8)
    mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))  # rank = 4 dp + 2 fsdp + tp
    assert mesh["tp", "dp"] == vsf.Mesh((2, 2), ("tp", "dp"), devices=(0, 4, 1, 5))
    assert mesh["dp", "tp"] == vsf.Mesh((2, 2), ("dp", "tp"), devices=(0, 1, 4, 5))
    assert mesh["fsdp"] == vsf.Mesh((2,), ("fsdp",), devices=(0, 2))
    assert mesh["tp", "fsdp", "dp"].devices == (0, 4, 2, 6, 1, 5, 3, 7)
    with pytest.raises(ValueError, match=r"unknown mesh axis 'ep'; the mesh has axes \{'dp': 2, 'fsdp': 2, 'tp': 2\}"):
        mesh["ep"]
    with pytest.raises(ValueError, match="sub-mesh axes must be distinct"):
        mesh["tp", "tp"]


@pytest.mark.parametrize("spec", [P("tp", "dp"), P(("tp", "dp")), P(("dp", "tp"), None), P(None, "dp", unreduced="tp")])
def test_device_put_on_a_sub_mesh_under_simulation(sim, spec):
    sim(8)
    mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    sub = mesh["tp", "dp"]
    full = torch.arange(24.0).reshape(4, 6)
    x = vsf.device_put(full, vsf.NamedSharding(sub, spec))
    shards = vsf.debug.shards(x)
    assert [s.rank for s in shards] == list(range(8))  # every simulated rank holds its own copy's piece
    for s in shards:
        position = (s.rank % 2) * 2 + s.rank // 4  # the rank's place in its copy of the (tp, dp) sub-mesh
        want = expected_shard(full, (2, 2), ("tp", "dp"), tuple(spec), position, spec.unreduced)
        assert torch.equal(s.data, want), (s.rank, spec)
    assert torch.equal(vsf.device_get(x), full)


def test_sub_mesh_of_size_one_axes_under_simulation(sim):
    sim(8)
    mesh = vsf.make_mesh((1, 2, 2, 1, 2), NAMES)
    sub = mesh["cp", "pp"]
    assert sub == vsf.Mesh((1, 1), ("cp", "pp"))
    full = torch.arange(6.0)
    x = vsf.device_put(full, vsf.NamedSharding(sub, P("cp")))
    assert [s.rank for s in vsf.debug.shards(x)] == list(range(8))
    assert all(torch.equal(s.data, full) for s in vsf.debug.shards(x))
    assert torch.equal(vsf.device_get(x), full)


def test_named_sharding_tree_errors_name_the_key_path():
    mesh = vsf.Mesh((2, 4), ("dp", "tp"))
    with pytest.raises(
        ValueError,
        match=r"the spec at \['b'\]\[0\]: P\('ep'\) names mesh axis 'ep', which is not in the mesh \{'dp': 2, 'tp': 4\}",
    ):
        vsf.NamedSharding.tree(mesh, {"w": P("dp"), "b": [P("ep")]})
    with pytest.raises(TypeError, match=r"the spec at \['w'\]\[0\] is 'dp', not a vsf.P"):
        vsf.NamedSharding.tree(mesh, {"w": ("dp",)})


EXIT_SCRIPT = """
import atexit, json, os, sys
import torch, torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard
import vsf

def threads():
    return len(os.listdir("/proc/self/task"))

torch.ones(2) + 1
before = threads()
mesh = vsf.make_mesh((1, 1), ("dp", "tp"), device_type="cpu")
x = vsf.device_put(torch.ones(4), vsf.NamedSharding(mesh, vsf.P("dp")))
(x * 2).full_tensor()
x.redistribute(x.device_mesh, [Shard(0)] * x.device_mesh.ndim).redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)  # DTensor caches these plans
during = threads()
del x, mesh
if sys.argv[1] == "user_destroys":
    dist.destroy_process_group()
atexit._run_exitfuncs()
import gc
from torch.distributed.device_mesh import DeviceMesh
alive = sum(isinstance(o, DeviceMesh) for o in gc.get_objects())  # what holds a mesh's sub-groups
print(json.dumps([before, during, threads(), dist.is_initialized(), alive]))
"""


@pytest.mark.parametrize("how", ["left_to_vsf", "user_destroys"])
def test_process_groups_are_freed_before_interpreter_exit(how):
    """A group's worker threads are joined only when the group is freed; left to interpreter
    finalisation, a gloo thread releasing a finished collective's tensors aborts the process. The
    exit hook frees them (the sub-groups vsf's cached DeviceMeshes and DTensor's redistribution
    plans hold too) while Python runs."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, how], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    before, during, after, initialized, device_meshes = json.loads(out.stdout.splitlines()[-1])
    assert during > before  # the default group and the mesh's two sub-groups have threads
    assert after == before and not initialized and device_meshes == 0
