"""Tier 3: device_put / device_get on 4 real gloo processes under torchrun (a 2x2 mesh).

The worker (tests/workers/put_worker.py) runs once for the module; each test reads what the
ranks reported. Hand-computed expectations: rank = 2 dp + tp.
"""

from __future__ import annotations

import pytest

from multiproc import launch_once

pytestmark = pytest.mark.multiprocess

NPROC = 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_once(tmp_path_factory, "put_worker.py", NPROC)


def _leaf(report, name):
    (leaf,) = [leaf for leaf in report["leaves"] if leaf["name"] == name]
    return leaf


def test_world_and_mesh_coordinates(ranks):
    for r, rep in enumerate(ranks):
        assert (rep["rank"], rep["world"], rep["backend"]) == (r, NPROC, "gloo")
        assert rep["coordinate"] == {"dp": r // 2, "tp": r % 2}


def test_sub_meshes_hold_this_rank(ranks):
    for r, rep in enumerate(ranks):
        assert rep["sub_tp_devices"] == [2 * (r // 2), 2 * (r // 2) + 1]  # this rank's row of the tp axis
        assert rep["sub_tp_dp_devices"] == [0, 2, 1, 3]  # (tp, dp) order: tp major
        assert rep["sub_mesh_local"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]][r % 2]
        assert rep["sub_mesh_round_trip"]


def test_every_local_shard_matches_hand_slicing(ranks):
    for rep in ranks:
        assert len(rep["leaves"]) == 18
        bad = [(leaf["name"], leaf["spec"], leaf["local_shape"], leaf["expected_shape"]) for leaf in rep["leaves"] if not leaf["local_ok"]]
        assert not bad, (rep["rank"], bad)
        assert all(leaf["shard_rank"] == rep["rank"] for leaf in rep["leaves"])


def test_uneven_and_strided_indices_by_hand(ranks):
    rows_dp = [[0, 3], [3, 5]]  # 5 rows over dp: 3 | 2
    rows_dp_tp = [[0, 2], [2, 3], [3, 4], [4, 5]]  # 5 rows over (dp, tp): 2, 1, 1, 1
    for r, rep in enumerate(ranks):
        dp, tp = r // 2, r % 2
        assert _leaf(rep, "uneven_rows")["index"] == [rows_dp[dp], [0, 3]]
        assert _leaf(rep, "uneven_multi_axis")["index"] == [rows_dp_tp[r]]
        block = tp * 2 + dp  # (tp, dp): tp major
        assert _leaf(rep, "strided")["index"] == [[2 * block, 2 * block + 2], [0, 2]]
        assert _leaf(rep, "strided")["typeof"] == "f32[8@(tp,dp),2]"
        assert _leaf(rep, "unreduced")["typeof"] == "f32[4,6@tp]{U:dp}"
        assert _leaf(rep, "empty_dim")["local_shape"] == [0, 2]


def test_round_trip_is_exact(ranks):
    for rep in ranks:
        assert rep["round_trip"] and all(rep["round_trip"].values()), rep["round_trip"]
        assert rep["round_trip_structure"]
        assert rep["resharded"]["local_ok"] and rep["resharded_round_trip"]


def test_mesh_of_the_wrong_size_is_a_clear_error(ranks):
    for rep in ranks:
        msg = rep["wrong_size_error"]
        assert msg is not None
        for part in ("{'x': 2}", "has 2 ranks", "this run has 4", "torchrun --nproc-per-node 2"):
            assert part in msg, (part, msg)
