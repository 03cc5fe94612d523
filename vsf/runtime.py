"""Where the ranks are: simulated in this process, real under ``torchrun``, or a single process.

* ``with vsf.simulate(8):`` runs 8 ranks in this process with real numbers (PyTorch's fake
  process group plus ``LocalTensorMode``): every tensor holds one value per rank, and
  collectives compute what the real ones would. Random numbers are drawn as separate processes
  would draw them: ``torch.manual_seed`` seeds every rank alike, and an explicit
  ``torch.Generator`` acts as one copy per rank, so ``torch.randint(..., generator=g)`` gives
  every rank the draw one process makes (and leaves ``g`` as that process would).
* ``vsf.simulate(4096, compute=False)`` is planning-only: shapes, placements and plans are exact,
  values are meaningless. Use it to check a layout or a plan for a cluster you do not have.
* Under ``torchrun`` the default process group is initialised from the environment (gloo on CPU,
  NCCL on CUDA) the first time a mesh is built, with ``vsf.config.collective_timeout``: a
  collective that waits longer than that for another rank raises (a rank that stopped without
  dying), on that group and every group created after it. A rank that dies makes the others
  raise at once (its connections close).
* A plain single process gets a one-rank gloo group, so a mesh of size 1 works anywhere.
* A module built inside a simulation (``Model(config)``, ``from_pretrained``) holds one value
  per buffer, as a module built outside does: the first simulated rank's (see :class:`simulate`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import os
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from vsf import _compat, config

__all__ = ["default_device_type", "ensure_world", "is_simulated", "rank", "simulate", "world_size"]

_ACTIVE: list["simulate"] = []
_ON_STOP: list[Callable[[], None]] = []
_CREATED: list["weakref.ref[dist.ProcessGroup]"] = []  # the default group ensure_world initialised, destroyed at exit


def on_stop(fn: Callable[[], None]) -> None:
    """Call ``fn`` whenever a simulation stops, before its process group goes, and at interpreter
    exit (a layer above registers the caches it keeps per process group, so this module imports
    nothing of vsf's).

    Example::

        >>> vsf.runtime.on_stop(forget_meshes)
    """
    _ON_STOP.append(fn)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """This process's cyclic garbage collector off for the block (as it was before, after). A
    step's trace and plan keep hundreds of thousands of objects alive (fx nodes, fake tensors,
    strategies), which every full collection walks again to free little: about a tenth of a
    24-layer GPT's planning time. The block's cyclic garbage is freed at the next collection.

    Example::

        >>> with vsf.runtime.collector_paused():
        ...     compiled = plan(call)
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class simulate:  # noqa: N801  (used like a function: ``with vsf.simulate(8):``)
    """Run ``n`` ranks in this process.

    With ``compute=True`` (the default) every rank computes real numbers, so results can be
    compared with a single-device run; with ``compute=False`` only shapes and placements are
    tracked, which scales to thousands of ranks for planning.

    Use it as a context manager, or call :meth:`start` / :meth:`stop` (handy in notebooks,
    where one cell starts the simulation and later cells use it).

    A module built inside (``LlamaForCausalLM(config)``, ``from_pretrained(path)``) registers its
    buffers as plain tensors holding the first simulated rank's value (the ranks compute them
    alike: from the config, from the same files), as a module built before the simulation holds
    them, so that a buffer such as Llama's rotary frequencies can be a constant of a ``vsf.jit``
    program (a per-rank buffer failed there with ``DataDependentOutputException: aten.equal``).
    Its parameters keep one value per rank (equal on every rank: they are drawn as separate
    processes draw them, which a plain tensor inside the simulation would not be); pass them
    explicitly, as ``vsf.tree.apply(model, params, ...)`` does, rather than closing over them (a
    ``vsf.jit`` function that reads them from the module is a ``vsf.TraceError`` at its call).

    Example::

        >>> with vsf.simulate(8):
        ...     mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
        ...     x = vsf.device_put(torch.arange(8.0), vsf.NamedSharding(mesh, vsf.P("dp")))
    """

    def __init__(self, n: int, *, compute: bool = True) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"simulate(n) needs a positive number of ranks, got {n!r}")
        self.n = n
        self.compute = compute
        self._mode: Any = None
        self._hooks: list[Any] = []

    def __repr__(self) -> str:
        return f"simulate({self.n}, compute={self.compute})"

    def start(self) -> "simulate":
        """Initialise the fake process group (and, with ``compute``, the per-rank tensor mode)."""
        if dist.is_initialized():
            where = (
                f"inside {_ACTIVE[-1]!r}"
                if _ACTIVE
                else f"a real {dist.get_backend()} group of {dist.get_world_size()} ranks"
            )
            raise RuntimeError(f"cannot start {self!r}: a process group already exists ({where}); stop it first")
        _compat.init_fake_process_group(self.n)
        if self.compute:
            self._mode = _compat.local_tensor_mode(self.n, _RankGenerators(self.n))
            self._mode.__enter__()
            self._hooks = [torch.nn.modules.module.register_module_buffer_registration_hook(_one_value)]
        _ACTIVE.append(self)
        return self

    def stop(self) -> None:
        """Leave the simulation and destroy its process group; meshes built inside become invalid."""
        if not _ACTIVE or _ACTIVE[-1] is not self:
            raise RuntimeError(f"{self!r} is not the running simulation")
        _ACTIVE.pop()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for forget in _ON_STOP:  # caches per process group (the meshes)
            forget()
        dist.destroy_process_group()

    def __enter__(self) -> "simulate":
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _RankGenerators:
    """The simulation's handler of ops given an explicit ``torch.Generator``: one generator per
    rank, as in ``n`` separate processes.

    PyTorch's ``LocalTensorMode`` keeps per-rank states only for the default generator: it runs an
    op once per rank, so an op given ``generator=g`` would draw rank 0's values from ``g``, rank
    1's from where rank 0 left ``g``, and so on. Here every rank draws from its own copy of ``g``'s
    state (all equal to ``g``'s state when it was seeded or last set), and ``g`` is left in the
    state one process would leave it in (rank 0's when shards of different sizes made the ranks'
    states differ; the others are kept for the next draw as long as ``g`` is not reseeded).

    Example::

        >>> with vsf.simulate(2):
        ...     x = torch.randint(9, (4,), generator=torch.Generator().manual_seed(7))   # equal on both ranks
    """

    def __init__(self, n: int) -> None:
        self.ranks = range(n)
        # While the ranks' states of a generator differ: the state it was left in and each rank's,
        # keyed by the C++ generator. An entry whose generator is gone or was reseeded no longer
        # matches the generator's state, and is ignored.
        self.states: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}

    def __call__(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], generators: list[torch.Generator]
    ) -> Any:
        states = {g: self._rank_states(g) for g in generators}
        results = {}
        for r in self.ranks:
            for g, per_rank in states.items():
                g.set_state(per_rank[r])
            results[r] = _compat.run_on_rank(func, r, args, kwargs)
            for g, per_rank in states.items():
                per_rank[r] = g.get_state()
        for g, per_rank in states.items():
            self._leave(g, per_rank)
        return _compat.merge_rank_results(results, _compat.torch_tree_leaves((args, kwargs)))

    def _rank_states(self, g: torch.Generator) -> dict[int, torch.Tensor]:
        visible = g.get_state()
        kept = self.states.get(_compat.generator_key(g))
        if kept is not None and torch.equal(kept[0], visible):
            return dict(kept[1])
        return {r: visible for r in self.ranks}

    def _leave(self, g: torch.Generator, per_rank: dict[int, torch.Tensor]) -> None:
        first = per_rank[min(per_rank)]
        g.set_state(first)
        if all(torch.equal(s, first) for s in per_rank.values()):
            self.states.pop(_compat.generator_key(g), None)
        else:
            self.states[_compat.generator_key(g)] = (first, per_rank)


