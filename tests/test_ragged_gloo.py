"""RaggedShard on 4 real gloo processes (tier 3), one torchrun launch: reshard and device_put
round trips, Muon on ragged params, the grouped all-gather."""

from __future__ import annotations

import pytest

from multiproc import launch_once

pytestmark = pytest.mark.multiprocess
NPROC = 4


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch_once(tmp_path_factory, "ops_ragged.py", NPROC)


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_round_trips_are_exact(reports, mesh):
    for rank, report in enumerate(reports):
        assert report[mesh]["cases"] == 40
        assert report[mesh]["failures"] == [], f"rank {rank}: {report[mesh]['failures'][:5]}"


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_device_put_round_trips_are_exact(reports, mesh):
    for rank, report in enumerate(reports):
        assert report[mesh]["put_cases"] == 16
        assert report[mesh]["put_failures"] == [], f"rank {rank}: {report[mesh]['put_failures'][:5]}"


def test_muon_on_ragged_params_equals_one_device_and_each_matrix_runs_on_one_rank(reports):
    everywhere = []
    for rank, report in enumerate(reports):
        assert all(report["muon"]["equal"].values()), (rank, report["muon"]["equal"])
        assert all(r == rank for r, _ in report["muon"]["orthogonalized"])   # a process reports only itself
        everywhere += [tuple(x) for x in report["muon"]["orthogonalized"]]
    by_leaf = {path: {r for r, p in everywhere if p == path} for _, path in everywhere}
    assert sorted(by_leaf) == ["a", "c", "d", "e"] and all(len(ranks) == 1 for ranks in by_leaf.values())
    assert len(everywhere) == 4 * 3   # 4 matrices x 3 steps, each once


def test_gather_group_is_one_collective(reports):
    for report in reports:
        assert report["muon"]["gather_exact"] and report["muon"]["gather_collectives"] == 1
