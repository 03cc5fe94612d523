"""Shared fixtures. Most tests run ranks simulated in this process (tier 1 of docs/architecture.md)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

# Layout tests compare with JAX on 64 virtual CPU devices; the flag must be set before jax starts.
os.environ["XLA_FLAGS"] = " ".join(
    f for f in [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=64"] if f
)

# Inductor compiles each kernel in this process and in every process the tests start (the ranks of
# tests/workers/jit_inductor.py): its default, a pool of worker processes per core, costs each
# compiling process a pool that imports torch, for no speed on CI's two cores that the other
# processes already keep busy. Read when Inductor is first imported.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# pytest-xdist workers share the cores: each runs torch's ops on its share of them (and so do the
# processes and notebook kernels it starts, through the variable), since OpenMP threads that
# outnumber the cores wait at every op's barrier for one that is descheduled.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)

from hypothesis import HealthCheck, settings  # noqa: E402

import vsf  # noqa: E402

# Property tests: a fixed budget of examples, no per-example deadline (the first simulated
# example of a process pays one-off start-up costs); tests that need another budget say so.
# Local runs explore new examples each time; CI (CI=true) runs a fixed, reproducible set.
settings.register_profile(
    "vsf",
    max_examples=40,
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "vsf"))


# tests that start processes, train third-party models or run notebooks: their files take minutes
LONG_MARKS = {"world", "multiprocess", "models", "notebooks"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files by how many of their tests carry one of ``LONG_MARKS``, most first, then by how many
    tests they hold: a pytest-xdist worker takes the next file whenever it runs out (``--dist
    loadfile``, the queue in this order), so the files that take minutes start early and the
    workers finish together instead of one running a long file alone at the end."""
    files: dict[Path, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def order(path: Path) -> tuple[int, int]:
        tests = files[path]
        return -sum(any(m.name in LONG_MARKS for m in t.iter_markers()) for t in tests), -len(tests)

    items[:] = [item for path in sorted(files, key=order) for item in files[path]]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core, at most 8 (each imports torch, jax and transformers)."""
    return max(1, min(8, os.cpu_count() or 1))


@pytest.fixture
def sim():
    """``sim(n)`` starts an n-rank simulation with real numbers for the test; it stops afterwards."""
    started: list[vsf.simulate] = []

    def start(n: int, *, compute: bool = True) -> vsf.simulate:
        s = vsf.simulate(n, compute=compute).start()
        started.append(s)
        return s

    yield start
    for s in reversed(started):
        s.stop()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _shared_tmp(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this run sees (the parent of their own temp
    directories), or this run's temp directory without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def world(request, tmp_path_factory):
    """``world(script, *args, nproc=4)``: what each of ``nproc`` real gloo processes reported for
    the worker ``tests/workers/<script>`` (the list of their ``rank{r}.json``). The sections that the
    selected tests name with ``@pytest.mark.world(script, *args, nproc=...)`` run in one launch of
    ``nproc`` processes per size (``workers/world.py``), started the first time a test asks for a
    section of that size; a section that its launch did not finish raises, with the launch's error.
    Under pytest-xdist the launch is shared: the first worker to ask runs it while holding a lock
    that the others wait on, and records how it ended for them (every worker collects every test,
    so all agree on the sections)."""
    from multiproc import WORKERS, results, torchrun
    from workers.world import section_name

    marks = [m for item in request.session.items for m in item.iter_markers("world")]
    sections = list(dict.fromkeys((m.kwargs.get("nproc", 4), m.args) for m in marks))
    shared = _shared_tmp(tmp_path_factory)

    def launched(nproc: int) -> tuple[Path, str | None]:
        """The launch's directory and, if it failed, its error."""
        out, ended = shared / f"world{nproc}", shared / f"world{nproc}.ended.json"
        with open(shared / f"world{nproc}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not ended.exists():
                out.mkdir()
                try:
                    torchrun(
                        WORKERS / "world.py",
                        nproc,
                        str(out),
                        *(json.dumps(list(s)) for n, s in sections if n == nproc),
                        timeout=900,
                    )
                    failure = None
                except Exception as e:  # noqa: BLE001 (raised again by each section it stopped)
                    failure = f"{type(e).__name__}: {e}"
                ended.write_text(json.dumps(failure))
        return out, json.loads(ended.read_text())

    def section(script: str, *args: str, nproc: int = 4) -> list[dict]:
        if (nproc, (script, *args)) not in sections:
            raise LookupError(
                f"{script} {args} on {nproc} processes is not a section: mark the test @pytest.mark.world({script!r}, ..., nproc={nproc})"
            )
        out, failure = launched(nproc)
        where = out / section_name(script, *args)
        if not all((where / f"done.rank{r}").exists() for r in range(nproc)):
            raise RuntimeError(
                f"the launch of {nproc} processes stopped before section {script} {args} finished:\n{failure}"
            )
        return results(where, nproc)

    return section
