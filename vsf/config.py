"""User-set switches (plain attributes of this module).

* ``strict`` (default ``False``): a committed input of ``vsf.jit`` whose sharding differs from
  ``in_shardings`` is an error instead of being resharded with a logged warning.
* ``allow_replicated_fallback`` (default ``False``): an op with no DTensor sharding strategy runs
  replicated (the plan text flags it) instead of being an error.
* ``jit_mode`` (default ``"auto"``): ``"trace"`` runs each step as a traced program over local
  shards, ``"interpret"`` walks the plan on every call (under ``vsf.simulate`` every op runs
  through ``LocalTensorMode``), ``"replay"`` (under ``vsf.simulate``) records the second call's
  plain per-rank ops and runs them again on later calls (:mod:`vsf.jit.replay`: the same bits as
  ``"interpret"``, several times faster), ``"auto"`` traces in real runs and replays under
  ``vsf.simulate``.
* ``check_plan`` (default ``False``): checking mode for every jitted call (:mod:`vsf.jit.check`;
  ``f.check(*args)`` checks one call). Under ``vsf.simulate`` the planned program runs beside the
  unsharded graph, op by op on the same full input values, and the first op whose assembled result
  differs raises ``vsf.PlanCheckError`` naming the op, the user's source line, the placements in
  and out and the largest error. Off, a call does nothing more than read this flag.
* ``check_tolerance`` (default ``(1e-4, 1e-5)``): checking mode's ``(rtol, atol)`` for floating
  results (at least ``(1e-2, 1e-3)`` for float16 and bfloat16); integers must match exactly.
* ``compile_random`` (default ``False``): eager ``vsf.random`` samplers compute Philox and the
  interleaving of its words with a ``torch.compile`` d kernel (integer ops only, and the float
  steps stay eager, so the same bits; ``normal`` about 1.7x faster end to end on CPU, after a
  one-off compile of seconds to tens of seconds per process).
* ``allow_unkeyed_random`` (default ``False``): inside ``vsf.jit`` an op that draws from torch's
  generator (dropout without :class:`vsf.random.keyed`, ``torch.rand`` ...) is an error, since its
  values would depend on the layout; set, it is planned like any op (DTensor's RNG where it has a
  strategy, ``allow_replicated_fallback`` where not), with other values on every layout.
* ``context_parallel`` (default ``"auto"``): how attention runs with its queries' sequence
  split (:mod:`vsf.jit.context_parallel`): ``"all_gather"`` gathers keys and values over the
  split, ``"ring"`` passes their blocks around a ring of ppermutes instead (each rank holds one
  block of keys and values at a time), ``"auto"`` chooses per attention op: the ring where its
  gathered keys and values would take more than ``context_parallel_gather_bytes``, else the
  gather (it sends no more bytes forward and fewer backward, and runs fewer, larger steps). Read
  when a step is planned.
* ``context_parallel_gather_bytes`` (default 64 MiB): ``"auto"``'s memory budget for one
  attention op's gathered keys and values, counted on their whole shape (what a rank holds
  gathered where no other axis splits them: an upper bound).
* ``compute_bytes_per_flop`` (default ``0.01``): what the planner charges, in bytes sent, for
  each FLOP an op does beyond its share. A matmul, convolution or attention op that runs with
  nothing split on a mesh axis runs its whole work on every rank of it instead of ``1/n``
  (:mod:`vsf.jit.cost`); its ``(n-1)/n`` FLOPs beyond that are charged at this rate, beside the
  bytes its collectives send. It is a link's bandwidth over a rank's FLOP rate: 0.77 GB/s
  (a 2-process gloo all-reduce on one CPU core each, bytes each rank sends) over 60-80 GFLOP/s
  (one core's fp32 matmul) is 0.010-0.013; an A100's fp32 19.5 TFLOP/s against NVLink's
  ~230 GB/s 0.012, an H100's bf16 ~990 TFLOP/s against ~400 GB/s 0.0004. ``0`` counts bytes
  only. With it, a row-parallel matmul of ``[m, d]`` by ``[d, d]`` over ``n`` ranks all-reduces
  its output (Megatron's plan) rather than gathering its input and weight and computing the whole
  product on every rank where ``compute_bytes_per_flop > 2 (m - d) / (m d)`` (fp32, any ``n``:
  from ``d = 167`` up for ``m = 1024`` at the default). Read when a step is planned.

* ``collective_latency_bytes`` (default ``None``: by the mesh's device, 64 KiB on CPU, 1 MiB on
  CUDA): what the planner charges a collective for starting, beside the bytes it sends
  (:mod:`vsf.jit.cost`): a link's start-up latency times its bandwidth, the bytes it could have
  sent while starting. A gloo collective between 2 CPU processes of a loaded 2-core machine
  started in 135-300 us and sent 0.3-0.5 GB/s (40-150 KB); an NCCL one starts in about 10-20 us
  at 50-400 GB/s (0.5-8 MB). It is charged in full where a collective runs alone, on a value
  between two ops that do work (an activation between matmuls); parameters gathered and
  gradients reduced share buckets, one start-up for many, and are charged a sixteenth of it each
  (:data:`vsf.jit.solver.BUCKET_SHARE`; :class:`vsf.jit.solver.Problem`). With a small charge the
  planner picks the plan that sends the fewest bytes however many collectives that takes; a
  larger one trades bytes for fewer launches. On bench_torch's small GPT (Megatron TP over 2
  gloo processes, compiled) 64 KiB plans 9 collectives a step, Megatron's 8 all-reduces and the
  tied head's gradient gathered: 0.72x compiled torch TP's step, where 4 KiB plans 12 (the
  attention projection's input exchanged, its weight and output gathered: fewer bytes, more
  launches) and ran 0.88x (one run, load 5). The default follows the
  mesh's ``device_type``, which is part of the plan's cache key: a simulated mesh is a CPU one
  unless made with ``device_type="cuda"``. Read when a step is planned.

* ``bucket_bytes`` (default 4 MiB): the most one bucket's flat buffer holds (DDP's
  ``bucket_cap_mb``): gradient all-reduces, parameter all-gathers (counted gathered) and gradient
  reduce-scatters (counted unreduced) of independent values join buckets of at most about this
  size, each run as one collective; smaller buckets start communicating earlier in the backward
  and hold less memory at once, larger ones launch fewer collectives. Read when a step is planned.

* ``dispatch_experts`` (default ``True``): inside ``vsf.jit``, a ``transformers`` experts module
  (Mixtral's, Qwen-MoE's, DeepSeek's: built with ``@use_experts_implementation``), or torchtitan's
  routed experts (``RoutedExperts``, torchtitan 0.3), whose weights arrive split on the expert dim
  over one mesh axis sends its tokens to the experts' ranks and back
  (:func:`vsf.nn.expert_parallel`, the region ``shard_map(expert_dispatch)`` in the plan's text),
  and a ``transformers`` one whose weights no axis splits on the expert dim runs on each rank's own
  tokens (``shard_map(own_tokens)``); ``False`` plans the module as its library runs it (the
  experts' weights gathered to the tokens, or the tokens to the replicated experts).
  Read when a step is traced.
* ``stamp_blocks`` (default ``True``): inside ``vsf.jit``, the first child of a ``ModuleList`` or
  ``Sequential`` of each kind (a transformer's blocks) is traced by itself, and its graph is copied
  for every block of the same kind (:mod:`vsf.jit.stamp`: the same graph and plan as tracing each
  block, at a fraction of the tracing time), and likewise the optimizer's update of each leaf from
  one trace per kind of leaf (``vsf.jit.trace.per_leaf``: Adam's); ``False`` traces every block
  and every leaf's update. Read when a step is traced.

* ``check_across_processes`` (default ``True``): on several processes, :func:`vsf.device_put`
  of plain tensors checks that every process passed the same value (each must hold the whole
  value; a process's own half of a batch passes every shape check and would silently be taken
  as the global value), and :func:`vsf.make_array_from_process_local_data` checks every
  process's local shape against the sharding and that replicas passed the same data. Each call
  costs one small all-gather over the mesh's ranks for the whole tree (a fingerprint of each
  leaf: a few sums of its bits and sampled elements, not its data), whatever the number of
  leaves; under :func:`vsf.simulate` the per-rank values are compared in the process. A
  mismatch raises ``ValueError`` naming the leaf and the ranks. Set it to ``False`` in a hot
  loop whose inputs are known to agree: nothing is exchanged, and each process checks only its
  own shapes.
* ``collective_timeout`` (default 600 seconds, or the ``VSF_COLLECTIVE_TIMEOUT`` environment
  variable; ``python -m vsf.launch --timeout S`` sets it for every rank): how long a collective
  waits for the other ranks before it raises, so a rank that stops without dying (``SIGSTOP``,
  a hung kernel, a deadlock) makes the others exit with an error instead of holding them
  forever (a rank that dies makes them raise at once: its connections close). Read when vsf
  initialises the process group (the first mesh under ``torchrun``); it applies to that group
  and to every group created after it (the meshes' axes, the checkpoint group).

The switches a plan depends on (``allow_replicated_fallback``, ``allow_unkeyed_random``,
``context_parallel``, ``context_parallel_gather_bytes``, ``compute_bytes_per_flop``,
``bucket_bytes``, ``dispatch_experts``, ``collective_latency_bytes``, ``stamp_blocks``) are read once per ``vsf.jit`` call into a :class:`PlanOptions` (:func:`plan_options`),
which is part of the call's cache key and is passed down to every stage that plans: a switch
changed between two calls plans the step again with the new value, and ``step.replans`` names it.
The others are read when they act (``strict`` and ``check_plan`` on every call, ``jit_mode`` when a
program runs).

Example::

    >>> vsf.config.strict = True
"""

