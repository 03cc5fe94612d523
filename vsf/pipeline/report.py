"""What a planned pipeline step reports: :class:`PipelineLowered` (each stage's ``Lowered``, its
once-a-step gather and reduction, the loss's, :meth:`~PipelineLowered.as_text`), the figures per
stage (:class:`StageCost`, :class:`PipelineCost`) and the sends between stages (:class:`Send`).
:func:`vsf.pipeline.lower.lower_step` builds them.

Example::

    >>> lowered = pipe.lower(params, idx, targets, layout=layout)
    >>> print(lowered.as_text())
    >>> [c.comm_bytes["pp"] for c in lowered.cost().stages]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from vsf.jit import Lowered
from vsf.jit.report import Cost, fmt_bytes
from vsf.pipeline.schedule import ScheduleName
from vsf.sharding.inspect import type_string
from vsf.sharding.mesh import Mesh

__all__ = ["PipelineCost", "PipelineLowered", "Send", "StageCost", "send"]


@dataclasses.dataclass(frozen=True)
class Send:
    """A point-to-point transfer over ``pp`` from stage ``src`` to stage ``dst``: ``what`` it
    carries, each rank's local ``shape`` and ``dtype``, the ``bytes`` one rank sends per message,
    and ``count`` messages a step (one per microbatch for activations and their gradients)."""

    what: str
    src: int
    dst: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int
    count: int

    @property
    def step_bytes(self) -> int:
        """Bytes one rank sends a step for this transfer."""
        return self.bytes * self.count


def send(what: str, src: int, dst: int, shape: Sequence[int], dtype: torch.dtype, count: int) -> Send:
    """The :class:`Send` of a local shard of ``shape`` and ``dtype``, ``count`` times a step."""
    shape = tuple(int(n) for n in shape)
    return Send(what, src, dst, shape, dtype, math.prod(shape) * dtype.itemsize, count)


@dataclasses.dataclass(frozen=True)
class StageCost:
    """What stage ``stage`` costs each of its ``ranks`` in one step.

    ``program``: one microbatch's forward and backward programs (``loss``: the loss program's, on
    the last stage), run ``microbatches`` times a step; ``reduce``: the program that reduces the
    stage's gradients once a step (their mean over the microbatches: the backward leaves a
    param's gradient unreduced over the axes the param is replicated on, e.g. ``dp``, and torch
    sums the microbatches' into ``.grad``, so a step all-reduces it once, as DDP does, or
    reduce-scatters it once where the param is split over the batch's axes, as FSDP does);
    ``gather``: the program that gathers the params split over the batch's axes once a step, before
    the first microbatch (``None`` if it gathers none, as with ``reshard_after_forward``). ``param_bytes``: the params the
    stage holds (its optimizer state follows them); ``gathered_bytes``: the shards of the params it
    gathers, held beside their gathered copies through the step; ``borrowed_bytes``: tied params
    lent to it each step.
    ``held_bytes``: what it keeps for one microbatch between that microbatch's forward and its
    backward (input, output and the values the forward saves); ``in_flight``: the most microbatches
    it keeps at once under the schedule. ``sends``: the transfers its ranks send.
    """

    stage: int
    ranks: tuple[int, ...]
    program: Cost
    loss: Cost | None
    reduce: Cost
    gather: Cost | None
    microbatches: int
    param_bytes: int
    gathered_bytes: int
    borrowed_bytes: int
    held_bytes: int
    in_flight: int
    sends: tuple[Send, ...]

    @property
    def comm_bytes(self) -> dict[str, int]:
        """Bytes each rank sends a step per mesh axis: the programs' collectives once per
        microbatch, the gradients' reduction once, and the sends over ``pp``."""
        out = {a: b * self.microbatches for a, b in self.program.comm_bytes.items()}
        for a, b in self.loss.comm_bytes.items() if self.loss else ():
            out[a] = out.get(a, 0) + b * self.microbatches
        for once in (self.reduce, self.gather):
            for a, b in once.comm_bytes.items() if once else ():
                out[a] = out.get(a, 0) + b
        out["pp"] = out.get("pp", 0) + sum(s.step_bytes for s in self.sends)
        return out

    @property
    def activation_bytes(self) -> int:
        """The most bytes of microbatches in flight: ``in_flight * held_bytes``."""
        return self.in_flight * self.held_bytes

    @property
    def peak_bytes(self) -> int:
        """Estimated peak per rank (from above): one microbatch's programs at their peak (the params
        they read included), the loss program's, the other microbatches in flight, the borrowed
        params and the shards of the gathered ones."""
        loss = self.loss.peak_bytes if self.loss else 0
        return (
            self.program.peak_bytes
            + loss
            + (self.in_flight - 1) * self.held_bytes
            + self.borrowed_bytes
            + self.gathered_bytes
        )


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """Each lowered stage's :class:`StageCost` and every send of the step. ``comm_bytes`` and
    ``peak_bytes`` are the most any rank has (as ``Cost``'s are for one program)."""

    stages: tuple[StageCost, ...]
    sends: tuple[Send, ...]

    @property
    def comm_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.stages:
            for a, b in s.comm_bytes.items():
                out[a] = max(out.get(a, 0), b)
        return out

    @property
    def peak_bytes(self) -> int:
        return max(s.peak_bytes for s in self.stages)


