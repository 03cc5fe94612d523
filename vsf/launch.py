"""Start a script on N local processes, the way ``torchrun`` does, on 127.0.0.1.

``python -m vsf.launch -n 4 train.py --steps 10`` is ``torchrun --nproc-per-node 4`` with the
rendezvous pinned to the loopback address and a free port, so several runs can share a machine.
For several machines use ``torchrun`` itself (see the README).

``--collective-timeout S`` (``run(..., collective_timeout=S)``) sets ``vsf.config.collective_timeout``
on every rank (through ``VSF_COLLECTIVE_TIMEOUT``): a rank that stops without dying makes the
others raise after ``S`` seconds instead of the default 600.

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

__all__ = ["command", "environment", "free_port", "run"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(script: str | Path, nproc: int, args: Sequence[str] = ()) -> list[str]:
    """The ``torch.distributed.run`` command line for ``script`` on ``nproc`` local processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]


def environment(collective_timeout: float | None = None) -> dict[str, str]:
    """The ranks' environment: this one, one OpenMP thread each unless set, gloo on the loopback
    interface, and ``VSF_COLLECTIVE_TIMEOUT`` when ``collective_timeout`` is given.

    Example::

        >>> subprocess.run(vsf.launch.command("train.py", 2), env=vsf.launch.environment(collective_timeout=60))
    """
    env = dict(
        os.environ,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    if collective_timeout is not None:
        env["VSF_COLLECTIVE_TIMEOUT"] = str(float(collective_timeout))
    return env


def run(
    script: str | Path,
    nproc: int,
    *args: str,
    timeout: float = 600,
    capture: bool = True,
    collective_timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` processes; raise ``RuntimeError`` with its output if it fails
    (``timeout``: seconds for the whole run; ``collective_timeout``: see the module docs)."""
    cmd = command(script, nproc, args)
    proc = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout, env=environment(collective_timeout))
    if proc.returncode != 0:
        out = f"\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}" if capture else ""
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}){out}")
    return proc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vsf.launch", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of processes (ranks)")
    parser.add_argument(
        "--collective-timeout",
        type=float,
        metavar="S",
        help="seconds a collective waits for the other ranks before it raises (default: vsf.config's, 600)",
    )
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    return subprocess.run(command(ns.script, ns.nproc, ns.args), env=environment(ns.collective_timeout)).returncode


if __name__ == "__main__":
    raise SystemExit(main())
