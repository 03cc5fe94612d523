"""``vsf.pipeline.Pipeline``: a model split into stages over the mesh's ``pp`` axis.

**The API, and why.** A pipeline is described the way optax describes an optimizer: a value
built once from small pure pieces, whose methods are pure functions of pytrees.

* The model is split by **stage functions over per-stage param subtrees**: ``stages[s](params_s,
  *x) -> y``, with ``params_s`` the leaves whose dotted key paths start with one of
  ``params[s]``'s prefixes (``"blocks.0."``). A function per stage says exactly what crosses the
  cut (one activation, or a tuple), works for any model written as a function of a params
  pytree (``vsf.tree.apply(module, ...)`` on a sub-module), and needs no rewriting of the model:
  a list of layer key paths alone cannot say how layers connect (GPT's embedding sum, its final
  norm and tied head). JAX's stacked-layer ``scan`` form is not offered: its backward is one
  reverse chain over the schedule, so 1F1B's bounded activation memory is out of reach.
* ``loss_fn(y, *targets)`` turns the last stage's output into the microbatch's mean loss; the
  step's loss is the mean over the ``microbatches`` equal microbatches, so gradients are their
  mean: exactly the one-device gradient of the whole batch's mean loss.
  Gradients are reduced once a step, as DDP reduces after its ``no_sync`` microbatches: a stage
  program's backward leaves a param's gradient unreduced over the axes the param is replicated on
  (``dp``: ``vsf.jit``'s ``unreduced_grad_argnums``) and whole over the batch's axes it is split on
  (``fsdp``: ``unsharded_grad_axes``, as torch's ``PipelineStage`` has an FSDP2 stage do), torch sums
  the microbatches' into ``.grad``, and one planned program per stage reduces them to their mean in buckets.
* Params split over the batch's axes (fsdp) are gathered once a step, before a stage's first
  microbatch, and kept gathered through the step, as FSDP2 is kept under torch's schedules
  (torchtitan's ``reshard_after_forward=False`` with ``pp``; ``PipelineStage`` turns
  ``reshard_after_backward`` off until the last microbatch): one all-gather and one reduce-scatter
  a step, for the memory of the stage's gathered params. ``reshard_after_forward=True`` gathers them
  in each microbatch's programs instead (``m`` times the all-gathers, a microbatch's memory).
  Params the stage's program computes on split over a batch axis stay split there: a MoE layer's
  experts ``P("ep")`` with the batch over ep, to which each microbatch's tokens are sent (expert
  parallelism; :func:`vsf.pipeline.lower.split_params` finds them by tracing the stage once), where
  that sends fewer bytes a step than gathering them once a step (both planned: tiny experts under
  many tokens are gathered).
* ``schedule`` is ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb"``, ``"zbv"`` or
  ``"dualpipev"``: torch's ``ScheduleGPipe`` / ``Schedule1F1B`` (one stage per ``pp`` rank) /
  ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` (``v >= 2`` stages per rank: give
  ``v * p`` stage functions; stage ``s`` lives on pp coordinate ``s % p``) / ``ScheduleZBVZeroBubble``
  / ``ScheduleDualPipeV`` (two stages per rank in a V: give ``2p`` stage functions; stages ``s`` and
  ``2p - 1 - s`` live on coordinate ``s``, so the first and the last stage share rank 0) over the
  ``pp`` process groups on real processes; the same order played in one process under
  ``vsf.simulate``. Under the zero-bubble ones (``"zb"``, ``"zbv"``, ``"dualpipev"``) a stage
  program's backward is cut in two (``vsf.jit``'s ``deferred_grad_argnums``): its input part,
  which the previous stage waits for, and its params' part, which torch runs later
  (``dw_builder``) to fill the bubble, or at once for a full backward; the cut computes nothing twice.
* The train step stays ONE pure function: ``pipe.value_and_grad(params, inputs, targets, layout=layout)``
  stands where ``vsf.value_and_grad(loss)(params, batch)`` stood, and the optimizer update that
  follows is the usual ``tx.update`` / ``apply_updates``, applied where each param lives.
  ``params`` is the model's own tree; each leaf is a DTensor on the mesh of the stage that owns
  it (``mesh.at("pp", pipe.rank_of(s))``: ``vsf.NamedSharding`` and ``typeof`` show its ranks), laid out by the
  specs of the other axes (dp, fsdp, tp apply inside each stage). Under ``torchrun`` a rank holds
  only its own stage's leaves; the others are ``None`` there (an empty subtree, so ``tx.init``,
  ``tx.update`` and ``apply_updates`` work unchanged, and the optimizer state of a stage lives
  on its ranks only). ``clip_by_global_norm`` sums the squared norms over the stages (one
  all-reduce over ``pp``).
* State written in forward (buffers: a router's token counts) is a pytree placed like the params
  and carried through the microbatches; the step returns ``((loss, state), grads)``, as
  ``vsf.value_and_grad(..., has_aux=True)`` does (:mod:`vsf.pipeline.state`).
* Tied params (``tied=("wte.weight",)``) are held by the first stage naming them; each step the
  later stages that name them get a copy and their gradients are summed into the owner's
  (Megatron's rule), so the tree, the optimizer state and checkpoints hold one value.
* ``backend`` is ``vsf.jit``'s: ``"inductor"`` has Inductor compile every program of the step on
  its first call (each stage's forward and backward, the zero-bubble schedules' input and weight
  parts of it, the loss's, and the once-a-step gradient reduction and gather); under
  ``vsf.simulate`` they run as ``"eager"`` after one warning each, as any jitted program there.

Example::

    >>> pipe = vsf.pipeline.Pipeline([embed, head], loss, [["wte.", "wpe.", "blocks.0."], ["blocks.1.", "lnf.", "wte."]],
    ...                              mesh=mesh, microbatches=4, schedule="1f1b", batch=P("dp"), tied=("wte.weight",))
    >>> params, layout = pipe.place(params, specs)      # layout: which stage holds each leaf, its shape and spec
    >>> def train_step(params, opt_state, idx, targets):
    ...     loss, grads = pipe.value_and_grad(params, idx, targets, layout=layout)
    ...     updates, opt_state = tx.update(grads, opt_state, params)
    ...     return vsf.optim.apply_updates(params, updates), opt_state, loss
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vsf import runtime, tree
from vsf.abstract import ShapeDtypeStruct
from vsf.jit.runner import BACKENDS
from vsf.pipeline import runners
from vsf.pipeline import schedule as sched
from vsf.pipeline import state as stage_state
from vsf.pipeline import tied as tied_params
from vsf.pipeline.lower import Bounds, Split, boundaries, first_entries, lower_step
from vsf.pipeline.report import PipelineLowered
from vsf.pipeline.split import Layout, assign, leaf_names
from vsf.pipeline.stage import Boundary, StageModule, as_global, gather_program, mean_reducer, stage_program
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding, sharding_of
from vsf.sharding.put import device_put
from vsf.sharding.spec import PartitionSpec

__all__ = ["Pipeline"]


class Pipeline:
    """A model split into pipeline stages over ``mesh``'s ``axis`` (see the module docstring)."""

    def __init__(
        self,
        stages: Sequence[Callable[..., Any]],
        loss_fn: Callable[..., torch.Tensor],
        params: Sequence[Sequence[str]],
        *,
        mesh: Mesh,
        microbatches: int,
        schedule: sched.ScheduleName = "1f1b",
        batch: PartitionSpec = PartitionSpec(),
        activations: PartitionSpec | None = None,
        tied: Sequence[str] = (),
        axis: str = "pp",
        reshard_after_forward: bool = False,
        backend: str = "eager",
    ) -> None:
        if len(stages) != len(params):
            raise ValueError(
                f"{len(stages)} stage functions but {len(params)} lists of stage params; give one list of key-path prefixes per stage"
            )
        if axis not in mesh.axis_names:
            raise ValueError(f"the pipeline axis {axis!r} is not an axis of the mesh {mesh.shape}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} (vsf.jit's), got {backend!r}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        self.schedule = sched.check_schedule(schedule)
        self.stages_per_rank = sched.check_stages(self.schedule, len(stages), mesh.axis_size(axis), microbatches, axis)
        if axis in PartitionSpec(*batch).axes:
            raise ValueError(
                f"the batch spec {batch!r} splits over the pipeline axis {axis!r}; stages split the model, not the batch"
            )
        self.stages, self.loss_fn, self.prefixes, self.tied = (
            list(stages),
            loss_fn,
            [list(p) for p in params],
            tuple(tied),
        )
        self.mesh, self.axis, self.microbatches = mesh, axis, microbatches
        self.batch, self.reshard_after_forward, self.backend = batch, reshard_after_forward, backend
        self.activations = activations if activations is not None else PartitionSpec(batch[0] if len(batch) else None)
        self.meshes = [mesh.at(axis, self.rank_of(s)) for s in range(len(stages))]
        self.here = mesh.coordinate(runtime.rank())[axis] if runtime.rank() in mesh.devices else 0
        self._programs: dict[tuple[Any, ...], Any] = {}
        self._reducers: dict[tuple[Layout, int], Any] = {}
        self._gathers: dict[tuple[Any, ...], Any] = {}
        self._deferred: dict[
            int, list[Callable[[], None]]
        ] = {}  # stage -> its backwards' weight parts not yet run (a zero-bubble schedule)
        self._bounds: dict[tuple[Any, ...], Bounds] = {}  # lower.boundaries's cache

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def rank_of(self, stage: int) -> int:
        """The ``pp`` coordinate holding ``stage`` (:func:`vsf.pipeline.schedule.stage_rank`: ``s % p``,
        or for a V-shaped schedule stages ``s`` and ``2p - 1 - s`` on coordinate ``s``)."""
        return sched.stage_rank(self.schedule, stage, self.mesh.axis_size(self.axis))

    def local_stages(self) -> list[int]:
        """The stages this process computes: all of them under ``vsf.simulate`` (and with one
        stage), else those at this rank's ``pp`` coordinate (:meth:`rank_of`)."""
        return [s for s in range(self.num_stages) if self._in_one_process() or self.rank_of(s) == self.here]

    def actions(self) -> list[list[sched.Step]]:
        """Each pp rank's ``(stage, "F" | "B", microbatch)`` in the schedule's order (see
        :func:`vsf.pipeline.schedule.rank_actions`)."""
        return sched.rank_actions(self.schedule, self.mesh.axis_size(self.axis), self.num_stages, self.microbatches)

    def _in_one_process(self) -> bool:
        return runtime.is_simulated() or self.mesh.axis_size(self.axis) == 1

    # -- params ---------------------------------------------------------------------------------

    def place(
        self, params: dict[str, torch.Tensor], specs: Any = None, *, state: bool = False
    ) -> tuple[dict[str, torch.Tensor | None], Layout]:
        """Lay out ``params`` (every leaf, on every rank) on their stages: leaf ``k`` on the mesh of
        the stage that owns it, by ``specs`` (a pytree prefix of ``params`` of ``P`` over the other
        axes; default replicated). Leaves of stages this process does not compute are ``None``.
        Returns the placed params and their :meth:`layout`, which :meth:`value_and_grad` and
        :meth:`lower` take; the pipeline itself is left as it was. ``state=True`` places the state
        the stages' forwards write instead (buffers, the step's ``state``): by the same prefixes, a
        stage may hold none of it, and nothing is tied.

        Example::

            >>> params, layout = pipe.place(params, vsf.sharding.match(params, rules))
            >>> counts = pipe.place(vsf.tree.from_module(model, params=False, buffers=True), state=True)  # (tree, layout)
        """
        layout = self.layout(params, specs, state=state)
        mine = set(self.local_stages())
        names, leaves = leaf_names(params), tree.leaves(params)
        out = [
            device_put(v, layout.where(k, owner)[0]) if (owner := layout.split.owner[k]) in mine else None
            for k, v in zip(names, leaves)
        ]
        return tree.unflatten(tree.structure(params), out), layout

    def layout(self, params: Any, specs: Any = None, *, state: bool = False) -> Layout:
        """Where :meth:`place` lays ``params`` out (every leaf, tensors or ``ShapeDtypeStruct`` s):
        the stage that holds each leaf, its shape and its spec (``specs``, a pytree prefix of
        ``params`` of ``P`` over the other axes; default replicated), without placing anything
        (``state``: :meth:`place`'s).

        Example::

            >>> layout = pipe.layout(params, specs)          # e.g. beside a checkpoint restored into pipe.place's layout
            >>> layout.split.owner["lnf.weight"]
            1
        """
        split = assign(params, self.prefixes, () if state else self.tied, every_prefix=not state)
        names, leaves = leaf_names(params), tree.leaves(params)
        specs = tree.broadcast_prefix(
            specs if specs is not None else PartitionSpec(),
            params,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
            what="specs",
        )
        for k, spec in zip(names, specs):
            if self.axis in PartitionSpec(*spec).axes:
                raise ValueError(
                    f"param {k!r} has the spec {spec!r}, which splits over the pipeline axis {self.axis!r}; a stage's params live on its own pp coordinate"
                )
        return Layout(
            split,
            {k: ShapeDtypeStruct(tuple(v.shape), v.dtype) for k, v in zip(names, leaves)},
            dict(zip(names, specs)),
            tuple(self.meshes),
        )

    # -- the step -------------------------------------------------------------------------------

    def value_and_grad(
        self, params: Any, inputs: Any, targets: Any, *, layout: Layout, state: Any = None
    ) -> tuple[Any, Any]:
        """The mean loss of the batch and its gradient with respect to ``params``, computed
        microbatch by microbatch through the schedule. ``inputs`` go to the first stage,
        ``targets`` to ``loss_fn`` (a tensor or a tuple of tensors each; plain tensors holding the
        whole batch, or DTensors laid out by ``batch``). The loss is a replicated DTensor on this
        process's last stage mesh (every rank gets it); gradients have ``params``' structure
        (``None`` where ``params`` are), each on its param's mesh. ``layout`` is the one
        :meth:`place` returned with ``params``. With ``state``, the pair ``place(buffers,
        state=True)`` returns (the stages' buffers and their layout), the result is ``((loss,
        state), grads)``, the pair after the step's last microbatch (:mod:`vsf.pipeline.state`).

        Example::

            >>> loss, grads = pipe.value_and_grad(params, idx, targets, layout=layout)
            >>> (loss, counts), grads = pipe.value_and_grad(params, x, t, layout=layout, state=counts)
        """
        self._check_layout(layout, state)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        targets = targets if isinstance(targets, tuple) else (targets,)
        if len(targets) != 1 and not self._in_one_process():
            raise ValueError(
                f"torch's pipeline schedules pass one target to the loss; got {len(targets)} targets (stack them into one tensor)"
            )
        names, leaves = leaf_names(params), tree.leaves(params)
        values = dict(zip(names, leaves))
        first, last = 0, self.num_stages - 1
        xs = (
            [self._microbatches(x, first, f"inputs[{i}]") for i, x in enumerate(inputs)]
            if first in self.local_stages()
            else []
        )
        ts = (
            [self._microbatches(t, last, f"targets[{i}]") for i, t in enumerate(targets)]
            if last in self.local_stages()
            else []
        )
        mods = self._modules(layout, values, inputs, targets, state)
        try:
            if self._in_one_process():
                loss_parts, self.order = runners.run_in_order(self.actions(), mods, xs, ts, self._deferred)
            else:
                loss_parts = runners.run_torch(
                    mods,
                    xs,
                    ts,
                    self.mesh,
                    self.axis,
                    self.schedule,
                    self.num_stages,
                    self.microbatches,
                    self._deferred,
                )
        finally:  # a step that raised midway leaves weight parts that belong to it alone (and hold its activations)
            for parts in self._deferred.values():
                parts.clear()
        grads = self._gradients(layout, mods)
        loss = self._loss(loss_parts)
        out = [grads.get(k) if values.get(k) is not None else None for k in names]
        grads = tree.unflatten(tree.structure(params), out)
        return (loss, grads) if state is None else ((loss, stage_state.returned(state, mods)), grads)

    def lower(self, params: Any, inputs: Any, targets: Any, *, layout: Layout, state: Any = None) -> PipelineLowered:
        """Plan the step ``value_and_grad(params, inputs, targets)`` runs, without running it (and
        without sending anything): the forward and backward programs of each stage this process
        computes (every stage under ``vsf.simulate``), the sends between stages with their shapes
        and bytes per microbatch and per step, and each stage's memory (see
        :mod:`vsf.pipeline.lower`). The step reuses these plans. ``state``: :meth:`value_and_grad`'s.

        Example::

            >>> lowered = pipe.lower(params, idx, targets, layout=layout)
            >>> print(lowered.as_text())
            >>> [(s.src, s.dst, s.shape, s.bytes, s.count) for s in lowered.sends if s.what == "activation"]
            [(0, 1, (1, 8, 16), 512, 4)]
        """
        self._check_layout(layout, state)
        return lower_step(self, layout, params, inputs, targets, None if state is None else state[1])

    def _check_layout(self, layout: Any, state: Any = None) -> None:
        if state is not None:
            self._check_layout(stage_state.check(state))
        if (
            not isinstance(layout, Layout)
            or layout.meshes != tuple(self.meshes)
            or layout.split.num_stages != self.num_stages
        ):
            raise TypeError(
                f"layout must be the Layout this pipeline's place(params, specs) returned with the params; got {type(layout).__name__}"
            )

    def _microbatches(self, x: torch.Tensor, stage: int, what: str) -> list[torch.Tensor]:
        """``x`` laid out by ``batch`` on ``stage``'s mesh, as ``microbatches`` local pieces."""
        s = NamedSharding(self.meshes[stage], first_entries(self.batch, x.ndim))
        if isinstance(x, DTensor):
            have = sharding_of(x)
            if have.spec != s.spec:
                raise ValueError(f"{what} is laid out as {have.spec!r}, but the pipeline's batch spec is {s.spec!r}")
            local = x.to_local()
        else:
            local = device_put(x, s).to_local()
        m = self.microbatches
        if x.shape[0] % m or local.shape[0] % m:
            raise ValueError(
                f"{what} has {x.shape[0]} rows ({local.shape[0]} on each rank of {s.spec!r}); {m} microbatches must divide both"
            )
        return list(torch.tensor_split(local, m))

    def _modules(
        self,
        layout: Layout,
        values: dict[str, Any],
        inputs: tuple[Any, ...],
        targets: tuple[Any, ...],
        state: Any,
    ) -> dict[int, StageModule]:
        state_tree, state_layout = state or (None, None)
        bounds = boundaries(self, layout, inputs, state_layout)
        lent = tied_params.lend(layout, self.tied, values, self.local_stages(), self._peer)
        mods = {}
        for s in self.local_stages():
            names = layout.split.names[s]
            mine = {n: v for (n, b), v in lent.items() if b == s}
            held = {k: self._value(layout, k, s, values, mine) for k in names}
            gathered = self._gathered(layout, s, bounds[s][3])
            if gathered:
                with torch.no_grad():
                    held.update(self._gather(layout, s, bounds[s][3])({k: held[k] for k in gathered}))
            weights = [held[k].detach().requires_grad_(True) for k in names]
            program = self._program(s, bounds[s][1][0], stage_state.where(state_layout, s))
            held_state = stage_state.held(state_tree, state_layout, s)
            mods[s] = StageModule(program, names, weights, bounds[s][0], bounds[s][1], s, held_state)
        last = self.num_stages - 1
        if last in mods:
            target_ins = self._target_ins(targets)
            mods[last].loss_ins = [(bounds[last][1][0], bounds[last][1][1]), *target_ins]
            mods[last].loss_program = self._loss_program(last)
        return mods

    def _target_ins(self, targets: tuple[Any, ...]) -> list[Boundary]:
        """Each target's layout and global microbatch shape on the last stage."""
        last = self.meshes[self.num_stages - 1]
        return [
            (NamedSharding(last, first_entries(self.batch, t.ndim)), (t.shape[0] // self.microbatches, *t.shape[1:]))
            for t in targets
        ]

    def _program(self, s: int, out: NamedSharding, state: dict[str, Boundary] | None = None) -> Any:
        """Stage ``s``'s jitted program for results laid out as ``out`` (one per layout: a call
        with other shapes re-plans inside it, as any jitted function does), with its ``state``
        laid out as given (:func:`vsf.pipeline.state.where`; ``None``: no state)."""
        state_out = None if state is None else {k: where for k, (where, _) in state.items()}
        key = (s, out, None if state_out is None else tuple(state_out.items()))
        if key not in self._programs:
            sink = self._deferred.setdefault(s, []).append if self.schedule in sched.DEFERRED else None
            self._programs[key] = stage_program(
                self.stages[s] if state_out is None else stage_state.with_state(self.stages[s], s),
                out if state_out is None else (out, state_out),
                unreduced_grad_argnums=(0,),
                unsharded_grad_axes=PartitionSpec(*self.batch).axes,
                on_deferred_grads=sink,
                backend=self.backend,
            )
        return self._programs[key]

    def _reducer(self, layout: Layout, s: int) -> Any:
        """Stage ``s``'s program reducing its gradients once a step: their mean over the
        microbatches, in each param's layout (the stage program leaves them unreduced over the
        axes a param is replicated on, and whole over the batch's axes it is split on: DDP's one
        all-reduce a step and FSDP's one reduce-scatter, not one a microbatch)."""
        if (layout, s) not in self._reducers:
            self._reducers[(layout, s)] = mean_reducer(
                self.microbatches, {k: layout.where(k, s)[0] for k in layout.split.names[s]}, self.backend
            )
        return self._reducers[(layout, s)]

    def _gathered(self, layout: Layout, s: int, split: Split) -> list[str]:
        """Stage ``s``'s params that are gathered once a step (see :meth:`_held`)."""
        return [k for k in layout.split.names[s] if self._held(layout, k, s, split) != layout.where(k, s)[0]]

    def _held(self, layout: Layout, k: str, stage: int, split: Split) -> NamedSharding:
        """The layout of leaf ``k`` that stage ``stage``'s programs read: its own, or, unless
        ``reshard_after_forward``, gathered over the batch's axes (fsdp) for the whole step, but
        for the axes ``split[k]`` the stage's program computes on it split over (an expert-parallel
        dispatch's experts over ep: :func:`vsf.pipeline.lower.boundaries`)."""
        sharding = layout.where(k, stage)[0]
        if self.reshard_after_forward:
            return sharding
        gathered = [a for a in PartitionSpec(*self.batch).axes if a not in split.get(k, ())]
        return NamedSharding(sharding.mesh, layout.specs[k].without(gathered))

    def _gather(self, layout: Layout, s: int, split: Split) -> Any:
        """Stage ``s``'s program gathering its :meth:`_gathered` params once a step, before its
        first microbatch (FSDP2 under torch's pipeline schedules gathers once and keeps them
        gathered through the step: ``reshard_after_backward(False)``)."""
        key = (layout, s, tuple(sorted(split.items())))  # (the dispatch's split and the gather's are both costed)
        if key not in self._gathers:
            self._gathers[key] = gather_program(
                {k: self._held(layout, k, s, split) for k in self._gathered(layout, s, split)}, self.backend
            )
        return self._gathers[key]

    def _loss_program(self, last: int) -> Any:
        key = (last + 1, NamedSharding(self.meshes[last], PartitionSpec()))
        if key not in self._programs:
            self._programs[key] = stage_program(self.loss_fn, key[1], backend=self.backend)
        return self._programs[key]

    def _value(self, layout: Layout, k: str, stage: int, values: dict[str, Any], lent: dict[str, DTensor]) -> DTensor:
        """Stage ``stage``'s leaf ``k``: its own value, or the copy of a tied leaf it borrows."""
        if layout.split.owner[k] != stage:
            return lent[k].detach()
        v = values[k]
        if not isinstance(v, DTensor):
            raise TypeError(
                f"param {k!r} is a {type(v).__name__}, not a DTensor on stage {stage}'s mesh: lay the params out with pipe.place(params, specs)"
            )
        return v.detach()

    def _peer(self, stage: int) -> int:
        """The global rank of ``stage``'s mesh (at its pp coordinate, :meth:`rank_of`) at this rank's other coordinates."""
        return self.meshes[stage].devices[self.mesh.at(self.axis, self.here).devices.index(runtime.rank())]

    # -- results ----------------------------------------------------------------------------------

    def _gradients(self, layout: Layout, mods: dict[int, StageModule]) -> dict[str, DTensor]:
        """Each owned leaf's gradient: the mean over microbatches (reduced once, by the stage's
        :meth:`_reducer`), the borrowers' summed in (:func:`vsf.pipeline.tied.sum_lent`)."""
        grads: dict[str, DTensor] = {}
        lent: dict[tuple[str, int], DTensor] = {}
        for s, mod in sorted(mods.items()):
            summed = {k: w.grad if w.grad is not None else torch.zeros_like(w) for k, w in zip(mod.names, mod.weights)}
            for k, g in self._reducer(layout, s)(summed).items():
                if layout.split.owner[k] == s:
                    grads[k] = g
                else:
                    lent[(k, s)] = g
        tied_params.sum_lent(layout, self.tied, grads, lent, set(mods), self._peer)
        return grads

    def _loss(self, parts: list[torch.Tensor]) -> DTensor:
        last = self.num_stages - 1
        if self._in_one_process():
            total = sum(parts[1:], parts[0]) / len(parts)
            return as_global(total, (NamedSharding(self.meshes[last], PartitionSpec()), ()))
        here = NamedSharding(self.mesh.at(self.axis, self.here), PartitionSpec())
        value = (sum(parts[1:], parts[0]) / len(parts)).detach() if last in self.local_stages() else torch.zeros(())
        dist.broadcast(value, src=self._peer(last), group=self.mesh.device_mesh.get_group(self.axis))
        return as_global(value, (here, ()))
