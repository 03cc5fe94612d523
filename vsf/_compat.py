"""The one place where vsf touches private PyTorch APIs.

Everything that a PyTorch upgrade may rename or change lives here: the fake process group,
``LocalTensorMode`` / ``LocalTensor`` (simulated ranks with real numbers), ``_StridedShard``
(a multi-axis spec entry whose order differs from the mesh order) and the functional
collectives (``torch.distributed._functional_collectives``) that ``vsf.ops`` runs on. Other
modules import these names from here only.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed._local_tensor import (
    LocalTensor,
    LocalTensorMode,
    _check_for_subclass,
    _for_each_rank_run_func,
    _is_in_fake_tensor_mode,
    enabled_local_tensor_mode,
    maybe_disable_local_tensor_mode,
)
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, OutputSharding, TupleStrategy
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops.single_dim_strategy import (
    _fill_single_dim_strategy_placeholders,
    _insert_single_dim_replication_strategy,
    _resolve_foreach_elementwise_overload,
    _ShardingPlaceholder,
    register_single_dim_strategy,
)
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, is_tensor_shardable, register_op_strategy
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor._redistribute import _gen_transform_infos, redistribute_local_tensor
from torch.distributed.tensor.placement_types import Placement, Shard
from torch.fx.proxy import _register_stack_trace_anchor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._decomp import decomposition_table, meta_table
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    "DTensorSpec",
    "FakeTensorMode",
    "LocalTensor",
    "LocalTensorMode",
    "OpSchema",
    "OpSpec",
    "OpStrategy",
    "OutputSharding",
    "StridedShard",
    "TensorMeta",
    "TupleStrategy",
    "abstract_device_mesh",
    "active_local_mode",
    "clear_sharding_caches",
    "decomposition",
    "dispatcher_special_ops",
    "dtensor_from_local",
    "is_tensor_shardable",
    "local_tensor_mode",
    "redistribute_local_tensor",
    "reduce_partial",
    "foreach_elementwise_op",
    "fused_adam_",
    "fused_adam_lr",
    "redistribute_steps",
    "register_stack_anchor",
    "sharding_propagator",
    "single_dim_strategies",
    "dtensor_like",
    "dtensor_local",
    "functional_collectives",
    "init_fake_process_group",
    "local_mode_disabled",
    "local_shards",
    "make_local",
    "one_rank_device_mesh",
    "op_schema",
    "position_in_copy",
    "quiet_redistribute",
    "register_attention",
    "register_elementwise",
    "register_fake_via_dtype",
    "register_like",
    "single_rank_device_mesh",
]


def init_fake_process_group(world_size: int) -> None:
    """Initialise the default process group as PyTorch's fake backend of ``world_size`` ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


