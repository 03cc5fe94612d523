"""Tier 3 of DESIGN.md: real gloo processes started the way a user starts them, with torchrun.

A test module launches its worker script once (a module-scoped fixture) and its tests check the
JSON results the ranks wrote. Rendezvous is on 127.0.0.1 at a free port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKERS = Path(__file__).parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``script`` under ``torchrun --nproc-per-node nproc`` on 127.0.0.1; raise with its output on failure."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(script), *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def results(out_dir: Path, nproc: int) -> list[dict[str, Any]]:
    """The JSON each rank wrote to ``out_dir/rank{r}.json``."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
