"""vsf.ops over NCCL (tier 4): the gloo worker's cases on CUDA tensors, where ragged all-gather
and reduce-scatter take the padded route. Needs one GPU per rank; skipped without them."""

from __future__ import annotations

import pytest
import torch

from multiproc import launch_once
from workers.ops_oracles import collective_cases

NPROC = 4
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < NPROC, reason=f"needs {NPROC} CUDA devices (NCCL runs one rank per GPU)"),
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch_once(tmp_path_factory, "ops_collectives.py", NPROC, "cuda")


@pytest.mark.parametrize("name", [c.name for c in collective_cases(2)])
def test_collective_matches_oracle_on_nccl(reports, name):
    for rank, report in enumerate(reports):
        assert report["cases"][name] == {"value": True, "grad": True}, f"rank {rank}"
