"""Tier 3 of the tests (docs/architecture.md): real gloo processes started the way a user starts
them (vsf's launcher, which is torchrun on 127.0.0.1 at a free port).

A worker script writes one JSON file per rank, which the tests check. Most run as sections of
one launch per world size (``world`` in tests/conftest.py, ``workers/world.py``); a worker that
needs a launch of its own (one that kills a rank, or other launcher arguments) uses
:func:`launch_once` from a module-scoped fixture.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from vsf import launch

WORKERS = Path(__file__).parent / "workers"


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` gloo processes; raise with its output on failure."""
    return launch.run(script, nproc, *args, timeout=timeout)


def results(out_dir: Path, nproc: int) -> list[dict[str, Any]]:
    """The JSON each rank wrote to ``out_dir/rank{r}.json``."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def launch_once(tmp_path_factory: Any, script: str, nproc: int, *args: str) -> list[dict[str, Any]]:
    """Run ``workers/<script>`` once on ``nproc`` processes, writing into a fresh directory, and
    return what each rank reported (the body of a module-scoped fixture)."""
    out = tmp_path_factory.mktemp(Path(script).stem)
    torchrun(WORKERS / script, nproc, str(out), *args)
    return results(out, nproc)
