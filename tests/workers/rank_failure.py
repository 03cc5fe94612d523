"""Tier-3 worker for tests/e2e/test_rank_failure.py: one of 2 ranks training a small jitted
data-parallel step in a loop, each step followed by an all-reduce on a group created after the
mesh (as the meshes' axes and the checkpoint group are), until the test stops a rank.

Rank 1 stops itself (SIGSTOP) between the step and the all-reduce once ``OUT/stop`` exists, so
rank 0 waits in the later group's collective; a rank killed from outside dies anywhere in a step.
Each rank writes ``OUT/ready.rank{r}`` after its first step; a rank whose collective fails writes
``OUT/failed.rank{r}`` (the error) and exits 3.

Usage (the environment torchrun gives a worker, and VSF_COLLECTIVE_TIMEOUT): rank_failure.py OUT
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import vsf
from vsf import P

out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
mesh = vsf.make_mesh((2,), ("dp",))
later = dist.new_group([0, 1])
w = vsf.device_put(torch.zeros(16, 16), vsf.NamedSharding(mesh, P()))
x = vsf.make_array_from_process_local_data(
    vsf.NamedSharding(mesh, P("dp")), torch.randn(32, 16, generator=torch.Generator().manual_seed(rank))
)
step = vsf.jit(lambda w, x: w - 0.01 * vsf.grad(lambda w: ((x @ w) ** 2).mean())(w))
try:
    for i in range(100_000):
        w = step(w, x)
        if i == 0:
            (out / f"ready.rank{rank}").write_text("")
        if rank == 1 and (out / "stop").exists():
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(1), group=later)
except Exception as e:  # noqa: BLE001  (what the test checks)
    (out / f"failed.rank{rank}").write_text(f"{time.time()}\n{type(e).__name__}: {e}")
    os._exit(3)
