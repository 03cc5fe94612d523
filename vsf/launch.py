"""Start a script on N local processes, the way ``torchrun`` does, on 127.0.0.1.

``python -m vsf.launch -n 4 train.py --steps 10`` is ``torchrun --nproc-per-node 4`` with the
rendezvous pinned to the loopback address and a free port, so several runs can share a machine.
For several machines use ``torchrun`` itself (see the README).

Example::

    >>> vsf.launch.run("examples/train_gpt.py", 4, "--steps", "10")   # raises with the output on failure
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["command", "free_port", "run"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(script: str | Path, nproc: int, args: Sequence[str] = ()) -> list[str]:
    """The ``torch.distributed.run`` command line for ``script`` on ``nproc`` local processes."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--nnodes=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(script), *args,
    ]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))


def run(script: str | Path, nproc: int, *args: str, timeout: float = 600, capture: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` processes; raise ``RuntimeError`` with its output if it fails."""
    cmd = command(script, nproc, args)
    proc = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout, env=_env())
    if proc.returncode != 0:
        out = f"\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}" if capture else ""
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}){out}")
    return proc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vsf.launch", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of processes (ranks)")
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    return subprocess.run(command(ns.script, ns.nproc, ns.args), env=_env()).returncode


if __name__ == "__main__":
    raise SystemExit(main())
