"""A jitted call that torch autograd differentiates: its joint graph (:mod:`vsf.jit.joint`) planned
once and split (:mod:`vsf.jit.partition`) by :func:`plan_joint`, and one ``torch.autograd.Function``
whose forward runs the forward program and whose backward runs the backward program, with the
saved values handed from one to the other.

Cotangents that arrive in another layout than the plan's are redistributed once, before the
backward program runs; an output whose cotangent does not arrive gets zeros. A DTensor input's
gradient comes back as a DTensor with the input's placements (the plan reduces it once, where it
says), or, for an input named by ``unreduced``, unreduced on the axes it is replicated on where
the plan holds it as a partial sum there (the caller reduces it, once for many calls); a plain
tensor input's gradient as a plain tensor.

Example::

    >>> jp = plan_joint(fun, mesh, inputs, leaves, rebuild, grad_mask(leaves), traced, out_targets, PlanOptions())
    >>> outs = attach(program(name, jp, leaves, layouts, metas, run), leaves, locals_in, check=False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat
from vsf.config import PlanOptions
from vsf.errors import HigherOrderGradError
from vsf.jit.classify import never_planned_decompositions, unplanned_ops
from vsf.jit.graph import output_node
from vsf.jit.joint import Joint, trace_joint
from vsf.jit.partition import Partitioned, SplitBackward, partition, split_backward
from vsf.jit.plan import Placements, Plan, is_shard, to_placements
from vsf.jit.propagate import propagate
from vsf.jit.trace import Traced
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding, from_placements, sharding_of
from vsf.sharding.put import device_put
from vsf.sharding.spec import PartitionSpec

__all__ = ["JointPlan", "Program", "attach", "grad_mask", "grad_shardings", "plan_joint", "program"]


Run = Callable[[int, list[torch.Tensor], bool], list[torch.Tensor]]  # (0 forward / 1 backward, locals, check) -> locals


@dataclasses.dataclass(frozen=True)
class JointPlan:
    """A call's joint graph planned once (``plan``) and split into its two programs (``parts``);
    ``with_grad``: the leaves (indices into the call's leaves) that get a gradient."""

    plan: Plan
    parts: Partitioned
    joint: Joint
    with_grad: tuple[int, ...]


def grad_mask(leaves: Sequence[Any]) -> tuple[Any, ...] | None:
    """Per leaf of a call, the layout its gradient comes back in (a DTensor's placements, ``"T"``
    for a plain tensor) if torch autograd differentiates the call with respect to it, else
    ``None``; ``None`` for the whole call when grad mode is off, no floating tensor requires grad,
    or the call is being traced (a jitted function called inside a trace is traced into it).

    Example::

        >>> grad_mask([w.requires_grad_(), torch.ones(3), 2.0])   # w a DTensor on a 2-rank mesh
        ((Shard(dim=0),), None, None)
    """
    if not torch.is_grad_enabled():
        return None
    wanted = [
        isinstance(x, torch.Tensor) and x.requires_grad and (x.is_floating_point() or x.is_complex()) for x in leaves
    ]
    if not any(wanted) or any(isinstance(x, torch.Tensor) and _compat.is_fake(x) for x in leaves):
        return None
    return tuple(
        (tuple(x.placements) if isinstance(x, DTensor) else "T") if w else None for x, w in zip(leaves, wanted)
    )


def plan_joint(
    fun: Callable[..., Any],
    mesh: Mesh,
    inputs: Sequence[DTensor],
    leaves: Sequence[Any],
    rebuild: Callable[[list[torch.Tensor]], tuple[tuple[Any, ...], dict[str, Any]]],
    grad: Sequence[Any],
    traced: Traced,
    out_targets: Sequence[NamedSharding | None],
    options: PlanOptions,
    unreduced: Sequence[int] = (),
    unsharded: Sequence[str] = (),
    reduce_dtype: torch.dtype | None = None,
    names: Callable[[int], str] = lambda i: f"input #{i}",
) -> JointPlan | None:
    """Trace ``fun``'s joint graph for a call (its ``inputs`` as DTensors, its ``leaves`` as passed,
    ``grad`` from :func:`grad_mask`), plan it once and split it; ``traced`` is the forward alone and
    ``out_targets`` the outputs' shardings where ``jit`` fixes them. ``None`` when no output depends
    on an input that requires grad (the call then runs as any other).

    Every output's sharding is fixed before the joint graph is planned, since its cotangent is
    planned to arrive in it: ``out_shardings`` or a carried argument's, a scalar replicated, any other
    as the forward alone is planned. Each gradient is planned to end in its input's sharding
    (a plain tensor's: replicated), or for a DTensor leaf in ``unreduced`` (indices into
    ``leaves``) an unreduced sum where the plan holds it so, on the axes that sharding replicates
    and on the ``unsharded`` axes it splits (a param the plan gathers there: its gradient whole and
    unreduced; one the plan computes with split there, an expert's whose tokens came to it, keeps
    its split gradient). ``reduce_dtype``: as ``vsf.jit``'s; ``names``: the inputs' names (``args[0]['w']``), for
    messages."""
    in_placements = [tuple(x.placements) for x in inputs]
    out_metas = [n.meta["val"] for n in _compat.torch_tree_leaves(output_node(traced.graph).args)]
    targets = _output_shardings(mesh, traced, in_placements, out_metas, out_targets, options)
    avals = [(tuple(x.shape), x.dtype) for x in inputs]
    mask = [g is not None for g in grad]
    joint = trace_joint(
        fun,
        avals,
        rebuild,
        mask,
        [(tuple(m.shape), m.dtype) for m in out_metas],
        mesh.device_type,
        unplanned_ops,
        never_planned_decompositions(),
        allow_unkeyed_random=options.allow_unkeyed_random,
        shardings=[sharding_of(x) for x in inputs],
        names=names,
        options=options,
    )
    if not any(joint.differentiable):
        return None
    with_grad = tuple(i for i, h in zip((i for i, m in enumerate(mask) if m), joint.has_grad) if h)
    grad_targets = [_grad_target(mesh, leaves[i]) for i in with_grad]
    may_stay = [
        _replicated_axes(mesh, leaves[i]) + _split_axes(mesh, leaves[i], unsharded) if i in unreduced else ()
        for i in with_grad
    ]
    plan = propagate(
        joint.traced.graph,
        mesh,
        in_placements + [to_placements(t) for t in targets],
        targets + grad_targets,
        options,
        unreduced=[()] * len(targets) + may_stay,
        reduce_dtype=reduce_dtype,
    )
    parts = partition(plan, len(avals), len(out_metas), [j for j, d in enumerate(joint.differentiable) if d])
    return JointPlan(plan, parts, joint, with_grad)


def _grad_target(mesh: Mesh, leaf: Any) -> NamedSharding:
    """The sharding a leaf's gradient is planned to end in: the leaf's (a plain tensor's: replicated)."""
    return sharding_of(leaf) if isinstance(leaf, DTensor) else NamedSharding(mesh, PartitionSpec())


def _split_axes(mesh: Mesh, leaf: Any, axes: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes among ``axes`` that split a DTensor leaf."""
    if not isinstance(leaf, DTensor):
        return ()
    return tuple(a for a, p in zip(mesh.device_axes, leaf.placements) if a in axes and is_shard(p))


def _replicated_axes(mesh: Mesh, leaf: Any) -> tuple[str, ...]:
    """The mesh axes a DTensor leaf is replicated on (none for a plain tensor)."""
    if not isinstance(leaf, DTensor):
        return ()
    return tuple(a for a, p in zip(mesh.device_axes, leaf.placements) if p.is_replicate())


def grad_shardings(jp: JointPlan, leaves: Sequence[Any]) -> list[NamedSharding | None]:
    """Per leaf of the call planned as ``jp``, the sharding its gradient comes back in if it is a
    DTensor that gets one (unreduced axes: a partial sum there), else ``None``.

    Example::

        >>> grad_shardings(jp, [w, x, 2.0])   # w replicated, x split over dp, w in ``unreduced``
        [NamedSharding(mesh, P(unreduced=('dp',))), NamedSharding(mesh, P('dp')), None]
    """
    grads = dict(zip(jp.with_grad, jp.plan.outputs[jp.joint.n_outputs :]))
    return [
        from_placements(jp.plan.mesh, grads[i], x.ndim) if i in grads and isinstance(x, DTensor) else None
        for i, x in enumerate(leaves)
    ]


def _output_shardings(
    mesh: Mesh,
    traced: Traced,
    in_placements: list[Placements],
    out_metas: list[torch.Tensor],
    out_targets: Sequence[NamedSharding | None],
    options: PlanOptions,
) -> list[NamedSharding]:
    fixed = [
        t if t is not None or m.ndim else NamedSharding(mesh, PartitionSpec()) for t, m in zip(out_targets, out_metas)
    ]
    if all(t is not None for t in fixed):
        return fixed
    alone = propagate(traced.graph, mesh, in_placements, fixed, options)
    return [
        t if t is not None else from_placements(mesh, pl, m.ndim) for t, pl, m in zip(fixed, alone.outputs, out_metas)
    ]


@dataclasses.dataclass
class Program:
    """What the autograd function needs: the partitioned plan, the DTensor layout and (shape,
    dtype) of every output, which outputs are differentiable, and for every tensor leaf of the call
    whether it gets a gradient and the layout it comes back in (``None``: a plain tensor); with
    deferred gradients, the backward ``split`` in two, the tensor leaves whose gradients the
    second part computes (``split.rest`` order) and the ``sink`` that gets each call's second
    part. ``run(k, locals, check)`` runs the forward (``k = 0``), the backward (1), or the split's
    first (2) or second part (3)."""

    name: str
    parts: Partitioned
    out_layouts: list[Any]
    out_avals: list[tuple[tuple[int, ...], torch.dtype]]
    differentiable: tuple[bool, ...]
    gets_grad: tuple[bool, ...]
    grad_layouts: list[Any]
    split: SplitBackward | None = None
    deferred: tuple[int, ...] = ()
    deferred_names: tuple[str, ...] = ()
    sink: Callable[[Callable[[], None]], None] | None = None
    run: Run | None = None


def program(
    name: str,
    jp: JointPlan,
    leaves: Sequence[Any],
    out_layouts: list[Any],
    out_metas: Sequence[torch.Tensor],
    deferred: Sequence[int] = (),
    sink: Callable[[Callable[[], None]], None] | None = None,
    names: Sequence[str] = (),
) -> Program:
    """The :class:`Program` of a call of ``name`` planned as ``jp`` (``out_layouts``: its outputs'
    DTensor layouts), the gradients of the leaves ``deferred`` (indices into ``leaves``, whose
    ``names`` its errors give) left to ``sink`` (see ``vsf.jit``'s ``deferred_grad_argnums``);
    its ``run`` is set by the caller."""
    n_out = jp.joint.n_outputs
    grad_metas = [n.meta["val"] for n in _compat.torch_tree_leaves(output_node(jp.joint.traced.graph).args)][n_out:]
    dm = jp.plan.mesh.device_mesh
    layouts = {
        i: _compat.dtensor_layout(dm, pl, m) if isinstance(leaves[i], DTensor) else None
        for i, pl, m in zip(jp.with_grad, jp.plan.outputs[n_out:], grad_metas)
    }
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    later = [k for k, i in enumerate(jp.with_grad) if i in deferred]
    split = (
        split_backward(jp.parts.backward, [k for k in range(len(jp.with_grad)) if k not in later]) if later else None
    )
    return Program(
        name,
        jp.parts,
        out_layouts,
        [(tuple(m.shape), m.dtype) for m in out_metas],
        jp.joint.differentiable,
        tuple(i in layouts for i in tensors),
        [layouts.get(i) for i in tensors],
        split,
        tuple(tensors.index(jp.with_grad[k]) for k in later),
        tuple(names[jp.with_grad[k]] for k in later) if names else (),
        sink,
    )


def attach(
    program: Program, leaves: Sequence[torch.Tensor], locals_in: list[torch.Tensor], check: bool
) -> list[DTensor]:
    """Run ``program``'s forward on ``locals_in`` and return its outputs attached to autograd's
    graph through ``leaves`` (the call's tensor leaves, as the caller passed them)."""
    return list(_Jitted.apply(program, locals_in, check, *leaves))


class _Jitted(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, program: Program, locals_in: list[torch.Tensor], check: bool, *leaves: torch.Tensor
    ) -> tuple[DTensor, ...]:
        ctx.set_materialize_grads(False)
        n = len(program.out_layouts)
        result = program.run(0, locals_in, check)
        ctx.program, ctx.check = program, check
        ctx.deferred = [leaves[t] for t in program.deferred]
        for name, leaf in zip(program.deferred_names, ctx.deferred):
            if not leaf.is_leaf:
                raise ValueError(
                    f"{program.name}: {name} has its gradient deferred (deferred_grad_argnums), so it must be an autograd leaf "
                    f"(a param, whose .grad gets it), but it was computed by torch ops (grad_fn {type(leaf.grad_fn).__name__})"
                )
        ctx.save_for_backward(*result[n:])
        outs = tuple(_compat.dtensors_from_locals(result[:n], program.out_layouts))
        ctx.mark_non_differentiable(*(o for o, d in zip(outs, program.differentiable) if not d))
        return outs

    @staticmethod
    def backward(ctx: Any, *cotangents: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        program: Program = ctx.program
        if torch.is_grad_enabled():
            raise HigherOrderGradError(
                f"vsf.jit: a gradient of {program.name}'s gradient was asked for (backward with create_graph=True, "
                "or torch.autograd.grad of a gradient): higher-order gradients through a jitted function are not "
                "supported; differentiate inside it with vsf.grad instead"
            )
        plan = program.parts.backward
        saved = list(ctx.saved_tensors)
        live = program.parts.live
        wanted = plan.inputs[len(saved) :]
        tangents = [_as_planned(cotangents[j], plan.mesh, wanted[k], program.out_avals[j]) for k, j in enumerate(live)]
        if program.split is None:
            grads = iter(program.run(1, saved + tangents, ctx.check))
        else:
            grads = iter(_deferring(program, saved + tangents, ctx.deferred, ctx.check))
        out: list[torch.Tensor | None] = [None, None, None]
        for gets, layout in zip(program.gets_grad, program.grad_layouts):
            g = next(grads) if gets else None
            out.append(None if g is None else g if layout is None else _compat.dtensor_from_local(g, layout))
        return tuple(out)


def _deferring(
    program: Program, inputs: list[torch.Tensor], leaves: list[torch.Tensor], check: bool
) -> list[torch.Tensor | None]:
    """The backward's gradients with the deferred ones ``None``: its split's first part run now,
    and ``program.sink`` handed the second part, which adds the others into ``leaves``' ``.grad``
    (holding ``inputs`` and the first part's stash until it runs)."""
    split = program.split
    head = program.run(2, inputs, check)
    now = dict(zip(split.first, head[: len(split.first)]))
    stash = head[len(split.first) :]
    layouts = [program.grad_layouts[t] for t in program.deferred]

    def weights() -> None:
        for leaf, g, layout in zip(leaves, program.run(3, stash + inputs, check), layouts):
            g = g if layout is None else _compat.dtensor_from_local(g, layout)
            with torch.no_grad():
                leaf.grad = g if leaf.grad is None else leaf.grad + g

    program.sink(weights)
    return [now.get(k) for k in range(len(split.first) + len(split.rest))]


def _as_planned(
    g: torch.Tensor | None, mesh: Any, want: Placements, aval: tuple[tuple[int, ...], torch.dtype]
) -> torch.Tensor:
    """A cotangent as the local shard of the layout the backward program takes it in (``want``):
    redistributed once if it arrives otherwise, zeros if it does not arrive."""
    if isinstance(g, DTensor) and tuple(g.placements) == tuple(want):
        return _compat.dtensor_local(g)
    if g is None:
        g = torch.zeros(aval[0], dtype=aval[1])
    with _compat.quiet_redistribute():
        return _compat.dtensor_local(device_put(g, from_placements(mesh, want, len(aval[0]))))