import dataclasses
from os import environ as _environ
from typing import Literal, get_args

JitMode = Literal["auto", "trace", "interpret", "replay"]
ContextParallelMode = Literal["auto", "all_gather", "ring"]

strict: bool = False
allow_replicated_fallback: bool = False
jit_mode: JitMode = "auto"
check_plan: bool = False
check_tolerance: tuple[float, float] = (1e-4, 1e-5)
compile_random: bool = False
allow_unkeyed_random: bool = False
context_parallel: ContextParallelMode = "auto"
context_parallel_gather_bytes: int = 64 * 2**20
bucket_bytes: int = 4 * 2**20
compute_bytes_per_flop: float = 0.01
dispatch_experts: bool = True
collective_latency_bytes: float | None = None
stamp_blocks: bool = True
check_across_processes: bool = True
collective_timeout: float = float(_environ.get("VSF_COLLECTIVE_TIMEOUT", "600"))


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """The switches one plan is made with (each documented above, under its name), read at once by
    :func:`plan_options`; the defaults are the module's. Part of a ``vsf.jit`` call's cache key.

    Example::

        >>> PlanOptions(bucket_bytes=2**20).bucket_bytes
        1048576
    """

    allow_replicated_fallback: bool = False
    allow_unkeyed_random: bool = False
    context_parallel: ContextParallelMode = "auto"
    context_parallel_gather_bytes: int = 64 * 2**20
    compute_bytes_per_flop: float = 0.01
    bucket_bytes: int = 4 * 2**20
    dispatch_experts: bool = True
    collective_latency_bytes: float | None = None
    stamp_blocks: bool = True

    def changed(self, other: "PlanOptions") -> list[str]:
        """The switches whose values differ from ``other``'s, as ``vsf.config.NAME OLD -> NEW``.

        Example::

            >>> PlanOptions().changed(PlanOptions(bucket_bytes=2**20))
            ['vsf.config.bucket_bytes 4194304 -> 1048576']
        """
        return [
            f"vsf.config.{f.name} {getattr(self, f.name)!r} -> {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def plan_options() -> PlanOptions:
    """The plan switches as they are set now, checked: a string switch must be one of its kinds.

    Example::

        >>> vsf.config.bucket_bytes = 2**20
        >>> plan_options().bucket_bytes
        1048576
    """
    if context_parallel not in get_args(ContextParallelMode):
        raise ValueError(
            f"vsf.config.context_parallel must be one of {get_args(ContextParallelMode)}, got {context_parallel!r}"
        )
    return PlanOptions(
        allow_replicated_fallback,
        allow_unkeyed_random,
        context_parallel,
        context_parallel_gather_bytes,
        compute_bytes_per_flop,
        bucket_bytes,
        dispatch_experts,
        collective_latency_bytes,
        stamp_blocks,
    )
