"""Reading a pipeline's plan without running it: each stage's planned programs, the sends between
stages over ``pp`` (shape, dtype, bytes per microbatch and per step), and each stage's memory.

``Pipeline.lower(params, inputs, targets, layout=layout)`` (:func:`lower_step`) returns a
:class:`PipelineLowered`, the pipeline's
counterpart of ``vsf.jit(f).lower(...)``'s ``Lowered``: ``stages[s]`` is stage ``s``'s own
``Lowered`` (its forward and backward programs, planned once and run for every microbatch),
``gathers[s]`` the program that gathers its fsdp-split params once a step, ``reducers[s]`` the
program that reduces its gradients once a step, ``as_text()`` reads the whole step, ``cost()``
gives the figures per stage.

Every figure is per rank (the most any rank of the stage holds or sends). Activations cross
between stages as local shards: each rank sends its shard to the rank at the same coordinates of
the other axes in the next stage, and the gradient of that shard comes back the same way.

Example::

    >>> lowered = pipe.lower(params, idx, targets, layout=layout)
    >>> print(lowered.as_text())
    >>> [s.comm_bytes["pp"] for s in lowered.cost().stages]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vsf import tree
from vsf.abstract import ShapeDtypeStruct, eval_shape
from vsf.errors import PlanError
from vsf.jit import Lowered
from vsf.jit.graph import placeholders_of
from vsf.jit.report import Cost, fmt_bytes
from vsf.pipeline.schedule import ScheduleName
from vsf.pipeline.split import Layout, leaf_names
from vsf.pipeline.stage import Boundary, shard_bytes, stand_in
from vsf.sharding.inspect import type_string
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding
from vsf.sharding.spec import PartitionSpec

__all__ = [
    "PipelineCost",
    "PipelineLowered",
    "Send",
    "StageCost",
    "boundaries",
    "first_entries",
    "in_flight",
    "lower_step",
    "saved_bytes",
    "sends",
    "split_params",
]

Split = Mapping[
    str, tuple[str, ...]
]  # a stage's params its program computes on split over the batch's axes, and those axes
Bounds = list[
    tuple[list[Boundary], Boundary, torch.dtype, Split]
]  # per stage: its inputs', its output's layout and shape, its output's dtype, its params computed on split


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


def saved_bytes(lowered: Lowered, skip: int) -> int:
    """Bytes per rank of the values ``lowered``'s forward saves for its backward, less those of
    its first ``skip`` inputs (the params, which the stage holds anyway)."""
    parts = getattr(lowered.compile(), "parts", None)
    if parts is None:
        return 0
    held = {ph.name for ph in placeholders_of(parts.forward.graph)[:skip]}
    return sum(s.bytes for s in parts.saved if not (s.value[0].op == "placeholder" and s.value[0].name in held))


def in_flight(actions: Sequence[tuple[str, int]]) -> int:
    """The most microbatches whose forward has run and whose backward has not (or, split, its
    weight part: it holds what the input part leaves it), in ``actions``."""
    now = most = 0
    for kind, _ in actions:
        now += {"F": 1, "I": 0}.get(kind, -1)
        most = max(most, now)
    return most


def first_entries(spec: PartitionSpec, n: int) -> PartitionSpec:
    """``spec``'s first ``n`` entries (a batch spec applied to a value of rank ``n``)."""
    return PartitionSpec(*tuple(spec)[:n])


