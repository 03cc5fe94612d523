"""vsf.optim in real gloo processes (tier 3): ZeRO stage 2 under torchrun equals torch.optim on one device."""

from __future__ import annotations

import pytest
import torch

from multiproc import launch_once
from test_optim import MASK, TOL, run_torch

NPROC = 2
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_once(tmp_path_factory, "optim_zero.py", NPROC)


def test_zero2_under_torchrun_matches_torch(ranks):
    torch.manual_seed(0)  # the worker's seed and draw order
    params = {"w": torch.randn(8, 6), "b": torch.randn(5), "e": torch.randn(4, 4)}
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(5)]
    want = run_torch(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), params, grads, mask=MASK, clip=1.0)
    for r in ranks:
        for k in params:
            torch.testing.assert_close(torch.tensor(r["params"][k]), want[k], **TOL)


def test_each_rank_holds_only_its_state_shard(ranks):
    # mu and nu for w (8x6), b (5, split 3 + 2), e (4x4) over 2 ranks, plus the int32 count
    expected = [4 * 2 * (24 + 3 + 8) + 4, 4 * 2 * (24 + 2 + 8) + 4]
    assert [r["bytes"] for r in ranks] == [{str(i): expected[i]} for i in range(NPROC)]
    assert [len(r["mu_b_local"]) for r in ranks] == [3, 2]
