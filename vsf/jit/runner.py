"""Running one planned program on this rank's local shards: under ``vsf.simulate`` interpreted op
by op (:func:`vsf.jit.lower.execute`) on its first two calls, the second recording the plain ops
every rank runs, and the record replayed on later calls (:mod:`vsf.jit.replay`); otherwise traced once into
a graph of local ops and collectives (:func:`vsf.jit.lower.compile_local`, donated buffers reused,
each collective waited for at its first use) and that graph run; in checking mode beside the
unsharded graph. ``vsf.config.jit_mode`` can force any of them.

Example::

    >>> run = Runner(plan)
    >>> locals_out = run(locals_in, check=False)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx

from vsf import _compat, config
from vsf.jit.check import run_checked
from vsf.jit.donation import reuse_donated
from vsf.jit.lower import compile_local, execute
from vsf.jit.overlap import wait_late
from vsf.jit.plan import Plan
from vsf.jit.replay import Replayed

__all__ = ["Runner"]


class Runner:
    """Runs one planned program on local shards: recorded and replayed under ``vsf.simulate``,
    else traced once into a graph of local ops and collectives (``vsf.config.jit_mode`` can force
    either, or interpreting every call); in checking mode beside the unsharded graph."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.local: torch.fx.GraphModule | None = None  # the traced program, once traced
        self.replayed = Replayed(lambda xs: execute(plan, xs))  # the simulated program, once recorded

    def __call__(self, locals_in: list[torch.Tensor], check: bool, donated: Callable[[], list[int]] = list) -> list[torch.Tensor]:
        mode = config.jit_mode
        if mode == "auto":
            mode = "replay" if _compat.active_local_mode() is not None else "trace"
        if check:
            return run_checked(self.plan, locals_in)
        if mode == "replay":
            with _compat.quiet_redistribute():
                return self.replayed(locals_in)
        if mode == "interpret":
            with _compat.quiet_redistribute():
                return execute(self.plan, locals_in)
        if self.local is None:
            self.local = wait_late(reuse_donated(compile_local(self.plan, locals_in), locals_in, donated()))
        return self.local.forward(*locals_in)
