"""Crash safety: a checkpoint writer SIGKILLed at many points never leaves a loadable half-checkpoint.

One worker process commits step 0, then forks writer children that save steps in a loop with a
CheckpointManager and are killed: after their first data bytes, in the middle of a tensor, right
before the commit rename, right after three commits, between a commit and the pruning of old
steps, right after the next commit's pruning, and three times at random moments. (A rank killed in the middle of a
4-rank save is covered by test_checkpoint.py.) The oracle is the values each step saved,
regenerated from the step number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from multiproc import WORKERS

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    out = tmp_path_factory.mktemp("crash")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run(
        [sys.executable, str(WORKERS / "ckpt_crash_writer.py"), str(out), "0"],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
    )
    return json.loads((out / "result.json").read_text())


def test_every_round_was_a_kill(rounds):
    assert [r["plan"] for r in rounds] == [
        "bytes:1",
        f"bytes:{3 << 21}",
        "before_rename",
        "random",
        "after_prune:3",
        "before_prune",
        "after_prune:1",
        "random",
        "random",
    ]
    assert all(r["killed"] for r in rounds)


def test_listed_steps_always_load_with_the_values_they_saved(rounds):
    for r in rounds:
        assert r["steps"] and r["bad_steps"] == [], r
        # max_to_keep, plus the step committed just before a kill that came ahead of its pruning
        assert len(r["steps"]) <= 3 + 1, r


def test_a_kill_before_pruning_keeps_one_step_too_many_until_the_next_commit(rounds):
    three, before, after = (
        next(r for r in rounds if r["plan"] == p) for p in ("after_prune:3", "before_prune", "after_prune:1")
    )
    assert three["steps"] == [three["start"], three["start"] + 1, three["start"] + 2], three
    assert before["steps"] == three["steps"] + [before["start"]], before
    assert after["steps"] == [after["start"] - 2, after["start"] - 1, after["start"]], after


def test_interrupted_saves_are_never_listed_nor_loaded(rounds):
    for r in rounds[:3]:  # killed inside the first save of the round: nothing new is committed
        assert r["steps"] == [0] and len(r["hidden"]) == 1 and r["hidden"][0].startswith(f".{r['start']}.tmp-"), r
    assert all(r["unlisted_refused"] for r in rounds)


def test_each_round_resumes_from_the_latest_committed_step(rounds):
    for before, after in zip(rounds, rounds[1:]):
        assert after["start"] == before["steps"][-1] + 1