def lower_step(pipe: Any, layout: Layout, params: Any, inputs: Any, targets: Any) -> PipelineLowered:
    """``pipe.lower(params, inputs, targets, layout=layout)``: plan each stage this process computes
    (its microbatch's programs, its once-a-step gather and reduction, the loss program on the
    last), the sends between stages, and each stage's cost, without running or sending anything.
    ``pipe`` is the :class:`~vsf.pipeline.api.Pipeline`, whose cached programs the step reuses.

    Example::

        >>> lowered = lower_step(pipe, layout, params, idx, targets)
        >>> lowered.cost().stages[0].comm_bytes["pp"]
    """
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    targets = targets if isinstance(targets, tuple) else (targets,)
    values = dict(zip(leaf_names(params), tree.leaves(params)))
    split, shapes = layout.split, layout.shapes
    bounds = boundaries(pipe, layout, inputs)
    step_sends = sends(pipe, layout, bounds)
    actions = [
        [(kind, mb) for acts in pipe.actions() for st, kind, mb in acts if st == s] for s in range(pipe.num_stages)
    ]
    last = pipe.num_stages - 1
    stages, reducers, gathers, costs, loss = {}, {}, {}, [], None
    with torch.enable_grad():
        for s in pipe.local_stages():
            ins, out, dtype, split_params = bounds[s]
            dtypes = [x.dtype for x in inputs] if s == 0 else [bounds[s - 1][2]]
            names = split.names[s]
            lent = {k: stand_in(layout.where(k, s), shapes[k].dtype) for k in split.borrowed(s)}
            gathered = pipe._gathered(layout, s, split_params)
            vals = {k: pipe._value(layout, k, s, values, lent) for k in gathered}
            stages[s], gather, reducers[s] = _stage_lowered(pipe, layout, s, ins, dtypes, out[0], split_params, vals)
            if gather is not None:
                gathers[s] = gather
            held = (
                shard_bytes(out, dtype)
                + sum(shard_bytes(where, d) for where, d in zip(ins, dtypes))
                + saved_bytes(stages[s], len(names))
            )
            if s == last:
                ts = [stand_in(where, t.dtype) for where, t in zip(pipe._target_ins(targets), targets)]
                loss = pipe._loss_program(last).lower(stand_in(out, dtype, grad=True), *ts)
                held += saved_bytes(loss, 0)
            costs.append(
                StageCost(
                    s,
                    pipe.meshes[s].devices,
                    stages[s].cost(),
                    loss.cost() if s == last else None,
                    reducers[s].cost(),
                    gathers[s].cost() if s in gathers else None,
                    pipe.microbatches,
                    sum(shard_bytes(layout.where(k, s), shapes[k].dtype) for k in split.owned(s)),
                    sum(shard_bytes(layout.where(k, s), shapes[k].dtype) for k in gathered),
                    sum(shard_bytes(layout.where(k, s), shapes[k].dtype) for k in split.borrowed(s)),
                    held,
                    in_flight(actions[s]),
                    tuple(x for x in step_sends if x.src == s),
                )
            )
    return PipelineLowered(
        pipe.mesh,
        pipe.axis,
        pipe.schedule,
        pipe.microbatches,
        pipe.prefixes,
        stages,
        loss,
        reducers,
        gathers,
        costs,
        step_sends,
    )


def _stage_lowered(
    pipe: Any,
    layout: Layout,
    s: int,
    ins: Sequence[Boundary],
    dtypes: Sequence[torch.dtype],
    out: NamedSharding,
    split: Split,
    gathered: dict[str, Any],
) -> tuple[Lowered, Lowered | None, Lowered]:
    """Stage ``s``'s programs, its params computed on split as ``split`` says: a microbatch's (inputs
    ``ins`` of ``dtypes``, output laid out ``out``), the gather of the params ``gathered`` (their values;
    ``None`` if none) and the reduction, both once a step."""
    shapes, names = layout.shapes, layout.split.names[s]
    gather = pipe._gather(layout, s, split).lower(gathered) if gathered else None
    weights = {
        k: stand_in((pipe._held(layout, k, s, split), shapes[k].shape), shapes[k].dtype, grad=True) for k in names
    }
    xs = [stand_in(where, d, grad=s > 0) for where, d in zip(ins, dtypes)]
    program = pipe._program(s, out).lower(weights, *xs)
    grads = program.grad_shardings[0][0]  # as the backward leaves them: unreduced over dp
    summed = {k: stand_in((grads[k] or layout.where(k, s)[0], shapes[k].shape), shapes[k].dtype) for k in names}
    return program, gather, pipe._reducer(layout, s).lower(summed)


def sends(pipe: Any, layout: Layout, bounds: Bounds) -> list[Send]:
    """Every transfer over ``pp`` of ``pipe``'s step, in the order of the step: the tied params lent,
    each stage's output to the next and its gradient back (once per microbatch), the tied
    params' gradients returned to their owner, and the loss sent from the last stage to the
    other pp ranks.

    Example::

        >>> [(s.what, s.src, s.dst) for s in sends(pipe, layout, boundaries(pipe, layout, (idx,)))][:1]
        [('tied wte.weight', 0, 1)]
    """
    m, last, p = pipe.microbatches, pipe.num_stages - 1, pipe.mesh.axis_size(pipe.axis)
    split, shapes = layout.split, layout.shapes
    out = []
    tied = [
        (k, split.owner[k], b)
        for k in pipe.tied
        for b in split.users[k][1:]
        if pipe.rank_of(split.owner[k]) != pipe.rank_of(b)
    ]  # (not between a rank's own stages)
    shard = lambda k, b: layout.where(k, b)[0].shard_shape(shapes[k].shape)  # noqa: E731
    out += [send(f"tied {k}", owner, b, shard(k, b), shapes[k].dtype, 1) for k, owner, b in tied]
    apart = [s for s in range(last) if pipe.rank_of(s) != pipe.rank_of(s + 1)]  # (a V's turn stays on its rank)
    for s in apart:
        (where, shape), dtype = bounds[s][1], bounds[s][2]
        out.append(send("activation", s, s + 1, where.shard_shape(shape), dtype, m))
    for s in reversed(apart):
        (where, shape), dtype = bounds[s][1], bounds[s][2]
        out.append(send("activation gradient", s + 1, s, where.shard_shape(shape), dtype, m))
    out += [send(f"gradient of tied {k}", b, owner, shard(k, b), shapes[k].dtype, 1) for k, owner, b in tied]
    out += [
        send("loss", last, r, (), bounds[last][2], 1) for r in range(p) if r != pipe.rank_of(last)
    ]  # (to each other pp rank, its first stage)
    return out


