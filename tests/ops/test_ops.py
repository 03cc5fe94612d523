"""vsf.ops collectives: values and gradients against hand-written oracles, on simulated ranks, on
4 real gloo processes (tier 3, ``multiprocess``) and over NCCL (tier 4, ``cuda``).

The cases and their oracles (plain-torch definitions on every member's tensor, gradients by
torch.autograd) live in ``workers/ops_oracles.py``, shared with the gloo worker.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from workers.ops_oracles import (
    all_gather_v_case,
    all_to_all_v_case,
    as_local,
    check_simulated,
    collective_cases,
    groups,
    per_rank,
    reduce_scatter_v_case,
)

import vsf
from vsf import _compat
from vsf.ops import backend
from multiproc import launch_once

SIZES = {"a": 2, "b": 3}
CASES = {c.name: c for c in collective_cases(SIZES["b"])}


@pytest.fixture
def mesh(sim):
    sim(6)
    m = vsf.make_mesh(tuple(SIZES.values()), tuple(SIZES))
    with vsf.use_mesh(m):
        yield m


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.ragged])
def test_collective(mesh, name):
    check_simulated(CASES[name], mesh)


@pytest.fixture(params=["exact", "padded"])
def route(request, monkeypatch):
    """Run the ragged collectives on gloo's exact route and on NCCL's padded route."""
    monkeypatch.setattr(backend.AxisGroup, "pads_ragged", property(lambda g: request.param == "padded"))
    return request.param


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.ragged])
def test_ragged_collective(mesh, route, name):
    check_simulated(CASES[name], mesh)


sizes3 = st.lists(st.integers(0, 3), min_size=3, max_size=3)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(st.lists(sizes3, min_size=3, max_size=3), sizes3, st.integers(0, 1), st.sampled_from(["exact", "padded"]))
def test_random_ragged_sizes(counts, sizes, dim, route):
    with vsf.simulate(6):
        m = vsf.make_mesh(tuple(SIZES.values()), tuple(SIZES))
        with vsf.use_mesh(m), pytest.MonkeyPatch.context() as patch:
            patch.setattr(backend.AxisGroup, "pads_ragged", property(lambda g: route == "padded"))
            for case in (all_to_all_v_case(counts), all_gather_v_case(sizes, dim), reduce_scatter_v_case(sizes, dim)):
                check_simulated(case, m)


def test_size_one_axes_are_identities(sim):
    sim(2)
    m = vsf.make_mesh((1, 2), ("pp", "dp"))
    x = torch.randn(3, 2)
    assert vsf.ops.psum(x, "pp", mesh=m) is x
    assert vsf.ops.all_gather(x, "pp", mesh=m) is x
    assert vsf.ops.all_gather_v(x, "pp", (3,), mesh=m) is x
    assert vsf.ops.ppermute(x, "pp", [(0, 0)], mesh=m) is x


def test_planning_only_simulation_gives_shapes(sim):
    sim(4, compute=False)
    m = vsf.make_mesh((4,), ("fsdp",))
    assert vsf.ops.all_gather(torch.ones(2, 3), "fsdp", 1, mesh=m).shape == (2, 12)
    assert vsf.ops.psum_scatter(torch.ones(8, 3), "fsdp", mesh=m).shape == (2, 3)
    assert vsf.ops.all_gather_v(torch.ones(2, 3), "fsdp", (2, 2, 1, 1), mesh=m).shape == (6, 3)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x: vsf.ops.all_gather_v(x, "b", (1, 2)), "needs 3 non-negative sizes"),
        (lambda x: vsf.ops.all_gather_v(x, "b", (1, -1, 2)), "needs 3 non-negative sizes"),
        (lambda x: vsf.ops.all_gather_v(x, "b", (2, 2, 1)), "member 2 should hold 1 rows"),
        (lambda x: vsf.ops.reduce_scatter_v(x, "b", (1, 1, 2)), "should hold 4 rows"),
        (lambda x: vsf.ops.all_to_all_v(x, "b", [[1, 1, 1]] * 3), "must send 3 rows"),
        (lambda x: vsf.ops.ppermute(x, "b", [(0, 1), (1, 1)]), "distinct sources and destinations"),
        (lambda x: vsf.ops.all_to_all(x, ("a", "b"), 0, 0), "runs over one mesh axis"),
        (lambda x: vsf.ops.all_to_all(x, "b", 0, 1), "not divisible by 3"),
        (lambda x: vsf.ops.psum(x, "zz"), "unknown mesh axis 'zz'"),
    ],
)
def test_bad_input(mesh, call, message):
    with pytest.raises(ValueError, match=message):
        call(as_local({r: torch.ones(2, 2) for r in mesh.devices}))


def test_needs_a_mesh(sim):
    sim(2)
    vsf.make_mesh((2,), ("dp",))
    with pytest.raises(ValueError, match="needs a mesh"):
        vsf.ops.psum(torch.ones(2), "dp")


def test_every_transpose_is_an_adjoint(mesh):
    """<op(x), w> == <x, op^T(w)> summed over ranks, for each op's backward (second-order check)."""
    with _compat.local_mode_disabled():
        x = as_local({r: torch.randn(6, 3) for r in mesh.devices})
    for op in (lambda t: vsf.ops.all_to_all(t, "b", 0, 1), lambda t: vsf.ops.psum_scatter(t, ("a", "b"))):
        x_ = x.detach().requires_grad_()
        y = op(x_)
        with _compat.local_mode_disabled():
            w = as_local({r: torch.randn(v.shape) for r, v in per_rank(y).items()}).requires_grad_()
        (g,) = torch.autograd.grad((y * w).sum(), x_, create_graph=True)
        lhs = sum(v.sum() for v in per_rank(y.detach() * w.detach()).values())
        rhs = sum(v.sum() for v in per_rank(x.detach() * g.detach()).values())
        torch.testing.assert_close(lhs, rhs)
        (gg,) = torch.autograd.grad((g * x).sum(), w)  # d<x, op^T(w)>/dw = op(x)
        for r, v in per_rank(gg).items():
            torch.testing.assert_close(v, per_rank(y)[r])


