"""Kill a checkpoint writer process at many points and check what it leaves behind.

Usage: ckpt_crash_writer.py OUT SEED. One process (no process group) commits step 0, then forks a
writer child per round; the child saves steps start, start+1, ... with a CheckpointManager (max_to_keep=3,
alternating blocking and background saves) until it is SIGKILLed: by itself at a chosen point
(after its first data bytes, after half a save's bytes, right before the commit rename, between
a commit and the pruning of old steps, right after the K-th pruning) or by the parent after a random
delay. After each kill the parent checks that every listed step
loads with exactly the values that step saved, that interrupted saves are not listed and cannot
be loaded, and that the next round resumes from the latest committed step. Writes OUT/result.json.
"""

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

import vsf
from vsf.checkpoint import commit, storage

out, seed = Path(sys.argv[1]), int(sys.argv[2])
mngr = vsf.checkpoint.CheckpointManager(out / "run", max_to_keep=3)
N = 1 << 21  # 8 MB per float32 tensor: a save takes long enough to be interrupted


def tree(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(N, generator=g), "m": [torch.randn(N // 2, generator=g), torch.arange(step)], "step": step}


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(plan: str) -> None:
    """In the child: make a save die at ``plan`` (``random`` is left to the parent)."""
    if plan.startswith("bytes:"):
        limit, write = int(plan.split(":")[1]), storage._ChecksumStream.write
        written = [0]

        def write_then_maybe_die(self, b):
            n = write(self, b)
            written[0] += n
            if written[0] >= limit:
                die()
            return n

        storage._ChecksumStream.write = write_then_maybe_die
    elif plan == "before_rename":
        publish = commit.publish

        def publish_but_die(staging, final, marker):
            commit._write_synced(staging / "COMMITTED", marker)  # the marker is in place, the rename never happens
            die()
            publish(staging, final, marker)

        commit.publish = publish_but_die
    elif plan == "before_prune":
        vsf.checkpoint.CheckpointManager._prune = lambda self, just_saved: die()
    elif plan.startswith("after_prune:"):
        prune, left = vsf.checkpoint.CheckpointManager._prune, [int(plan.split(":")[1])]

        def prune_around_death(self, just_saved):
            prune(self, just_saved)
            left[0] -= 1
            if left[0] == 0:
                die()

        vsf.checkpoint.CheckpointManager._prune = prune_around_death


def writer(start: int, plan: str) -> None:
    arm(plan)
    step = start
    while True:
        mngr.save(step, tree(step), blocking=step % 2 == 0)
        mngr.wait()
        step += 1


def check() -> dict:
    steps = mngr.all_steps()
    hidden = sorted(p.name for p in (out / "run").iterdir() if p.name.startswith("."))
    bad = [s for s in steps if not _equal(mngr.restore(s), tree(s))]
    unlisted = [name for name in hidden if ".tmp-" in name and not (out / "run" / name / "COMMITTED").exists()]
    refused = 0
    for name in unlisted:
        try:
            vsf.checkpoint.load(out / "run" / name)
        except vsf.checkpoint.NotACheckpointError:
            refused += 1
    return {"steps": steps, "hidden": hidden, "bad_steps": bad, "unlisted_refused": refused == len(unlisted)}


def _equal(a, b) -> bool:
    return vsf.tree.structure(a) == vsf.tree.structure(b) and all(
        torch.equal(x, y) if isinstance(y, torch.Tensor) else x == y
        for x, y in zip(vsf.tree.leaves(a), vsf.tree.leaves(b))
    )


PLANS = [
    "bytes:1",
    f"bytes:{N * 3}",
    "before_rename",
    "random",
    "after_prune:3",
    "before_prune",
    "after_prune:1",
    "random",
    "random",
]
rng = random.Random(seed)
mngr.save(0, tree(0))
rounds = []
for plan in PLANS:
    start = (mngr.latest_step() or 0) + 1
    child = os.fork()
    if child == 0:
        writer(start, plan)
    delay = rng.uniform(0.05, 0.8) if plan == "random" else None
    if delay is not None:
        time.sleep(delay)
        os.kill(child, signal.SIGKILL)
    _, status = os.waitpid(child, 0)
    rounds.append(
        {
            "plan": plan,
            "start": start,
            "delay": delay,
            "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
            **check(),
        }
    )
(out / "result.json").write_text(json.dumps(rounds, indent=1))
