"""Reading a pipeline's plan without running it: each stage's planned programs, the sends between
stages over ``pp`` (shape, dtype, bytes per microbatch and per step), and each stage's memory.

``Pipeline.lower(params, inputs, targets, layout=layout)`` (:func:`lower_step`) returns a
:class:`~vsf.pipeline.report.PipelineLowered`, the pipeline's
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

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vsf import tree
from vsf.abstract import ShapeDtypeStruct, eval_shape
from vsf.errors import PlanError
from vsf.jit import Lowered
from vsf.jit.graph import placeholders_of
from vsf.pipeline.report import PipelineLowered, Send, StageCost, send
from vsf.pipeline.split import Layout, leaf_names
from vsf.pipeline import state as stage_state
from vsf.pipeline.stage import Boundary, shard_bytes, stand_in
from vsf.sharding.named import NamedSharding
from vsf.sharding.spec import PartitionSpec

__all__ = [
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


def lower_step(
    pipe: Any, layout: Layout, params: Any, inputs: Any, targets: Any, state: Layout | None = None
) -> PipelineLowered:
    """``pipe.lower(params, inputs, targets, layout=layout)``: plan each stage this process computes
    (its microbatch's programs, its once-a-step gather and reduction, the loss program on the
    last), the sends between stages, and each stage's cost, without running or sending anything.
    ``pipe`` is the :class:`~vsf.pipeline.api.Pipeline`, whose cached programs the step reuses;
    ``state``: the layout of the state its stages write (``None``: none).

    Example::

        >>> lowered = lower_step(pipe, layout, params, idx, targets)
        >>> lowered.cost().stages[0].comm_bytes["pp"]
    """
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    targets = targets if isinstance(targets, tuple) else (targets,)
    values = dict(zip(leaf_names(params), tree.leaves(params)))
    split, shapes = layout.split, layout.shapes
    bounds = boundaries(pipe, layout, inputs, state)
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
            stages[s], gather, reducers[s] = _stage_lowered(
                pipe, layout, s, ins, dtypes, out[0], split_params, vals, state
            )
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
    state: Layout | None,
) -> tuple[Lowered, Lowered | None, Lowered]:
    """Stage ``s``'s programs, its params computed on split as ``split`` says: a microbatch's (inputs
    ``ins`` of ``dtypes``, output laid out ``out``, the ``state`` it writes), the gather of the params
    ``gathered`` (their values; ``None`` if none) and the reduction, both once a step."""
    shapes, names = layout.shapes, layout.split.names[s]
    gather = pipe._gather(layout, s, split).lower(gathered) if gathered else None
    weights = {
        k: stand_in((pipe._held(layout, k, s, split), shapes[k].shape), shapes[k].dtype, grad=True) for k in names
    }
    xs = [stand_in(where, d, grad=s > 0) for where, d in zip(ins, dtypes)]
    program = pipe._program(s, out, stage_state.where(state, s)).lower(weights, *stage_state.stand_ins(state, s), *xs)
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


def boundaries(pipe: Any, layout: Layout, inputs: tuple[torch.Tensor, ...], state: Layout | None = None) -> Bounds:
    """Each stage's input and output layouts and global microbatch shapes, and its output's
    dtype, from ``pipe``'s stage functions run on shapes (``vsf.eval_shape``; with the ``state``
    laid out so, if any), and its params its program computes on split over the batch's axes
    (:func:`split_params`); cached on ``pipe`` per layout, state layout and input signature.

    Example::

        >>> ins, (out, shape), dtype, split = boundaries(pipe, layout, (idx,))[0]
    """
    key = (layout, state, tuple((tuple(x.shape), x.dtype) for x in inputs))
    if key not in pipe._bounds:
        pipe._bounds[key] = _trace_boundaries(pipe, layout, inputs, state)
    return pipe._bounds[key]


def _trace_boundaries(pipe: Any, layout: Layout, inputs: tuple[torch.Tensor, ...], state: Layout | None) -> Bounds:
    m = pipe.microbatches
    mb = lambda x: ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype)  # noqa: E731
    current = [mb(x) for x in inputs]
    out = []
    for s, fn in enumerate(pipe.stages):
        mesh = pipe.meshes[s]
        spec = PartitionSpec(*pipe.batch) if s == 0 else pipe.activations
        ins = [(NamedSharding(mesh, first_entries(spec, len(c.shape))), tuple(c.shape)) for c in current]
        p = {k: layout.shapes[k] for k in layout.split.names[s]}
        fn = fn if state is None else stage_state.with_state(fn, s)
        y = eval_shape(fn, p, *stage_state.shapes(state, s), *current)
        y = y if state is None else y[0]
        act = NamedSharding(mesh, first_entries(pipe.activations, len(y.shape)))
        dtypes = [c.dtype for c in current]
        out.append((ins, (act, tuple(y.shape)), y.dtype, split_params(pipe, layout, s, ins, dtypes, act, state)))
        current = [y]
    return out


def split_params(
    pipe: Any,
    layout: Layout,
    s: int,
    ins: Sequence[Boundary],
    dtypes: Sequence[torch.dtype],
    out: NamedSharding,
    state: Layout | None = None,
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
    stage this process does not compute. ``state``: the layout of the state the stages write, if any.

    Example::

        >>> split_params(pipe, layout, 0, ins, [torch.int64], act)
        {'model.layers.0.mlp.experts.gate_up_proj': ('ep',), 'model.layers.0.mlp.experts.down_proj': ('ep',)}
    """
    names = layout.split.names[s]
    over_batch = any(set(PartitionSpec(*pipe.batch).axes) & set(layout.specs[k].axes) for k in names)
    if pipe.reshard_after_forward or s not in pipe.local_stages() or not over_batch:
        return {}
    weights = {k: stand_in(layout.where(k, s), layout.shapes[k].dtype) for k in names}
    xs = [stand_in(where, d) for where, d in zip(ins, dtypes)]
    traced = pipe._program(s, out, stage_state.where(state, s)).trace(weights, *stage_state.stand_ins(state, s), *xs)
    order = leaf_names(weights)
    found = {order[i]: axes for i, axes in traced.split_inputs.items() if i < len(order)}
    if not found:
        return {}

    def step_bytes(split: Split) -> int:  # what the stage's ranks send a step (as StageCost.comm_bytes counts)
        gathered = {k: stand_in(layout.where(k, s), layout.shapes[k].dtype) for k in pipe._gathered(layout, s, split)}
        program, gather, reducer = _stage_lowered(pipe, layout, s, ins, dtypes, out, split, gathered, state)
        once = sum(sum(c.cost().comm_bytes.values()) for c in (reducer, gather) if c is not None)
        return pipe.microbatches * sum(program.cost().comm_bytes.values()) + once

    try:
        return found if step_bytes(found) <= step_bytes({}) else {}
    except PlanError:  # the gathered experts' (a dispatch's own plan fails alike when its stage is lowered)
        return found