def _one_value(module: torch.nn.Module, name: str, t: torch.Tensor | None) -> torch.Tensor | None:
    """A module's buffer registered under simulation: a per-rank value becomes the first rank's,
    as a plain tensor."""
    if t is None or not _compat.is_local_tensor(t):
        return None
    shards = _compat.local_shards(t, 0)
    with _compat.local_mode_disabled():
        return shards[min(shards)].detach()


def is_simulated() -> bool:
    """True inside :class:`simulate` (with or without real numbers)."""
    return bool(_ACTIVE)


def computes_values() -> bool:
    """False only in planning-only simulation, where tensor values are meaningless."""
    return not _ACTIVE or _ACTIVE[-1].compute


def world_size() -> int:
    """Number of ranks of the default process group (1 when none exists)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """This process's global rank (0 when no group exists; 0 under simulation)."""
    return dist.get_rank() if dist.is_initialized() else 0


def default_device_type() -> str:
    """``"cuda"`` when CUDA is available (and not simulating), else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() and not _ACTIVE else "cpu"


def ensure_world(device_type: str) -> None:
    """Make sure a default process group exists.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) it is initialised from the
    environment with gloo for CPU and NCCL for CUDA, its collectives waiting at most
    ``vsf.config.collective_timeout`` seconds for the other ranks, and so are those of every
    group created after it (torch's default for new groups is set to the same); in a plain
    process, as a one-rank group that needs no network.

    Example::

        >>> vsf.config.collective_timeout = 60      # before the first mesh
        >>> mesh = vsf.make_mesh((4,), ("dp",))      # under torchrun: a rank stopped for 60 s fails the others
    """
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(seconds=config.collective_timeout)
        dist.init_process_group(backend, timeout=timeout)
        dist.distributed_c10d.default_pg_timeout = timeout  # for the groups created later (the meshes' axes)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _CREATED.append(weakref.ref(dist.group.WORLD))


@atexit.register
def _release_groups() -> None:
    """Let every process group go while the interpreter still runs.

    vsf's caches (the DeviceMeshes) hold the meshes' sub-groups, and a group's worker threads are
    joined only when the group itself is freed. Left to interpreter finalisation, a gloo worker
    thread that releases a finished collective's tensors needs the GIL after Python has begun to
    shut down and aborts the process ("terminate called without an active exception"), even
    after ``dist.destroy_process_group()``. So at exit: drop the caches, destroy the default
    group if :func:`ensure_world` created it, and collect.
    """
    for forget in _ON_STOP:
        forget()
    if _CREATED and dist.is_initialized() and dist.group.WORLD is _CREATED[-1]():
        dist.destroy_process_group()
    _CREATED.clear()
    gc.collect()
