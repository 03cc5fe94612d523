"""vsf.jit on 4 real gloo processes (tier 3): each rank runs the traced program over its local shards."""

from __future__ import annotations

import pytest
import torch

from multiproc import launch_once

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launch_once(tmp_path_factory, "jit_step.py", 4)


def test_traced_step_matches_unsharded_on_every_rank(ranks):
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["want_losses"]), rtol=1e-5, atol=0)
        assert r["max_param_err"] < 1e-5
        assert r["plan_count"] == 1


def test_traced_program_runs_the_planned_collectives(ranks):
    for r in ranks:
        assert r["traced_ops"] > 0
        assert r["collectives_in_program"] == r["planned_collectives"]


def test_donated_state_buffers_are_updated_in_place(ranks):
    # the optimizer state and the params are donated: the traced program writes every new leaf
    # (the count, the moments, each param after its last read) into the buffer of the leaf it replaces
    for r in ranks:
        assert r["state_buffers_reused"] == [r["state_leaves"]] * 3
        assert r["param_buffers_reused"] == [r["param_leaves"]] * 3
