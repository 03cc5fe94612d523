"""What kind each op of a traced graph is, decided once per node (:func:`classify`) and carried
on the plan (``NodePlan.op``), so that strategies, the full-mesh check and lowering agree.

* ``constant``: no tensor input (a ``get_attr`` constant, a factory op), or no strategy and only
  constants as inputs (a mask built in ``forward``): replicated, needs no strategy;
* ``constraint``: a ``with_sharding_constraint``: its value takes the sharding asked for;
* ``manual``: an op a ``shard_map`` region leaves in the graph (:mod:`vsf.ops.region`): where a
  value enters or leaves the region, a collective of its body, ``axis_index``; vsf gives their
  strategies and runs them (:mod:`vsf.jit.manual`);
* ``value_blind``: the result depends on the input's shape only (``ones_like``): any placement will do;
* ``strategy``: DTensor registers a strategy for it, per mesh dim (``rules == "single"``) or for
  the whole op (``"full"``: also a custom op's rules a user registers with torch's public
  ``torch.distributed.tensor.experimental.register_sharding``); ``local`` ops run as they are on local shards (their rules are per
  mesh dim, DTensor's dispatcher has no special handler for them and they take no global sizes
  as arguments: :data:`SHAPE_ARGUMENT_OPS`), the others run through DTensor's dispatcher;
* ``none``: no strategy: a ``PlanError``, or replicated under ``allow_replicated_fallback``.

``ragged_reduction`` ops (sums, norms) also run on a rank's own ragged rows.

:func:`unplanned_ops` names the ops of a traced graph of kind ``none`` (and those whose DTensor
strategy is not trusted): the tracer decomposes them with PyTorch's own tables before planning.

Example::

    >>> classify(mm_node)
    OpClass(kind='strategy', rules='single', local=True, ragged_reduction=False)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.fx
from torch.distributed.tensor import Partial, Placement, Replicate

from vsf import _compat
from vsf.jit import attention
from vsf.jit.graph import is_tensor_node, op_nodes, per_op
from vsf.ops import region
from vsf.sharding import constraint

__all__ = [
    "ATTENTION_OPS",
    "BATCH_NORM_OPS",
    "DISPATCHER_SPECIAL",
    "PER_EXAMPLE_BACKWARDS",
    "RAGGED_REDUCTIONS",
    "SHAPE_ARGUMENT_OPS",
    "UNTRUSTED_STRATEGIES",
    "VALUE_BLIND_OPS",
    "VARIANCE_DECOMPOSITIONS",
    "WEIGHT_NORM_DECOMPOSITIONS",
    "WEIGHT_NORM_OPS",
    "OpClass",
    "classify",
    "classify_all",
    "constant_nodes",
    "draws_random",
    "never_planned_decompositions",
    "unplanned_ops",
]

aten = torch.ops.aten


# Ops whose result depends only on their input's shape, not its values: any placement of the input
# will do (a partial sum has the full shape everywhere), and the result is replicated or sharded
# like the input. DTensor asks for a reduced input; a loss's backward then waits for the loss to be
# all-reduced, which the planner can instead defer (and bucket with the gradients).
VALUE_BLIND_OPS = frozenset(
    {
        aten.ones_like.default,
        aten.zeros_like.default,
        aten.empty_like.default,
        aten.full_like.default,
    }
)


# Reductions that run on a rank's own rows as they are (a sum or a norm of rows is a partial result
# of that kind, and an empty shard gives the identity); DTensor's dispatcher, which they would
# otherwise go through, has no ragged rules. (A max has no identity on a rank that holds no rows.)
RAGGED_REDUCTIONS = frozenset({aten.sum.default, aten.sum.dim_IntList, aten.linalg_vector_norm.default})


DISPATCHER_SPECIAL = _compat.dispatcher_special_ops()


# Ops whose arguments name sizes of their global tensors (group norm's N, C, HxW; an upsample
# backward's input size; a view's shape): DTensor's dispatcher rewrites them for a shard, so they
# never run directly on local shards (called there with the traced sizes, group norm on a batch
# shard raised and a shape could silently be the global one).
SHAPE_ARGUMENT_OPS = _compat.shape_argument_ops()


# Ops whose DTensor strategy gives wrong numbers on some inputs: they are decomposed (and the pieces
# planned) as if they had none. nll_loss's mean over a sharded batch is DTensor's Partial("avg") of
# the shards' means, which is the mean only when every shard counts as many targets (ignore_index
# or class weights make them differ: BERT's masked-LM labels).
UNTRUSTED_STRATEGIES = frozenset({aten.nll_loss_forward.default, aten.nll_loss2d_forward.default})


# Batch norm, decomposed (by PyTorch's decompositions) in every graph: ``native_batch_norm`` writes
# its running statistics in place though its schema does not say so (PyTorch's own tracers always
# decompose it for that reason: the write becomes a copy, which functionalization returns), and in
# training its statistics and its backward's are reductions over the batch, which DTensor's
# strategies gather whole on every rank; decomposed, they are sums and variances (below) that split
# over the batch's shards, and only per-channel partial sums are reduced (SyncBatchNorm's bytes).
BATCH_NORM_OPS = frozenset(
    {
        aten.native_batch_norm.default,
        aten.native_batch_norm_backward.default,
        aten._native_batch_norm_legit.default,
        aten._native_batch_norm_legit.no_stats,
        aten._native_batch_norm_legit_functional.default,
    }
)


def _var_mean(x: torch.Tensor, dim: Any = None, *, correction: Any = None, keepdim: bool = False) -> Any:
    """``torch.var_mean`` as the mean, then the mean of squared deviations (two passes, computed in
    at least float32): reductions that split over a sharded dim as partial sums."""
    if x.is_complex():
        return NotImplemented
    dims = [d % x.dim() for d in dim] if dim else list(range(x.dim()))
    n = math.prod(x.shape[d] for d in dims)
    wide = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = wide.sum(dims, keepdim=True) / n
    var = (wide - mean).square().sum(dims, keepdim=keepdim) / max(n - (1 if correction is None else correction), 0)
    return var.to(x.dtype), (mean if keepdim else mean.squeeze(dims)).to(x.dtype)


# Variances, decomposed in every graph into the reductions above: over a sharded dim, DTensor's
# strategy gathers the input whole, and PyTorch's decomposition lands on ``prims.var``.
VARIANCE_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.var_mean.correction: _var_mean,
    aten.var.correction: lambda x, dim=None, *, correction=None, keepdim=False: _var_mean(
        x, dim, correction=correction, keepdim=keepdim
    )[0],
}


# Attention keeps a real strategy (decomposed, it would materialise a T x T product): the CPU
# kernels SDPA traces to split over batch and heads, as DTensor's CUDA flash kernel does.
ATTENTION_OPS = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)
for _op in ATTENTION_OPS:
    if _compat.registered_rules(_op) is None:
        attention.register(_op)


def _per_example_backward_rules(
    spatial: int, indices: bool
) -> Callable[[list[torch.Size]], list[list[Placement | int]]]:
    """A pool's or a pad's backward ``(grad_output, self, ...) -> grad_input`` over ``spatial`` dims
    (``indices``: a max pool's, which also takes where each maximum came from): each example and
    channel is pooled or padded by itself, so it splits over the batch or (batched: ``[N, C, ...]``)
    the channels of its result and its inputs alike; it is linear in ``grad_output`` (``self`` gives
    only the shape, the indices only places), so a partial sum of that gives one of the result."""

    def rules(shapes: list[torch.Size]) -> list[list[Placement | int]]:
        dims = (0, 1) if len(shapes[1]) == spatial + 2 else (0,)
        rest = [Replicate()] * (1 + indices)
        return [[d, d, d] + [d] * indices for d in dims] + [[Partial(), Partial(), *rest]]

    return rules


# Backwards of per-example ops (pools, replication padding) that DTensor has no rule for (it has
# the forwards') and PyTorch no decomposition of, each with its spatial dims and whether it takes a
# max pool's indices: Funnel's and MaxViT's average pools, MONAI's DenseNet121 and ResNet max pools
# and BasicUNet's padding were a PlanError on every layout.
PER_EXAMPLE_BACKWARDS = {
    aten.avg_pool2d_backward.default: (2, False),
    aten.avg_pool3d_backward.default: (3, False),
    aten._adaptive_avg_pool3d_backward.default: (3, False),
    aten.max_pool3d_with_indices_backward.default: (3, True),
    aten.adaptive_max_pool2d_backward.default: (2, True),
    aten.adaptive_max_pool3d_backward.default: (3, True),
    aten.replication_pad1d_backward.default: (1, False),
    aten.replication_pad2d_backward.default: (2, False),
    aten.replication_pad3d_backward.default: (3, False),
}
for _op, (_spatial, _indices) in PER_EXAMPLE_BACKWARDS.items():
    if _compat.registered_rules(_op) is None:
        _compat.register_single_dim_rules(_op, _per_example_backward_rules(_spatial, _indices))


OpKind = Literal["constant", "constraint", "manual", "value_blind", "strategy", "none"]  # see the module docs


# argument values that make a seeded op deterministic (attention without dropout, dropout with
# probability 0 or not training)
_NO_DRAW = {"dropout_p": 0.0, "dropout": 0.0, "p": 0.0, "train": False}


@per_op
def _seeded(op: Any) -> bool:
    """Does PyTorch tag ``op`` random (``nondeterministic_seeded``)?"""
    return torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


def draws_random(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Does calling the aten ``op`` on ``args``/``kwargs`` draw from torch's generator? An op PyTorch
    tags random (``nondeterministic_seeded``) does, unless an argument makes it deterministic
    (:data:`_NO_DRAW`: a dropout probability of 0, given or by default, or ``train=False``; the
    tag of an attention kernel is for its dropout).

    Example::

        >>> draws_random(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v), {})
        False
        >>> draws_random(aten.native_dropout.default, (x, 0.1, True), {})
        True
    """
    if not _seeded(op):
        return False
    arguments = _compat.op_schema(op).arguments
    bound = (
        {a.name: a.default_value for a in arguments if a.has_default_value()}
        | dict(zip((a.name for a in arguments), args))
        | dict(kwargs)
    )
    return not any(name in bound and bound[name] == value for name, value in _NO_DRAW.items())


@dataclasses.dataclass(frozen=True)
class OpClass:
    """What kind an op is (see the module docs)."""

    kind: OpKind
    rules: str | None
    local: bool
    ragged_reduction: bool


def classify(node: torch.fx.Node, constants: frozenset[torch.fx.Node] = frozenset()) -> OpClass:
    """The kind of the op ``node`` runs (a ``call_function`` or ``get_attr`` node); ``constants``
    are the graph's :func:`constant_nodes`."""
    facts = _op_facts(node.target)
    return OpClass(_kind(node, constants, facts), *facts[1:])


def classify_all(
    nodes: Sequence[torch.fx.Node], constants: frozenset[torch.fx.Node] = frozenset()
) -> dict[torch.fx.Node, OpClass]:
    """:func:`classify` of each of ``nodes``, what depends on the op alone (its rules in DTensor's
    registry, which no plan changes) worked out once per op.

    Example::

        >>> classify_all(op_nodes(gm), constant_nodes(gm.graph))[mm_node].kind
        'strategy'
    """
    facts: dict[Any, tuple[OpKind | None, str | None, bool, bool]] = {}
    made: dict[tuple[Any, ...], OpClass] = {}  # (one object per class: they are frozen)
    out = {}
    for node in nodes:
        known = facts.get(node.target)
        if known is None:
            known = facts[node.target] = _op_facts(node.target)
        key = (_kind(node, constants, known), *known[1:])
        if key not in made:
            made[key] = OpClass(*key)
        out[node] = made[key]
    return out


def _op_facts(op: Any) -> tuple[OpKind | None, str | None, bool, bool]:
    """What :func:`classify` reads of the op alone: the kind it makes any call of it (``None``: as
    its arguments say), its DTensor rules, whether it runs on the local shards, whether it is a
    ragged reduction."""
    rules = _compat.registered_rules(op)
    local = rules == "single" and op not in DISPATCHER_SPECIAL and op not in SHAPE_ARGUMENT_OPS
    kind: OpKind | None = (
        "manual"
        if op in region.REGION_OPS
        else "constraint"
        if op is constraint.CONSTRAINT_OP
        else "value_blind"
        if op in VALUE_BLIND_OPS
        else None
    )
    return kind, rules, local, op in RAGGED_REDUCTIONS


def _kind(
    node: torch.fx.Node, constants: frozenset[torch.fx.Node], facts: tuple[OpKind | None, str | None, bool, bool]
) -> OpKind:
    """The kind of ``node``'s op, given what its op alone decides (:func:`_op_facts`)."""
    kind, rules = facts[:2]
    if kind != "manual" and (node.op == "get_attr" or not any(is_tensor_node(a) for a in node.all_input_nodes)):
        return "constant"  # (no tensor argument)
    if kind is None:
        return "strategy" if rules is not None else "constant" if node in constants else "none"
    return kind


def constant_nodes(graph: torch.fx.Graph) -> frozenset[torch.fx.Node]:
    """The values of ``graph`` computed from constants alone: tensors the traced function made
    itself (``get_attr`` constants, factory ops such as ``arange``/``full``/``scalar_tensor``) and
    deterministic ops on those (a causal mask built in ``forward``). Random ops are not constants,
    nor a region's ``axis_index`` (each rank has its own)."""
    found: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            found.add(node)
        elif (
            node.op == "call_function"
            and found.issuperset(node.all_input_nodes)
            and not _seeded(node.target)
            and node.target is not region.AXIS_INDEX_OP
        ):
            found.add(node)
    return frozenset(found)


def _weight_norm_backward(
    grad_w: torch.Tensor, v: torch.Tensor, g: torch.Tensor, norms: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_weight_norm_interface_backward`` (of ``w = v * g / norms``, the norms of ``v`` over every dim
    but ``dim``) as its formula's ops: ``grad_g = sum(grad_w * v) / norms`` and ``grad_v = (g / norms)
    * (grad_w - v * sum(grad_w * v) / norms**2)``, the sums over the dims the norms reduce."""
    dims = [d for d in range(v.dim()) if d != dim]
    sums = (grad_w * v).sum(dims, keepdim=True).to(norms.dtype)
    grad_v = (g / norms) * (grad_w - v * (sums / (norms * norms)))
    return grad_v.to(v.dtype), (sums / norms).to(g.dtype)


# Weight norm (``torch.nn.utils.parametrizations.weight_norm``), decomposed in every graph: DTensor
# has no strategy for its fused forward or backward, nor PyTorch a decomposition of the backward.
# As reductions over each output's inputs (PyTorch's decomposition of the forward, the formula
# above for the backward), they split over a sharded dim as partial sums.
WEIGHT_NORM_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten._weight_norm_interface_backward.default: _weight_norm_backward
}
WEIGHT_NORM_OPS = frozenset({aten._weight_norm_interface.default, *WEIGHT_NORM_DECOMPOSITIONS})


def unplanned_ops(gm: torch.fx.GraphModule) -> set[Any]:
    """The aten ops of ``gm`` that the planner has no (trusted) strategy for: of kind ``none``
    (no DTensor or vsf strategy, not computing a constant), or in :data:`UNTRUSTED_STRATEGIES`.
    :func:`vsf.jit.trace.trace` decomposes them; what is left is a :class:`~vsf.errors.PlanError`.

    Example::

        >>> gm = make_fx(lambda x, y: torch.nn.functional.mse_loss(x, y))(torch.randn(4), torch.randn(4))
        >>> unplanned_ops(gm)
        {<OpOverload(op='aten.mse_loss', overload='default')>}
    """
    found: set[Any] = set()
    planned: set[Any] = set()  # the ops never of kind none (no rules are taken away meanwhile)
    constants: frozenset[torch.fx.Node] | None = None
    for node in op_nodes(gm):
        op = node.target
        if op in found or op in planned:
            continue
        if op in UNTRUSTED_STRATEGIES or op in BATCH_NORM_OPS or op in VARIANCE_DECOMPOSITIONS or op in WEIGHT_NORM_OPS:
            found.add(op)
        elif _compat.op_schema(op) is None or _compat.registered_rules(op) is not None:
            planned.add(op)
        else:
            constants = constant_nodes(gm.graph) if constants is None else constants
            if classify(node, constants).kind == "none" and not _adopt_inplace_strategy(op):
                found.add(op)
    return found


@functools.cache
def never_planned_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decompositions of the ops :func:`unplanned_ops` names in every graph they are in, for the
    tracer's first pass, so that no second trace is needed to decompose them (and for every later
    one, so that the pieces of another op's decomposition are decomposed alike): PyTorch's of
    :data:`UNTRUSTED_STRATEGIES` (``nll_loss_forward``, in every language model's loss) and of
    :data:`BATCH_NORM_OPS` and of weight norm's forward, vsf's :data:`VARIANCE_DECOMPOSITIONS` and
    :data:`WEIGHT_NORM_DECOMPOSITIONS`.

    Example::

        >>> aten.nll_loss_forward.default in never_planned_decompositions()
        True
    """
    torch_own = UNTRUSTED_STRATEGIES | BATCH_NORM_OPS | (WEIGHT_NORM_OPS - WEIGHT_NORM_DECOMPOSITIONS.keys())
    return {op: _compat.decomposition(op) for op in torch_own} | VARIANCE_DECOMPOSITIONS | WEIGHT_NORM_DECOMPOSITIONS


def _adopt_inplace_strategy(op: Any) -> bool:
    """Functionalization turns ``x.foo_(...)`` into ``foo(x, ...)``; where DTensor registers a
    strategy only for the in-place ``foo_`` (``copy_``: T5's ``shifted[..., 1:] = ids[..., :-1]``),
    the functional op takes it (it computes the same values into a new tensor)."""
    schema = _compat.op_schema(op)
    namespace, _, base = schema.name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), base + "_", None)
    twin = getattr(packet, _compat.overload_name(op), None) if packet is not None else None
    if twin is None or len(_compat.op_schema(twin).arguments) != len(schema.arguments):
        return False
    return _compat.register_like(op, twin)
