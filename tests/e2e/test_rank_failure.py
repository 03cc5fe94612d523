"""A rank that dies or stops does not hold the others: 2 real gloo processes train a jitted step
in a loop (``tests/workers/rank_failure.py``), started with the environment ``torchrun`` gives its
workers but without its agent (which would stop the survivor itself), with
``vsf.config.collective_timeout`` set to 3 s through ``vsf.launch.environment``.

* SIGKILL of rank 1 mid-step: rank 0's collective fails at once (the connection closes).
* SIGSTOP of rank 1 (alive, silent) before a collective on a group created after the mesh: rank
  0 raises after the timeout, not torch's default of 30 minutes for such groups.

Both launches run side by side (tier 3, ``multiprocess``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vsf import launch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "workers" / "rank_failure.py"
TIMEOUT = 3.0


class Pair:
    """The worker on 2 processes writing into ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        env = launch.environment(collective_timeout=TIMEOUT)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(launch.free_port()),
            WORLD_SIZE="2",
            PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        )
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out)],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]

    def wait_ready(self, deadline: float) -> None:
        while not all((self.out / f"ready.rank{r}").exists() for r in range(2)):
            failed = [p.poll() for p in self.procs if p.poll() is not None]
            if failed or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the workers did not start ({failed}):\n" + "\n".join(p.stderr.read()[-3000:] for p in self.procs)
                )
            time.sleep(0.05)

    def survivor(self, since: float) -> tuple[float, str]:
        """Seconds until rank 0 exited, and the error it reported."""
        self.procs[0].wait(timeout=120)
        seconds = time.monotonic() - since
        assert self.procs[0].returncode == 3, self.procs[0].stderr.read()[-3000:]
        return seconds, (self.out / "failed.rank0").read_text().split("\n", 1)[1]

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)  # a stopped process too
            p.communicate()


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    """Both scenarios, started together: ``{"kill": (seconds, error), "stop": (seconds, error)}``."""
    pairs = {name: Pair(tmp_path_factory.mktemp(name)) for name in ("kill", "stop")}
    try:
        deadline = time.monotonic() + 300
        for pair in pairs.values():
            pair.wait_ready(deadline)
        killed = time.monotonic()
        os.kill(pairs["kill"].procs[1].pid, signal.SIGKILL)
        stopped = time.monotonic()
        (pairs["stop"].out / "stop").write_text("")
        yield {"kill": pairs["kill"].survivor(killed), "stop": pairs["stop"].survivor(stopped)}
    finally:
        for pair in pairs.values():
            pair.stop()


@pytest.mark.multiprocess
def test_a_killed_rank_makes_the_other_raise_at_once(failures):
    seconds, error = failures["kill"]
    assert seconds < TIMEOUT, error  # the closed connection, not the timeout
    assert error.startswith(("RuntimeError", "DistBackendError")), error


@pytest.mark.multiprocess
def test_a_stopped_rank_makes_the_other_raise_after_the_timeout(failures):
    seconds, error = failures["stop"]
    assert TIMEOUT - 0.5 <= seconds < TIMEOUT + 20, error  # (rank 0 may have begun waiting a step before)
    assert f"Timed out waiting {int(TIMEOUT * 1000)}ms" in error
