"""Running one planned program on this rank's local shards: under ``vsf.simulate`` interpreted op
by op (:func:`vsf.jit.lower.execute`) on its first two calls, the second recording the plain ops
every rank runs, and the record replayed on later calls (:mod:`vsf.jit.replay`); otherwise traced once into
a graph of local ops and collectives (:func:`vsf.jit.lower.compile_local`, donated buffers reused,
each collective waited for at its first use) and that graph run, as it is (``backend="eager"``)
or compiled by Inductor (``backend="inductor"``); in checking mode beside the unsharded graph.
``vsf.config.jit_mode`` can force any of them.

Inductor compiles the traced graph once per plan, on its first call (PyTorch's own cache keeps
the artifacts between processes). A program on CPU whose collectives are all-reduces has its
kernels called from C++ (Inductor's ``cpp_wrapper``: the same kernels, without the Python
wrapper's dispatch per kernel, 0.6-0.8 ms of the main thread's 15 ms in the benchmark's DP
step); any other, or one the C++ wrapper fails to compile, from Python (:func:`inductor_program`).
An op with math for Inductor (:func:`register_inductor_math`: Adam's fused step, an opaque kernel
called once per leaf) is compiled as that math, whose in-place writes of donated buffers Inductor
keeps in place, so that Inductor fuses it with the ops around it (AdamW's moments and param in one
pass per leaf, where the eager program makes three). A graph Inductor cannot compile runs as it is,
after a warning that gives the reason; so do the simulated, interpreted and checked programs (simulated ranks are
``LocalTensor``\\ s, which Inductor does not compile), after one warning per program.

Example::

    >>> run = Runner(plan, backend="inductor")
    >>> locals_out = run(locals_in, check=False)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from vsf import _compat, config
from vsf.jit.check import run_checked
from vsf.jit.donation import reuse_donated
from vsf.jit.lower import compile_local, execute
from vsf.jit.overlap import wait_late
from vsf.jit.plan import Plan
from vsf.jit.replay import Replayed

__all__ = ["BACKENDS", "Runner", "as_inductor_math", "inductor_program", "register_inductor_math"]

BACKENDS = ("eager", "inductor")

log = logging.getLogger("vsf.jit")

_INDUCTOR_MATH: dict[Any, Callable[..., Any]] = {}


def register_inductor_math(op: Any, math: Callable[..., Any]) -> None:
    """Under ``backend="inductor"``, compile ``op`` (a custom op the eager program runs as one
    opaque kernel) as ``math``: a function of ``op``'s arguments that returns what ``op`` returns
    in torch ops Inductor can fuse, and writes in place (``copy_``) what ``op`` writes.

    Example::

        >>> register_inductor_math(torch.ops.vsf.adam_step_.default, adam_math_)
    """
    _INDUCTOR_MATH[op] = math


def as_inductor_math(gm: torch.fx.GraphModule, locals_in: list[torch.Tensor]) -> torch.fx.GraphModule:
    """``gm`` traced again with each op :func:`register_inductor_math` knows as its math (``gm``
    itself where it has none): the same inputs, results and order of ops."""
    if not any(n.op == "call_function" and n.target in _INDUCTOR_MATH for n in gm.graph.nodes):
        return gm
    return _compat.trace_fake(gm, locals_in, _INDUCTOR_MATH)


def inductor_program(
    gm: torch.fx.GraphModule, locals_in: list[torch.Tensor], name: str = "program"
) -> tuple[Callable[..., Any], str]:
    """Inductor's compile of ``gm`` (called ``name`` in the log) and what calls its kernels:
    ``"cpp"`` where every input is on the CPU and Inductor's C++ wrapper calls all its collectives
    (:func:`vsf._compat.cpp_wrapper_calls`), else, or where that compile fails (said in the log),
    ``"python"``.

    Example::

        >>> compiled, wrapper = inductor_program(gm, locals_in)   # wrapper == "cpp": all-reduces only
    """
    if all(t.device.type == "cpu" for t in locals_in) and _compat.cpp_wrapper_calls(gm):
        try:
            return _compat.inductor_compile(gm, locals_in, cpp_wrapper=True), "cpp"
        except Exception as e:  # noqa: BLE001 (any failure: the Python wrapper calls the same kernels)
            log.info(
                "Inductor's C++ wrapper could not compile %s (%s); its kernels are called from Python", name, _reason(e)
            )
    return _compat.inductor_compile(gm, locals_in), "python"


class Runner:
    """Runs one planned program on local shards: recorded and replayed under ``vsf.simulate``,
    else traced once into a graph of local ops and collectives and run as it is or compiled by
    Inductor (``backend``; ``vsf.config.jit_mode`` can force replay, or interpreting every call);
    in checking mode beside the unsharded graph."""

    def __init__(self, plan: Plan, backend: str = "eager", name: str = "program") -> None:
        self.plan, self.backend, self.name = plan, backend, name
        self.local: torch.fx.GraphModule | None = None  # the traced program, once traced
        self.compiled: Callable[..., Any] | None = None  # what runs it: the traced graph, or Inductor's compile of it
        self.replayed = Replayed(lambda xs: execute(plan, xs))  # the simulated program, once recorded
        self.wrapper: str | None = None  # what calls Inductor's kernels, once compiled: "cpp" or "python"
        self._warned = False

    def __call__(
        self, locals_in: list[torch.Tensor], check: bool, donated: Callable[[], list[int]] = list
    ) -> list[torch.Tensor]:
        mode = config.jit_mode
        if mode == "auto":
            mode = "replay" if _compat.active_local_mode() is not None else "trace"
        if check or mode != "trace":
            self._eager_instead(
                "checking mode runs the plan op by op"
                if check
                else "simulated ranks run as LocalTensors, which Inductor does not compile"
                if mode == "replay"
                else f"vsf.config.jit_mode is {mode!r}"
            )
        if check:
            return run_checked(self.plan, locals_in)
        if mode == "replay":
            with _compat.quiet_redistribute():
                return self.replayed(locals_in)
        if mode == "interpret":
            with _compat.quiet_redistribute():
                return execute(self.plan, locals_in)
        if self.compiled is None:
            self.local = wait_late(reuse_donated(compile_local(self.plan, locals_in), locals_in, donated()))
            self.compiled = self._compile(self.local, locals_in) if self.backend == "inductor" else self.local.forward
        return self.compiled(*locals_in)

    @property
    def compiled_by_inductor(self) -> bool:
        """Does this program run as Inductor compiled it (not yet run, run eagerly, or a compile that failed: no)?"""
        return self.local is not None and self.compiled is not None and self.compiled != self.local.forward

    def _compile(self, gm: torch.fx.GraphModule, locals_in: list[torch.Tensor]) -> Callable[..., Any]:
        """Inductor's compile of ``gm``; ``gm`` itself, after a warning with the reason, where it fails."""
        try:
            compiled, self.wrapper = inductor_program(as_inductor_math(gm, locals_in), locals_in, self.name)
            return compiled
        except Exception as e:  # noqa: BLE001 (any failure to compile: said, and the program runs as traced)
            warnings.warn(
                f"vsf.jit(backend='inductor'): Inductor could not compile {self.name} ({_reason(e)}); it runs as backend='eager', the traced fx program",
                stacklevel=4,
            )
            return gm.forward

    def _eager_instead(self, why: str) -> None:
        """Say once per program that a ``backend="inductor"`` program runs eagerly, and why."""
        if self.backend == "inductor" and not self._warned:
            self._warned = True
            warnings.warn(f"vsf.jit(backend='inductor'): {self.name} runs as backend='eager' here: {why}", stacklevel=4)


def _reason(e: BaseException) -> str:
    """The first line of the error at the root of ``e`` (Inductor wraps the one that stopped it), with its type."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
