"""``vsf.jit``: trace a step over pytrees once, plan its shardings, run the planned program.

``jit(f)(*args)`` flattens the arguments, and on the first call for a given (tree structure,
shapes, dtypes, shardings, static arguments) it traces ``f`` on global fake tensors
(:mod:`vsf.jit.trace`), chooses a sharding for every value (:mod:`vsf.jit.propagate`) and lowers
the plan to a program over local shards (:mod:`vsf.jit.lower`). Later calls with the same key run the
cached program; any other call re-plans and says why (``f.replans`` and the ``vsf.jit`` logger).

Example::

    >>> @vsf.jit(donate_argnums=(0,))
    ... def sgd_step(params, batch):
    ...     loss, grads = vsf.value_and_grad(loss_fn)(params, batch)
    ...     return vsf.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss
    >>> print(sgd_step.lower(params, batch).as_text())
    >>> params, loss = sgd_step(params, batch)
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import DTensor

from vsf import _compat, config, runtime, tree
from vsf.jit.check_trace import assembled_inputs, like_eager
from vsf.jit.call import Arguments, Call, layouts, leaf_names, param_names
from vsf.jit.differentiable import JointPlan, attach, grad_shardings, plan_joint, program
from vsf.jit.joint import runs_backward
from vsf.jit.outputs import output_metas, output_names, output_targets
from vsf.jit.classify import never_planned_decompositions, unplanned_ops
from vsf.jit.donation import Donation
from vsf.jit.plan import Plan
from vsf.jit.propagate import propagate
from vsf.jit.remat import within_budget
from vsf.jit.replans import replan_reason
from vsf.jit.runner import BACKENDS, Runner
from vsf.jit.report import Cost, cost, differentiable_cost, differentiable_text, plan_text, split_text
from vsf.jit.trace import Traced, trace
from vsf.sharding.mesh import mesh_of

__all__ = ["Compiled", "Jitted", "Lowered", "jit"]

log = logging.getLogger("vsf.jit")


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    in_shardings: Any = None,
    out_shardings: Any = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    reshard_after_forward: bool | None = None,
    memory_budget: int | None = None,
    unreduced_grad_argnums: int | Sequence[int] = (),
    unsharded_grad_axes: Sequence[str] = (),
    deferred_grad_argnums: int | Sequence[int] = (),
    on_deferred_grads: Callable[[Callable[[], None]], None] | None = None,
    backend: str = "eager",
    reduce_dtype: torch.dtype | None = None,
) -> Any:
    """Compile ``fun`` into a sharded program (usable as ``@jit`` and ``@jit(...)``).

    * ``in_shardings``: a pytree prefix of the positional (non-static) arguments; ``None`` keeps
      each input's current sharding (plain tensors and Python numbers are replicated). A DTensor
      whose sharding differs is resharded once with a logged warning (an error when
      ``vsf.config.strict``).
    * ``out_shardings``: a pytree prefix of the result; ``None`` lets propagation choose, except
      that a result shaped exactly like an argument (a carried state such as params or optimizer
      state) comes back sharded like that argument.
    * ``static_argnums`` / ``static_argnames``: hashable arguments that select a different program
      (Python control flow may depend on them).
    * ``donate_argnums``: arguments whose DTensors are released after the call; using them
      afterwards raises an error that says so.
    * ``reshard_after_forward`` (FSDP2's name): ``True`` gathers a sharded param again in the backward, ``False``
      keeps it; ``None``: only if ``.cost().peak_bytes`` would exceed ``memory_budget`` (bytes per rank).
    * ``memory_budget``: bytes per rank. It also decides, block by block, the recompute a step asks
      for (``vsf.remat``, torch's activation checkpointing): the plan recomputes the fewest of the
      forward's first blocks whose estimated peak fits, every block (saying it does not fit) if
      none does (:func:`vsf.jit.remat.within_budget`); the plan text says what it chose.
    * ``reduce_dtype`` (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``): every reduction (all-reduce,
      reduce-scatter) of a floating value of another dtype runs in this one: each rank's partial
      sum is cast to it, reduced, and cast back (``torch.float32``: bf16 gradients summed in fp32,
      as one device's matmul accumulates them, at twice the bytes). The plan text shows each such
      collective with its dtype; ``None`` reduces each value in its own.
    * ``unreduced_grad_argnums``: arguments whose DTensors' gradients (under torch autograd) come back
      unreduced (``Partial``) on the axes they are replicated on, where the plan holds them so (a
      weight's, the batch over ``dp``): ``.grad`` sums calls' linearly, the caller reduces once (DDP's ``no_sync``).
    * ``unsharded_grad_axes``: mesh axes on which those arguments' gradients also come back whole and
      unreduced where their values are split there and the plan gathers them (a param over ``fsdp``):
      ``.grad`` sums calls' whole-sized gradients and the caller reduce-scatters once (FSDP2's
      ``set_requires_gradient_sync(False)``), at the memory of a gradient unsplit over those axes. A
      gradient the plan computes split there (an expert's, whose tokens were sent to it) comes back
      split, as its value is.
    * ``deferred_grad_argnums`` / ``on_deferred_grads``: the backward computes every gradient but
      those of these arguments' leaves (a pipeline stage's params) and hands ``on_deferred_grads`` a
      function that computes them later and adds them into the leaves' ``.grad``: the backward
      program cut in two, the second part computing nothing the first did (a zero-bubble
      schedule's input and weight backward).
    * ``backend`` (``torch.compile``'s name): ``"eager"`` runs each rank's planned program as the
      traced fx graph of local ops and functional collectives, op by op; ``"inductor"`` compiles
      that graph with Inductor once per plan, on its first call (fused kernels; donated buffers
      still updated in place). A program Inductor cannot compile runs as ``"eager"`` after a
      warning that gives the reason, as do the programs of ``vsf.simulate`` (simulated ranks) and
      of checking mode (one warning per program).

    Called with grad mode on and an input that requires grad, the result is differentiable by
    torch autograd (``loss.backward()``, ``torch.optim``, ``torch.distributed.pipelining``): the
    joint graph (forward + vjp) is planned once and run as a forward and a backward program; a
    DTensor input's ``.grad`` has its sharding. ``create_graph=True`` is refused; a function that
    calls ``vsf.grad`` itself is a traced step, not differentiated again.

    Example::

        >>> step = vsf.jit(train_step, donate_argnums=(0, 1))
        >>> block = vsf.jit(lambda p, x: vsf.tree.apply(module, p, x))   # in a torch training loop
        >>> params = vsf.tree.map(lambda t: t.requires_grad_(), vsf.device_put(params, shardings))
        >>> opt = torch.optim.AdamW(vsf.tree.leaves(params))
        >>> block(params, x).square().mean().backward(); opt.step()      # param.grad: DTensors
    """
    options = {k: v for k, v in locals().items() if k != "fun"}
    if fun is None:
        return lambda f: jit(f, **options)
    return Jitted(
        fun,
        in_shardings,
        out_shardings,
        _tuple(static_argnums),
        _tuple(static_argnames),
        _tuple(donate_argnums),
        reshard_after_forward=reshard_after_forward,
        memory_budget=memory_budget,
        unreduced_grad_argnums=_tuple(unreduced_grad_argnums),
        unsharded_grad_axes=tuple(unsharded_grad_axes),
        deferred=(_tuple(deferred_grad_argnums), on_deferred_grads),
        backend=backend,
        reduce_dtype=reduce_dtype,
    )


def _tuple(x: Any) -> tuple[Any, ...]:
    return (x,) if isinstance(x, (int, str)) else tuple(x)


class Jitted:
    """A jitted function: call it, or ``lower`` it to read its plan."""

    def __init__(
        self,
        fun: Callable[..., Any],
        in_shardings: Any,
        out_shardings: Any,
        static_argnums: tuple[int, ...],
        static_argnames: tuple[str, ...],
        donate_argnums: tuple[int, ...],
        *,
        reshard_after_forward: bool | None = None,
        memory_budget: int | None = None,
        unreduced_grad_argnums: tuple[int, ...] = (),
        unsharded_grad_axes: tuple[str, ...] = (),
        deferred: tuple[tuple[int, ...], Callable[[Callable[[], None]], None] | None] = ((), None),
        backend: str = "eager",
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.static_argnums = static_argnums
        self.static_argnames = static_argnames
        self.donate_argnums = donate_argnums
        self.reshard_after_forward, self.memory_budget = reshard_after_forward, memory_budget
        self.unreduced_grad_argnums, self.unsharded_grad_axes = unreduced_grad_argnums, unsharded_grad_axes
        self.deferred_grad_argnums, self.on_deferred_grads = deferred
        if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
            raise ValueError(
                f"reduce_dtype must be a floating-point torch.dtype (torch.float32, say), got {reduce_dtype!r}"
            )
        self.reduce_dtype = reduce_dtype
        if self.deferred_grad_argnums and self.on_deferred_grads is None:
            raise ValueError(
                f"deferred_grad_argnums={self.deferred_grad_argnums} needs on_deferred_grads: the function that gets each call's deferred gradients to run"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        overlap = set(static_argnums) & set(donate_argnums)
        if overlap:
            raise ValueError(f"arguments {sorted(overlap)} cannot be both static and donated")
        self._cache: dict[tuple[Any, ...], Compiled] = {}
        self._last_key: tuple[Any, ...] | None = None
        self._hot: tuple[tuple[Any, ...], Compiled] | None = None  # the last call's key and program (_call)
        self.replans: list[str] = []
        self._name = getattr(fun, "__qualname__", getattr(fun, "__name__", "fun"))
        self._arguments = Arguments(
            self._name, tuple(param_names(fun)), static_argnums, static_argnames, in_shardings, backend
        )

    @property
    def plan_count(self) -> int:
        """How many times this function has been planned (traced, propagated and lowered)."""
        return len(self.replans)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(args, kwargs, check=config.check_plan)

    def check(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function in checking mode (:mod:`vsf.jit.check`): under :func:`vsf.simulate`, run
        the plan beside the unsharded graph and raise :class:`vsf.PlanCheckError` at the first op
        whose assembled result differs. Returns what the call returns.

        Example::

            >>> params, loss = step.check(params, batch)
        """
        return self._call(args, kwargs, check=True)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any], check: bool) -> Any:
        call = self._prepare(args, kwargs)
        # the last call's program where the keys are equal: a step's inputs are the last call's results, laid out
        # as that call's inputs were, so the keys compare object by object (a lookup hashes every leaf's layout)
        hot = self._hot
        compiled = (
            hot[1] if hot is not None and hot[0] == call.key else self._cache.get(call.key) or self._compile(call)
        )
        self._hot = (call.key, compiled)
        result = compiled._run(call, check)
        compiled.donation.release(args, call.leaves)
        return result

    def _prepare(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
        return self._arguments.prepare(args, kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> "Lowered":
        """Plan this function for these arguments without running it.

        Example::

            >>> lowered = step.lower(params, batch)
            >>> print(lowered.as_text()); lowered.cost().comm_bytes
        """
        call = self._prepare(args, kwargs)
        return Lowered(self._cache.get(call.key) or self._compile(call))

    def trace(self, *args: Any, **kwargs: Any) -> Traced:
        """Trace for these arguments without planning (JAX's ``jit(f).trace``): the graph on global shapes, and
        the inputs computed on as they arrive (an expert dispatch's), e.g. ``step.trace(p, x).split_inputs == {1: ('ep',)}``."""
        return self._traced(self._prepare(args, kwargs))[0]

    # -- planning -------------------------------------------------------------------------

    def _traced(self, call: Call) -> tuple[Traced, list[Any]]:
        """The call's trace, and the backwards its code ran (a step that differentiates itself)."""
        avals = [(tuple(x.shape), x.dtype) for x in call.inputs]
        with runs_backward() if call.grad is not None else contextlib.nullcontext([]) as steps:
            traced = trace(
                self.fun,
                avals,
                call.rebuild,
                call.mesh.device_type,
                unplanned_ops,
                never_planned_decompositions(),
                allow_unkeyed_random=call.options.allow_unkeyed_random,
                shardings=layouts([(mesh_of(x.device_mesh), tuple(x.placements), x.ndim) for x in call.inputs]),
                names=leaf_names(call.dyn),
                options=call.options,
            )
        return traced, steps

    @runtime.collector_paused()
    def _compile(self, call: Call) -> "Compiled":
        reason = replan_reason(self._last_key, call.key, call.names)
        self.replans.append(reason)
        log.info("planning %s: %s", self._name, reason)
        self._last_key = call.key
        mesh = call.mesh
        traced, steps = self._traced(call)
        out_metas = output_metas(traced)
        out_targets = output_targets(traced, call, out_metas, mesh, self.out_shardings)
        compiled = None
        if (
            call.grad is not None and out_metas and not steps
        ):  # (a traced step runs its own backward: not differentiated)
            joint = plan_joint(
                self.fun,
                call.mesh,
                call.inputs,
                call.leaves,
                call.rebuild,
                call.grad,
                traced,
                out_targets,
                call.options,
                call.leaves_of(self.unreduced_grad_argnums),
                self.unsharded_grad_axes,
                self.reduce_dtype,
                leaf_names(call.dyn),
            )
            compiled = DifferentiableCompiled(self, joint, traced, call) if joint is not None else None
        if compiled is None:
            plan_of = functools.partial(
                propagate,
                mesh=mesh,
                in_placements=[tuple(x.placements) for x in call.inputs],
                out_shardings=out_targets,
                options=call.options,
                reshard_after_forward=self.reshard_after_forward,
                memory_budget=self.memory_budget,
                reduce_dtype=self.reduce_dtype,
                donated=call.leaves_of(self.donate_argnums),
            )
            compiled = Compiled(self, within_budget(plan_of, traced.graph, self.memory_budget), traced, call)
        self._cache[call.key] = compiled
        return compiled


# -- compiled programs ---------------------------------------------------------------------


class Compiled:
    """A planned program for one argument signature; call it like the jitted function."""

    def __init__(self, owner: Jitted, plan: Plan, traced: Traced, call: Call) -> None:
        self.owner = owner
        self.plan = plan
        self.traced = traced
        self.input_names = call.names
        self._runner = Runner(plan, owner.backend, f"the program of {owner._name}")
        self.donation = Donation(owner._name, call.located(owner.donate_argnums))
        dm = plan.mesh.device_mesh
        self._out_specs = _compat.dtensor_layouts(dm, zip(plan.outputs, output_metas(traced)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.owner._prepare(args, kwargs)
        if call.key not in self.owner._cache or self.owner._cache[call.key] is not self:
            raise ValueError(
                f"these arguments do not match the signature this program of {self.owner._name} was compiled for"
            )
        result = self._run(call, config.check_plan)
        self.donation.release(args, call.leaves)
        return result

    def _run(self, call: Call, check: bool) -> Any:
        locals_in = [_compat.dtensor_local(x) for x in call.inputs]
        full = assembled_inputs(self.plan, locals_in) if check else None
        locals_out = self._runner(locals_in, check, lambda: self.donation.leaves)
        if full is not None:
            like_eager(self.plan, full, self._eager(call), self.output_names)
        return self._result(_compat.dtensors_from_locals(locals_out, self._out_specs))

    def _eager(self, call: Call) -> Callable[[list[torch.Tensor]], list[Any]]:
        """The jitted function run as it is on plain tensors (in place of the call's leaves): its
        results where the trace has outputs (checking mode's :func:`like_eager`)."""

        def run(tensors: list[torch.Tensor]) -> list[Any]:
            args, kwargs = call.rebuild(tensors)
            leaves, _ = tree.flatten(self.owner.fun(*args, **kwargs))
            return [x for x, c in zip(leaves, self.traced.out_consts) if c is None]

        return run

    def _result(self, outs: list[DTensor]) -> Any:
        it = iter(outs)
        leaves = [next(it) if c is None else c for c in self.traced.out_consts]
        return tree.unflatten(self.traced.out_tree, leaves)

    @functools.cached_property
    def output_names(self) -> list[str]:
        """The key paths of the outputs (``[1]['mu']``), worked out when a plan's text first needs them."""
        return output_names(self.traced)

    def _text(self) -> str:
        return plan_text(self.plan, self.owner._name, self.input_names, self.output_names)

    def _cost(self) -> Cost:
        return cost(self.plan)


class DifferentiableCompiled(Compiled):
    """A planned call that torch autograd differentiates: ``plan`` is the joint graph's plan, run
    as its forward and backward programs inside one ``torch.autograd.Function``
    (:mod:`vsf.jit.differentiable`)."""

    def __init__(self, owner: Jitted, joint: JointPlan, traced: Traced, call: Call) -> None:
        super().__init__(owner, joint.plan, traced, call)
        self.parts = joint.parts
        self.grad_shardings = tree.unflatten(call.key[0], grad_shardings(joint, call.leaves))
        self.grad_names = [f"grad of {call.names[i]}" for i in joint.with_grad]
        deferred = call.leaves_of(owner.deferred_grad_argnums)
        self._program = program(
            owner._name,
            joint,
            call.leaves,
            self._out_specs,
            output_metas(traced),
            deferred,
            owner.on_deferred_grads,
            call.names if deferred else (),
        )
        plans = (joint.parts.forward, joint.parts.backward) + (
            (self._program.split.inputs, self._program.split.weights) if self._program.split else ()
        )
        names = ("forward", "backward", "input backward", "weight backward")
        self._runners = tuple(
            Runner(p, owner.backend, f"the {what} program of {owner._name}") for p, what in zip(plans, names)
        )
        self._program.run = lambda k, xs, check: self._runners[k](xs, check)

    def _run(self, call: Call, check: bool) -> Any:
        locals_in = [_compat.dtensor_local(x) for x in call.inputs]
        return self._result(
            attach(self._program, [x for x in call.leaves if isinstance(x, torch.Tensor)], locals_in, check)
        )

    def _text(self) -> str:
        text = differentiable_text(self.parts, self.owner._name, self.input_names, self.output_names, self.grad_names)
        return text if self._program.split is None else text + "\n" + split_text(self._program.split, self.owner._name)

    def _cost(self) -> Cost:
        return differentiable_cost(self.parts)


class Lowered:
    """A plan, not yet run: read it with :meth:`as_text` and :meth:`cost`, run it via :meth:`compile`."""

    def __init__(self, compiled: Compiled) -> None:
        self._compiled = compiled

    @property
    def plan(self) -> Plan:
        return self._compiled.plan

    def as_text(self) -> str:
        """Each op with its input/output shardings, each collective with its axis, shape and bytes."""
        return self._compiled._text()

    def cost(self) -> Cost:
        """Bytes each rank sends per mesh axis, the collectives, the estimated peak memory per rank,
        and the FLOPs each rank runs in matmuls, convolutions and attention (:class:`vsf.jit.report.Cost`)."""
        return self._compiled._cost()

    @property
    def grad_shardings(self) -> Any:
        """Each DTensor argument's gradient's sharding under torch autograd, as ``(args, kwargs)``
        (``None``: no gradient, or not a DTensor; the whole ``None``: the call is not differentiated).
        E.g. ``P(unreduced=('dp',))`` for ``lower(w, x).grad_shardings[0][0]`` under ``unreduced_grad_argnums=(0,)``."""
        return getattr(self._compiled, "grad_shardings", None)

    def compile(self) -> Compiled:
        """The runnable program (call it with the same arguments)."""
        return self._compiled