def test_groups_helper_matches_mesh_layout(mesh):
    # the oracle's notion of a group (same coordinates off the axes, ordered major to minor)
    assert groups(mesh, ("b",)) == [[0, 1, 2], [3, 4, 5]]
    assert groups(mesh, ("b", "a")) == [[0, 3, 1, 4, 2, 5]]
    assert groups(mesh, ("a",)) == [[0, 3], [1, 4], [2, 5]]


def test_under_simulation_a_sub_mesh_sums_in_each_ranks_own_copy(mesh):
    """``mesh["b"]`` holds rank 0's group; every other simulated rank computes in its own copy (a
    pipeline stage's collectives run so): the sums of the groups {0, 1, 2} and {3, 4, 5}."""
    y = vsf.ops.psum(as_local({r: torch.full((2,), float(r)) for r in mesh.devices}), "b", mesh=mesh["b"])
    assert {r: v.tolist() for r, v in per_rank(y).items()} == {
        r: [3.0, 3.0] if r < 3 else [12.0, 12.0] for r in range(6)
    }


def test_simulation_needs_a_mesh_every_rank_has_a_copy_of(mesh):
    with pytest.raises(ValueError, match="needs a mesh whose copies hold all 6 ranks"):
        vsf.ops.psum(
            as_local({r: torch.ones(2) for r in mesh.devices}), "b", mesh=vsf.Mesh((3,), ("b",), devices=(0, 1, 2))
        )


# -- on 4 real gloo processes ------------------------------------------------------------------
# vsf.ops on 4 real gloo processes (tier 3): one torchrun launch checks every case and the
# bytes a ragged all-gather puts on the wire.

NPROC = 4


@pytest.fixture(scope="module")
def reports(world):
    return world("ops_collectives.py")


@pytest.mark.world("ops_collectives.py")
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [c.name for c in collective_cases(2)])
def test_collective_matches_oracle(reports, name):
    for rank, report in enumerate(reports):
        assert report["cases"][name] == {"value": True, "grad": True}, f"rank {rank}"


@pytest.mark.world("ops_collectives.py")
@pytest.mark.multiprocess
def test_shard_map_equals_one_device_with_gradients(reports):
    for rank, report in enumerate(reports):
        assert report["shard_map"] == {"value": True, "grad": True}, f"rank {rank}"


# gloo's framing adds a few hundred bytes to each collective, whatever its size
FRAMING = 2048


@pytest.mark.world("ops_collectives.py")
@pytest.mark.multiprocess
def test_ragged_all_gather_moves_exactly_the_payload(reports):
    for rank, report in enumerate(reports):
        for m in report["bytes"]:
            assert m["correct"], f"rank {rank}, sizes {m['sizes']}: wrong result"
            assert m["handed"] == m["payload"], f"rank {rank}, sizes {m['sizes']}: handed {m['handed']} bytes to gloo"
            assert m["payload"] <= m["wire"] <= m["payload"] + FRAMING, f"rank {rank}, sizes {m['sizes']}: {m}"


@pytest.mark.world("ops_collectives.py")
@pytest.mark.multiprocess
def test_total_traffic_is_what_every_rank_lacks(reports):
    """Summed over ranks, the sockets carried (n-1) * sum(sizes) rows: each rank received the others' rows."""
    for k, m in enumerate(reports[0]["bytes"]):
        total = sum(r["bytes"][k]["wire"] for r in reports)
        payload = (NPROC - 1) * sum(m["sizes"]) * 64 * 4
        assert payload <= total <= payload + NPROC * FRAMING


# -- over NCCL ---------------------------------------------------------------------------------
# vsf.ops over NCCL (tier 4): the gloo worker's cases on CUDA tensors, where ragged all-gather
# and reduce-scatter take the padded route. Needs one GPU per rank; skipped without them.


@pytest.fixture(scope="module")
def nccl_reports(tmp_path_factory):
    return launch_once(tmp_path_factory, "ops_collectives.py", NPROC, "cuda")


@pytest.mark.cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < NPROC, reason=f"needs {NPROC} CUDA devices (NCCL runs one rank per GPU)"
)
@pytest.mark.parametrize("name", [c.name for c in collective_cases(2)])
def test_collective_matches_oracle_on_nccl(nccl_reports, name):
    for rank, report in enumerate(nccl_reports):
        assert report["cases"][name] == {"value": True, "grad": True}, f"rank {rank}"