@contextlib.contextmanager
def quiet_redistribute() -> Iterator[None]:
    """Silence DTensor's advice to flatten mesh dims while vsf gathers a value on purpose."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def single_rank_device_mesh(device_type: str, rank: int, name: str) -> DeviceMesh:
    """A one-rank DeviceMesh that creates no communicator (a sub-mesh of size-1 axes)."""
    return DeviceMesh(device_type, torch.tensor([rank]), mesh_dim_names=(name,), _init_backend=False)


def one_rank_device_mesh(device_type: str, world_size: int, name: str) -> DeviceMesh:
    """A DeviceMesh of one rank per copy, one copy for each of ``world_size`` ranks (a sub-mesh
    of size-1 axes): every rank sees itself, and no communicator is created."""
    return DeviceMesh(
        device_type,
        _layout=_MeshLayout.from_sizes_strides((1,), (1,)),
        _rank_map=torch.arange(world_size, dtype=torch.int),
        mesh_dim_names=(name,),
        _init_backend=False,
    )


def position_in_copy(dm: DeviceMesh, rank: int) -> tuple[int, ...] | None:
    """``rank``'s coordinate in its own copy of ``dm``, or ``None`` if no copy holds it.

    A DeviceMesh sliced from a bigger one (``root["tp"]``) exists once per group of ranks; each
    rank sees the copy it belongs to. Simulated ranks all live in one process, so vsf needs the
    position of every rank in its own copy, which only the slice's private layout records.
    """
    copies = dm._layout.remap_to_tensor(dm._rank_map)  # (number of copies, *dm.shape)
    hits = (copies == rank).nonzero()
    return tuple(hits[0, 1:].tolist()) if len(hits) else None


def local_tensor_mode(n: int) -> LocalTensorMode:
    """``LocalTensorMode(n)`` (``n`` simulated ranks, real numbers) in which an explicit
    ``torch.Generator`` behaves as one generator per rank, as in ``n`` separate processes.

    PyTorch's mode keeps per-rank states only for the default generator: it runs an op once per
    rank, so an op given ``generator=g`` draws rank 0's values from ``g``, rank 1's from where
    rank 0 left ``g``, and so on. Here every rank draws from its own copy of ``g``'s state (all
    equal to ``g``'s state when it was seeded or last set), and ``g`` is left in the state one
    process would leave it in (rank 0's when shards of different sizes made the ranks' states
    differ; the others are kept for the next draw as long as ``g`` is not reseeded).

    Example::

        >>> with local_tensor_mode(2):
        ...     x = torch.randint(9, (4,), generator=torch.Generator().manual_seed(7))   # equal on both ranks
    """
    return _RankGeneratorsMode(n)


class _RankGeneratorsMode(LocalTensorMode):
    """:func:`local_tensor_mode`'s mode: each explicit generator's state is kept per rank."""

    def __init__(self, ranks: int) -> None:
        super().__init__(ranks)
        # While the ranks' states of a generator differ: the state it was left in and each rank's,
        # keyed by the C++ generator (each op receives a new Python wrapper of it). An entry whose
        # generator is gone or was reseeded no longer matches the generator's state, and is ignored.
        self._generator_states: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        generators = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)]
        if not generators or self._disable or _is_in_fake_tensor_mode() or not self._runs_per_rank(args, kwargs):
            return super().__torch_dispatch__(func, types, args, kwargs)
        states = {g: self._rank_states(g) for g in generators}
        results = {}
        for r in sorted(self.ranks):
            for g, per_rank in states.items():
                g.set_state(per_rank[r])
            results[r] = _for_each_rank_run_func(func, frozenset({r}), args, kwargs)
            for g, per_rank in states.items():
                per_rank[r] = g.get_state()
        for g, per_rank in states.items():
            self._leave(g, per_rank)
        return _combine_one_rank_results(results, _tree_leaves((args, kwargs)))

    def _runs_per_rank(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Would LocalTensorMode run this op once per rank (not once, on plain tensors)?"""
        flat = _tree_leaves((args, kwargs))
        if _check_for_subclass(flat):
            return False
        return any(isinstance(a, LocalTensor) for a in flat) or not any(isinstance(a, torch.Tensor) for a in flat)

    def _rank_states(self, g: torch.Generator) -> dict[int, torch.Tensor]:
        visible = g.get_state()
        kept = self._generator_states.get(g._cdata)
        if kept is not None and torch.equal(kept[0], visible):
            return dict(kept[1])
        return {r: visible for r in self.ranks}

    def _leave(self, g: torch.Generator, per_rank: dict[int, torch.Tensor]) -> None:
        first = per_rank[min(per_rank)]
        g.set_state(first)
        if all(torch.equal(s, first) for s in per_rank.values()):
            self._generator_states.pop(g._cdata, None)
        else:
            self._generator_states[g._cdata] = (first, per_rank)


def _combine_one_rank_results(results: dict[int, Any], inputs: list[Any]) -> Any:
    """One op's results, run rank by rank (each a LocalTensor of one rank), as one result over all
    ranks; a result that is one of the op's ``inputs`` (in-place and ``out=`` ops) already holds
    every rank's shard."""
    given = {id(a) for a in inputs if isinstance(a, LocalTensor)}
    flat = {r: torch.utils._pytree.tree_flatten(v) for r, v in results.items()}
    leaves, spec = flat[max(results)]
    combined = [
        LocalTensor({r: flat[r][0][i]._local_tensors[r] for r in results}) if isinstance(leaf, LocalTensor) and id(leaf) not in given else leaf
        for i, leaf in enumerate(leaves)
    ]
    return torch.utils._pytree.tree_unflatten(combined, spec)


def active_local_mode() -> LocalTensorMode | None:
    """The enabled ``LocalTensorMode`` (simulated ranks with real numbers), if any."""
    return enabled_local_tensor_mode()


@contextlib.contextmanager
def local_mode_disabled() -> Iterator[None]:
    """Temporarily run plain (non-simulated) tensor code, e.g. to build a DeviceMesh."""
    with maybe_disable_local_tensor_mode():
        yield


