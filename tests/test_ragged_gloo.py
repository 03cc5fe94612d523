"""RaggedShard redistributions on 4 real gloo processes (tier 3), one torchrun launch."""

from __future__ import annotations

import pytest

from multiproc import WORKERS, results, torchrun

pytestmark = pytest.mark.multiprocess
NPROC = 4


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("ragged_gloo")
    torchrun(WORKERS / "ops_ragged.py", NPROC, str(out))
    return results(out, NPROC)


@pytest.mark.parametrize("mesh", ["1d", "2d"])
def test_round_trips_are_exact(reports, mesh):
    for rank, report in enumerate(reports):
        assert report[mesh]["cases"] == 40
        assert report[mesh]["failures"] == [], f"rank {rank}: {report[mesh]['failures'][:5]}"
