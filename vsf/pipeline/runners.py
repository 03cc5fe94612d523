"""Running one step's schedule over a pipeline's stages: played in this process in the schedule's
order (every stage here: ``vsf.simulate``, or a one-rank ``pp``), or by torch's own schedules
(``torch.distributed.pipelining``) over the ``pp`` process groups, this process running its stages.

Both take the stages as :class:`~vsf.pipeline.stage.StageModule` s (local tensors in and out),
the first stage's inputs and the last stage's targets as ``microbatches`` local pieces each, and
return the last stage's per-microbatch losses (empty on the other ranks); torch autograd leaves
each stage's gradients, summed over the microbatches, in its weights' ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vsf.pipeline import schedule as sched
from vsf.pipeline.stage import StageModule, as_global, local_of
from vsf.sharding.mesh import Mesh

__all__ = ["loss_local", "run_in_order", "run_torch"]


def run_in_order(
    actions: list[list[sched.Step]],
    mods: dict[int, StageModule],
    xs: list[list[torch.Tensor]],
    ts: list[list[torch.Tensor]],
    deferred: dict[int, list[Callable[[], None]]],
) -> tuple[list[torch.Tensor], list[sched.Step]]:
    """The schedule ``actions`` (each pp rank's, see :func:`~vsf.pipeline.schedule.rank_actions`)
    played in this process, every stage in ``mods``: the losses and the order the steps ran in.
    ``deferred[s]``: where stage ``s``'s program leaves its backwards' weight parts (a zero-bubble
    schedule: an ``"I"`` action's backward leaves one, its ``"W"`` action runs it, a ``"B"`` action
    runs its own at once).

    Example::

        >>> losses, order = run_in_order(pipe.actions(), mods, xs, ts, {})
    """
    last = len(mods) - 1
    inbox: dict[tuple[int, int], list[torch.Tensor]] = {}
    grads_in: dict[tuple[int, int], torch.Tensor] = {}
    kept: dict[tuple[int, int], tuple[list[torch.Tensor], torch.Tensor]] = {}
    losses: dict[int, torch.Tensor] = {}
    weights: dict[tuple[int, int], Callable[[], None]] = {}

    def run(s: int, kind: str, mb: int) -> None:
        mod = mods[s]
        if kind == "F":
            x = [piece[mb] for piece in xs] if s == 0 else inbox.pop((s, mb))
            y = mod(*x)
            if s == last:
                y = loss_local(mod, y, [piece[mb] for piece in ts])
                losses[mb] = y.detach()
            else:
                inbox[(s + 1, mb)] = [y.detach().requires_grad_(True)]
            kept[(s, mb)] = (x, y)
            return
        if kind == "W":
            weights.pop((s, mb))()
            return
        x, y = kept.pop((s, mb))
        torch.autograd.backward(y, None if s == last else grads_in.pop((s, mb)))
        if s > 0:
            grads_in[(s - 1, mb)] = x[0].grad
        if kind == "I":
            weights[(s, mb)] = deferred[s].pop(0)
        elif deferred.get(s):  # a full backward under a zero-bubble schedule: its weight part now
            deferred[s].pop(0)()

    order = sched.run_in_order(actions, run)
    return [losses[mb] for mb in sorted(losses)], order


def run_torch(
    mods: dict[int, StageModule],
    xs: list[list[torch.Tensor]],
    ts: list[list[torch.Tensor]],
    mesh: Mesh,
    axis: str,
    schedule: sched.ScheduleName,
    num_stages: int,
    microbatches: int,
    deferred: dict[int, list[Callable[[], None]]],
) -> list[torch.Tensor]:
    """This process's stages ``mods`` of torch's ``schedule`` over ``mesh``'s ``axis`` groups,
    talking to the other ranks over ``axis``: the losses (on the last stage's ranks). Under a
    zero-bubble schedule each stage's ``dw_builder`` (torch's hook for a weight backward of one's
    own) hands torch the weight part stage ``s``'s backward left in ``deferred[s]``.

    Example::

        >>> losses = run_torch(mods, xs, ts, mesh, "pp", "1f1b", 2, 4, {})
    """
    from torch.distributed.pipelining import PipelineStage

    last = num_stages - 1
    # static metadata (no shape inference round): each microbatch's local shards; a stage's
    # received activation needs a gradient (torch reads that off the example)
    device = (
        torch.device("cpu")
        if mesh.device_type == "cpu"
        else torch.device(mesh.device_type, torch.cuda.current_device())
    )
    group = mesh.device_mesh.get_group(axis)
    stages = []
    for s, mod in sorted(mods.items()):
        example_in = (
            tuple(torch.empty(sh.shard_shape(shape), device=device, requires_grad=True) for sh, shape in mod.ins)
            if s > 0
            else tuple(p[0] for p in xs)
        )
        example_out = torch.empty(mod.out.shard_shape(mod.out_shape), device=device, requires_grad=True)
        weight_part = (lambda s=s: deferred[s].pop(0)) if schedule in sched.DEFERRED else None
        stages.append(
            PipelineStage(
                mod,
                s,
                num_stages,
                device,
                input_args=example_in,
                output_args=example_out,
                group=group,
                dw_builder=weight_part,
            )
        )
    # every rank passes the loss (torch runs backward only where the schedule has one); only
    # the last stage calls it
    loss_fn = lambda y, t: loss_local(mods[last], y, [t])  # noqa: E731
    runner = sched.SCHEDULES[schedule](
        stages if len(stages) > 1 else stages[0], microbatches, loss_fn=loss_fn, scale_grads=False
    )
    losses: list[torch.Tensor] = []
    whole = lambda pieces: torch.cat(pieces)  # noqa: E731 (torch splits them again, the same way)
    inputs = [whole(p) for p in xs] if 0 in mods else []
    if last in mods:
        runner.step(*inputs, target=whole(ts[0]), losses=losses)
    else:
        runner.step(*inputs)
    return losses


def loss_local(mod: StageModule, y: torch.Tensor, targets: list[torch.Tensor]) -> torch.Tensor:
    """``loss_fn`` of the last stage's local output and targets: the whole microbatch's mean loss,
    here (a replicated scalar's local value)."""
    loss = mod.loss_program(*[as_global(v, where) for v, where in zip([y, *targets], mod.loss_ins)])
    return local_of(loss, mod.loss_program.out_shardings)