def local_shards(t: torch.Tensor, rank: int) -> dict[int, torch.Tensor]:
    """Per-rank values of ``t``: every simulated rank for a ``LocalTensor``, else ``{rank: t}``."""
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    return {rank: t}


def make_local(per_rank: dict[int, torch.Tensor]) -> torch.Tensor:
    """Build a ``LocalTensor`` holding ``per_rank[r]`` on simulated rank ``r``."""
    return LocalTensor({r: v.detach() for r, v in per_rank.items()})


def reduce_partial(p: Placement, values: Sequence[torch.Tensor]) -> torch.Tensor:
    """What the pending reduction ``p`` (a DTensor ``Partial``) makes of the values the ranks
    along its mesh dim hold: their sum, mean, max or min, or for a partial p-norm (DTensor's
    ``_NormPartial``, e.g. ``linalg_vector_norm`` of a shard) ``(sum of v**p) ** (1/p)``.

    Example::

        >>> reduce_partial(Partial("max"), [torch.tensor(1.0), torch.tensor(3.0)])   # tensor(3.)
    """
    stacked = torch.stack(list(values))
    if isinstance(p, _NormPartial):
        stacked = p._pre_reduce_transform(stacked)
    reduce = {"sum": torch.sum, "avg": torch.mean, "max": torch.amax, "min": torch.amin}
    if p.reduce_op not in reduce:
        raise ValueError(f"cannot carry out a pending {p.reduce_op!r} reduction ({p})")
    out = reduce[p.reduce_op](stacked, dim=0)
    return (p._post_reduce_transform(out) if isinstance(p, _NormPartial) else out).to(values[0].dtype)


def clear_sharding_caches() -> None:
    """Empty DTensor's sharding-propagation caches (Python and C++ fast path).

    ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` does the same, but importing
    that package imports numpy, which neither torch nor vsf depends on."""
    sharding_propagator().propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def sharding_propagator():  # noqa: ANN201  (DTensor's ShardingPropagator)
    """DTensor's registry of per-op sharding strategies and rules."""
    return DTensor._op_dispatcher.sharding_propagator


@functools.cache
def abstract_device_mesh(n: int) -> DeviceMesh:
    """A 1D DeviceMesh of ``n`` ranks with no process group: enough to ask DTensor's strategies."""
    return DeviceMesh("cpu", torch.arange(n), _init_backend=False, _rank=0)


def single_dim_strategies(op: Any, args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any], out_meta: Any) -> list[list[Placement | None]] | None:
    """DTensor's strategies for ``op`` over one mesh dim, as ``[outputs..., inputs...]`` placement lists
    (``None`` if the op has no single-dim rule)."""
    info = sharding_propagator().op_single_dim_strategy_funcs.get(op)
    if info is None:
        return None
    rules = info.func(op, args_meta, kwargs_meta)
    n_in = sum(isinstance(a, TensorMeta) for a in _tree_leaves((args_meta, kwargs_meta), is_leaf=lambda x: isinstance(x, TensorMeta)))
    n_out = (len(rules[0]) - n_in) if rules else (1 if isinstance(out_meta, TensorMeta) else len(out_meta))
    rules = _insert_single_dim_replication_strategy(rules, n_out, n_in, out_meta)
    return _fill_single_dim_strategy_placeholders({Shard(0)}, rules)