class PipelineLowered:
    """A pipelined step, planned and not run: ``stages[s]`` (stage ``s``'s ``Lowered``, for each
    stage this process computes), ``loss`` (the loss program's, on the last stage), ``gathers[s]``
    (the ``Lowered`` of stage ``s``'s params gathered once a step, for each stage that gathers
    some), ``reducers[s]``
    (the ``Lowered`` of stage ``s``'s gradients reduced once a step), ``sends``, :meth:`cost` and
    :meth:`as_text`."""

    def __init__(
        self,
        mesh: Mesh,
        axis: str,
        schedule: ScheduleName,
        microbatches: int,
        prefixes: Sequence[Sequence[str]],
        stages: dict[int, Lowered],
        loss: Lowered | None,
        reducers: dict[int, Lowered],
        gathers: dict[int, Lowered],
        costs: Sequence[StageCost],
        sends: Sequence[Send],
    ) -> None:
        self.mesh, self.axis, self.schedule, self.microbatches = mesh, axis, schedule, microbatches
        self.prefixes = [list(p) for p in prefixes]
        self.stages, self.loss, self.reducers, self.gathers, self.sends = stages, loss, reducers, gathers, tuple(sends)
        self._costs = tuple(costs)

    def cost(self) -> PipelineCost:
        """Per stage: bytes sent a step per mesh axis, memory held, and the sends between stages."""
        return PipelineCost(self._costs, self.sends)

    def as_text(self) -> str:
        """The step in words: the stages and their ranks and memory, every send between stages
        with its shape and bytes, then each stage's forward and backward plan."""
        m, p = self.microbatches, len(self.prefixes)
        mesh = " x ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
        lines = [
            f"pipeline of {p} stages over {self.axis} on mesh {mesh} ({self.mesh.size} ranks): {self.schedule}, {m} microbatches a step",
            "stages (bytes per rank):",
        ]
        per_axis = lambda comm: ", ".join(
            f"{a} {fmt_bytes(b)}" for a, b in comm.items() if a != self.axis and self.mesh.axis_size(a) > 1
        )  # noqa: E731
        for c in self._costs:
            pp = c.comm_bytes["pp"]
            others = per_axis(c.comm_bytes)
            lines += [
                f"  stage {c.stage}: ranks {list(c.ranks)}, {', '.join(self.prefixes[c.stage])}",
                f"    params {fmt_bytes(c.param_bytes)}"
                + (f" (+ {fmt_bytes(c.borrowed_bytes)} of tied params lent each step)" if c.borrowed_bytes else "")
                + f"; a microbatch held {fmt_bytes(c.held_bytes)} from its forward to its backward, at most {c.in_flight} in flight ({fmt_bytes(c.activation_bytes)});"
                f" peak ~{fmt_bytes(c.peak_bytes)}",
                f"    sends a step: {self.axis} {fmt_bytes(pp)}"
                + (
                    f", {others} ({m} x one microbatch's collectives, and the gradients reduced once a step: {per_axis(c.reduce.comm_bytes)})"
                    if others
                    else ""
                ),
            ]
            if c.gathered_bytes:
                lines.append(
                    f"    params gathered once a step: {per_axis(c.gather.comm_bytes)} (their {fmt_bytes(c.gathered_bytes)} of shards held beside them)"
                )
        lines.append(f"sends over {self.axis} (each rank to the rank at its other coordinates in the other stage):")
        width = max((len(s.what) for s in self.sends), default=0)
        for send in self.sends:
            shape = type_string(send.shape, send.dtype, None)
            lines.append(
                f"  {send.what:<{width}}  stage {send.src} -> {send.dst}  {shape:<16} {fmt_bytes(send.bytes):>9} x {send.count} = {fmt_bytes(send.step_bytes)} a step"
            )
        for s, lowered in sorted(self.stages.items()):
            lines += ["", f"== stage {s}: one microbatch (run {m} times a step) ==", lowered.as_text()]
            if s in self.gathers:
                lines += ["", f"== stage {s}: its params gathered once a step ==", self.gathers[s].as_text()]
            lines += [
                "",
                f"== stage {s}: its gradients summed over the microbatches, reduced once a step ==",
                self.reducers[s].as_text(),
            ]
        if self.loss is not None:
            lines += ["", f"== the loss on stage {p - 1}: one microbatch ==", self.loss.as_text()]
        return "\n".join(lines)