def boundaries(pipe: Any, layout: Layout, inputs: tuple[torch.Tensor, ...]) -> Bounds:
    """Each stage's input and output layouts and global microbatch shapes, and its output's
    dtype, from ``pipe``'s stage functions run on shapes (``vsf.eval_shape``), and its params its
    program computes on split over the batch's axes (:func:`split_params`); cached on ``pipe``
    per layout and input signature.

    Example::

        >>> ins, (out, shape), dtype, split = boundaries(pipe, layout, (idx,))[0]
    """
    key = (layout, tuple((tuple(x.shape), x.dtype) for x in inputs))
    if key not in pipe._bounds:
        pipe._bounds[key] = _trace_boundaries(pipe, layout, inputs)
    return pipe._bounds[key]


def _trace_boundaries(pipe: Any, layout: Layout, inputs: tuple[torch.Tensor, ...]) -> Bounds:
    m = pipe.microbatches
    mb = lambda x: ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype)  # noqa: E731
    current = [mb(x) for x in inputs]
    out = []
    for s, fn in enumerate(pipe.stages):
        mesh = pipe.meshes[s]
        spec = PartitionSpec(*pipe.batch) if s == 0 else pipe.activations
        ins = [(NamedSharding(mesh, first_entries(spec, len(c.shape))), tuple(c.shape)) for c in current]
        p = {k: layout.shapes[k] for k in layout.split.names[s]}
        y = eval_shape(fn, p, *current)
        act = NamedSharding(mesh, first_entries(pipe.activations, len(y.shape)))
        out.append(
            (ins, (act, tuple(y.shape)), y.dtype, split_params(pipe, layout, s, ins, [c.dtype for c in current], act))
        )
        current = [y]
    return out


def split_params(
    pipe: Any, layout: Layout, s: int, ins: Sequence[Boundary], dtypes: Sequence[torch.dtype], out: NamedSharding
) -> Split:
    """Stage ``s``'s params that its program computes on split over some of the batch's axes, with
    those axes: an expert-parallel dispatch's experts over ep, which the pipeline leaves split
    there instead of gathering them once a step (``Traced.split_inputs`` of the stage function
    traced with its params in their own layout, its inputs ``ins`` of ``dtypes``), where that sends
    fewer bytes a step than gathering them once a step (the stage's programs planned both ways: a
    microbatch's, run ``microbatches`` times, the gather and the reduction once; tiny experts under
    many tokens are gathered) or where gathered they have no plan (a ``PlanError``: the code the
    dispatch replaces runs an op with no sharding strategy, as torchtitan's combine). No trace, and
    none, where no param is split over the batch's axes, with ``reshard_after_forward``, or for a
    stage this process does not compute.

    Example::

        >>> split_params(pipe, layout, 0, ins, [torch.int64], act)
        {'model.layers.0.mlp.experts.gate_up_proj': ('ep',), 'model.layers.0.mlp.experts.down_proj': ('ep',)}
    """
    names = layout.split.names[s]
    over_batch = any(set(PartitionSpec(*pipe.batch).axes) & set(layout.specs[k].axes) for k in names)
    if pipe.reshard_after_forward or s not in pipe.local_stages() or not over_batch:
        return {}
    weights = {k: stand_in(layout.where(k, s), layout.shapes[k].dtype) for k in names}
    traced = pipe._program(s, out).trace(weights, *(stand_in(where, d) for where, d in zip(ins, dtypes)))
    order = leaf_names(weights)
    found = {order[i]: axes for i, axes in traced.split_inputs.items() if i < len(order)}
    if not found:
        return {}

    def step_bytes(split: Split) -> int:  # what the stage's ranks send a step (as StageCost.comm_bytes counts)
        gathered = {k: stand_in(layout.where(k, s), layout.shapes[k].dtype) for k in pipe._gathered(layout, s, split)}
        program, gather, reducer = _stage_lowered(pipe, layout, s, ins, dtypes, out, split, gathered)
        once = sum(sum(c.cost().comm_bytes.values()) for c in (reducer, gather) if c is not None)
        return pipe.microbatches * sum(program.cost().comm_bytes.values()) + once

    try:
        return found if step_bytes(found) <= step_bytes({}) else {}
    except PlanError:  # the gathered experts' (a dispatch's own plan fails alike when its stage is lowered)
        return found