def op_schema(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpSchema:
    """DTensor's ``OpSchema`` for ``op`` on these args, with the runtime schema info DTensor's own
    dispatcher gives it: without it the schema's cache key leaves out the non-tensor arguments, so
    ``view(x, [4, 16, 4, 8])`` and ``view(x, [64, 32])`` share one cached answer."""
    prop = sharding_propagator()
    info = prop.op_to_schema_info.get(op) or prop.op_to_schema_info_for_single_dim_strategy.get(op)
    return OpSchema(op, args, kwargs, schema_info=info)


def _tree_leaves(x: Any, is_leaf: Any = None) -> list[Any]:
    return torch.utils._pytree.tree_leaves(x, is_leaf=is_leaf)


def foreach_elementwise_op(op: Any) -> Any:
    """The per-tensor op a ``_foreach_*`` overload applies to each element (``None`` if unknown)."""
    return _resolve_foreach_elementwise_overload(op)


def redistribute_steps(src: DTensorSpec, dst: DTensorSpec) -> list[tuple[int, Placement, Placement, tuple[int, ...]]]:
    """The per-mesh-dim steps DTensor takes from ``src`` to ``dst``: ``(mesh_dim, from, to, logical_shape)``."""
    return [(t.mesh_dim, *t.src_dst_placements, tuple(t.logical_shape)) for t in _gen_transform_infos(src, dst)]


def register_stack_anchor(fn: Any) -> None:
    """Make fx record stack frames of ``fn`` on traced nodes (for errors that name the user's line)."""
    _register_stack_trace_anchor(fn)


def dtensor_from_local(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """Wrap ``local`` as a DTensor with ``spec`` (no checks, no autograd node: the fast path)."""
    return DTensor(local, spec, requires_grad=False)


def dispatcher_special_ops() -> frozenset[Any]:
    """Ops DTensor's dispatcher runs its own way (random ops, custom handlers): lower them through DTensor."""
    d = DTensor._op_dispatcher
    return frozenset(d._random_ops) | frozenset(d._custom_op_handlers)
def dtensor_local(x: DTensor) -> torch.Tensor:
    """A DTensor's local shard itself: ``to_local()`` without its autograd function and view
    (which cost milliseconds per call under ``LocalTensorMode``). For non-differentiable math."""
    return x._local_tensor


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` (same dtype as ``like``) as a DTensor with ``like``'s mesh, placements and global
    shape: ``DTensor.from_local`` without its autograd function and view. ``local`` may live on
    another device than the mesh (a host copy staged for an async checkpoint)."""
    return DTensor(local, like._spec, requires_grad=local.requires_grad)


def fused_adam_(
    update: torch.Tensor, grad: torch.Tensor, mu: torch.Tensor, nu: torch.Tensor, count: torch.Tensor, lr: torch.Tensor, b1: float, b2: float, eps: float
) -> None:
    """PyTorch's fused Adam kernel (``torch.optim.Adam(fused=True)``'s) on one tensor of each kind,
    all of one dtype and memory order: ``update`` is stepped as the param (no weight decay),
    ``mu`` and ``nu`` are updated in place; ``count`` is the step number (float32, on their
    device), ``lr`` from :func:`fused_adam_lr`."""
    torch._fused_adam_(
        [update], [grad], [mu], [nu], [], [count], lr=lr, beta1=b1, beta2=b2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False
    )


def fused_adam_lr(lr: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The learning rate as a 0-d tensor for the fused Adam kernel on ``device``: a float64 CPU
    tensor, which the CPU kernel reads as the double a Python float is (bit for bit), or a
    schedule's value computed on an accelerator, kept there as float32 (not run: no GPU here)."""
    if not isinstance(lr, torch.Tensor):
        return torch.full((), lr, dtype=torch.float64)
    return lr.to(dtype=torch.float64) if device.type == "cpu" else lr.to(device=device, dtype=torch.float32)


def register_elementwise(op: Any, *, outputs: int) -> None:
    """Tell DTensor's sharding propagation that ``op`` is elementwise: its tensor arguments of the
    first one's shape and its ``outputs`` results may be split alike on any dim; its other tensor
    arguments (0-d scalars) stay replicated."""

    def rules(op: Any, args: Any, kwargs: Any) -> list[list[Any]]:
        tensors = [a for a in args if isinstance(a, TensorMeta)]
        shape = tensors[0].shape
        return [
            [_ShardingPlaceholder(d)] * outputs + [_ShardingPlaceholder(d) if t.shape == shape else Replicate() for t in tensors]
            for d in range(len(shape))
        ]

    register_single_dim_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=len(op._schema.arguments)))(rules)


def decomposition(op: Any) -> Any:
    """PyTorch's own decomposition of ``op`` into other aten ops (``torch._decomp``), or ``None``."""
    return decomposition_table.get(op)


_MASKS = ("attn_mask", "attn_bias")


def register_attention(op: Any) -> None:
    """Tell DTensor's sharding propagation how the attention op ``op`` splits: on a mesh dim, over
    the batch (dim 0) or the heads (dim 1) of every tensor alike, or replicated. A mask argument
    (``attn_mask``/``attn_bias``, broadcast from the right) is split where it has that dim at full
    size and replicated where it broadcasts; grouped-query heads (fewer key/value heads than query
    heads) split only into equal parts (each rank's query heads must meet their own key/value
    head); with dropout the op is only replicated (its random draw is not sharding-invariant).

    Example::

        >>> register_attention(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    """
    names = [a.name for a in op._schema.arguments]
    n_out = sum(isinstance(r.type, torch.TensorType) for r in op._schema.returns)

    def strategy(op_schema: OpSchema) -> OpStrategy:
        mesh = op_schema.get_mesh_from_args(validate=False)
        given = {**dict(zip(names, op_schema.args_schema)), **op_schema.kwargs_schema}
        tensors = [(n, given[n].shape) for n in names if isinstance(given.get(n), OpStrategy)]
        rank = len(given["query"].shape)
        rules = [[Replicate()] * (n_out + len(tensors))]
        if given.get("dropout_p", 0.0) == 0.0:
            for d in (0, 1):
                rules.append([Shard(d)] * n_out + [_attention_split(name, shape, d, rank) for name, shape in tensors])
        grouped = given["query"].shape[1] != given["key"].shape[1]
        return expand_to_full_mesh_op_strategy(
            mesh, op_schema, rules, input_index=n_out, is_valid_strategy_cb=_equal_head_splits(mesh) if grouped else None
        )

    register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=names.index("dropout_p")))(strategy)


def _attention_split(name: str, shape: Any, d: int, rank: int) -> Placement:
    if name not in _MASKS:
        return Shard(d)
    m = len(shape) - rank + d  # masks broadcast from the right
    return Shard(m) if m >= 0 and shape[m] > 1 else Replicate()


def _equal_head_splits(mesh: DeviceMesh) -> Any:
    def ok(input_specs: list[DTensorSpec], output_specs: Any) -> bool:
        specs = [*input_specs, *(output_specs if isinstance(output_specs, (tuple, list)) else (output_specs,))]
        for s in specs:
            if s is None or s.tensor_meta is None:
                continue
            parts = 1
            for k, p in enumerate(s.placements):
                if isinstance(p, Shard) and p.dim == 1:
                    parts *= mesh.size(k)
            if s.tensor_meta.shape[1] % parts:
                return False
        return True

    return ok


def register_fake_via_dtype(op: Any, dtype: torch.dtype) -> None:
    """Trace ``op`` on fake tensors of any floating dtype where its meta kernel accepts only
    ``dtype`` (while the real kernel runs others: ``_grouped_mm`` in fp32 on CPU): the fake runs
    PyTorch's own meta on the floating inputs cast to ``dtype`` (for the shape and layout checks)
    and returns a result of the dtype the op would return.

    Example::

        >>> register_fake_via_dtype(torch.ops.aten._grouped_mm.default, torch.bfloat16)
    """
    meta = meta_table[op]
    names = [a.name for a in op._schema.arguments]

    def fake(*args: Any, **kwargs: Any) -> torch.Tensor:
        given = {**dict(zip(names, args)), **kwargs}
        floats = [a for a in _tree_leaves(given) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        cast = lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa: E731
        shaped = meta(*(cast(a) for a in args), **{k: cast(v) for k, v in kwargs.items()})
        out_dtype = given.get("out_dtype") or floats[0].dtype
        return torch.empty_strided(shaped.shape, shaped.stride(), dtype=out_dtype, device=shaped.device)

    torch.library.register_fake(op, fake)


def register_like(op: Any, twin: Any) -> bool:
    """Give ``op`` the sharding strategy DTensor registers for ``twin``, an op of the same arguments
    and results computed alike (the functional ``aten.copy`` that functionalization makes of an
    in-place ``copy_``); ``False`` if ``twin`` has none.

    Example::

        >>> register_like(torch.ops.aten.copy.default, torch.ops.aten.copy_.default)
        True
    """
    prop = sharding_propagator()
    if twin in prop.op_single_dim_strategy_funcs:
        prop.register_single_dim_op_strategy(op, prop.op_single_dim_strategy_funcs[twin], prop.op_to_schema_info_for_single_dim_strategy.get(twin))
    elif twin in prop.op_strategy_funcs:
        prop.register_op_strategy(op, prop.op_strategy_funcs[twin], prop.op_to_schema_info.get(twin))
    else:
        return False
    return True


def fake_mode_active() -> bool:
    """True while tensors are fake (inside ``make_fx`` tracing, ``FakeTensorMode``, ``vsf.eval_shape``)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def dispatch_mode_base() -> type:
    """``TorchDispatchMode``: the base of a mode that sees every aten op (below autograd, above subclasses)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode
