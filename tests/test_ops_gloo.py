"""vsf.ops on 4 real gloo processes (tier 3): one torchrun launch checks every case and the
bytes a ragged all-gather puts on the wire."""

from __future__ import annotations

import pytest

from multiproc import launch_once
from workers.ops_oracles import collective_cases

pytestmark = pytest.mark.multiprocess
NPROC = 4


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch_once(tmp_path_factory, "ops_collectives.py", NPROC)


@pytest.mark.parametrize("name", [c.name for c in collective_cases(2)])
def test_collective_matches_oracle(reports, name):
    for rank, report in enumerate(reports):
        assert report["cases"][name] == {"value": True, "grad": True}, f"rank {rank}"


def test_shard_map_equals_one_device_with_gradients(reports):
    for rank, report in enumerate(reports):
        assert report["shard_map"] == {"value": True, "grad": True}, f"rank {rank}"


# gloo's framing adds a few hundred bytes to each collective, whatever its size
FRAMING = 2048


def test_ragged_all_gather_moves_exactly_the_payload(reports):
    for rank, report in enumerate(reports):
        for m in report["bytes"]:
            assert m["correct"], f"rank {rank}, sizes {m['sizes']}: wrong result"
            assert m["handed"] == m["payload"], f"rank {rank}, sizes {m['sizes']}: handed {m['handed']} bytes to gloo"
            assert m["payload"] <= m["wire"] <= m["payload"] + FRAMING, f"rank {rank}, sizes {m['sizes']}: {m}"


def test_total_traffic_is_what_every_rank_lacks(reports):
    """Summed over ranks, the sockets carried (n-1) * sum(sizes) rows: each rank received the others' rows."""
    for k, m in enumerate(reports[0]["bytes"]):
        total = sum(r["bytes"][k]["wire"] for r in reports)
        payload = (NPROC - 1) * sum(m["sizes"]) * 64 * 4
        assert payload <= total <= payload + NPROC * FRAMING
