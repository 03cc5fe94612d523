"""The one place where vsf touches private PyTorch APIs.

Everything that a PyTorch upgrade may rename or change lives here: the fake process group,
``LocalTensorMode`` / ``LocalTensor`` (simulated ranks with real numbers), ``_StridedShard``
(a multi-axis spec entry whose order differs from the mesh order), the functional
collectives (``torch.distributed._functional_collectives``) that ``vsf.ops`` runs on, fake
tensors, PyTorch's own pytree, and DTensor's strategy registry and redistribution.

It exports verbs (ask DTensor for an op's strategies, for its decision on given input
placements; redistribute a local tensor; swap a DTensor's local tensor; build a fake or local
mode), not PyTorch's private types: other modules never construct or inspect those, so a
PyTorch change breaks this file only (``tests/test_structure.py`` checks that no other module
names a private PyTorch symbol). The one private type exported is ``StridedShard``, a placement
value the layout layer builds and compares. It is one piece on purpose, though over 500 lines: a
PyTorch upgrade is checked against this file alone.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
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
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor._ops.single_dim_strategy import (
    _fill_single_dim_strategy_placeholders,
    _insert_single_dim_replication_strategy,
    _resolve_foreach_elementwise_overload,
    _ShardingPlaceholder,
    register_single_dim_strategy,
)
from torch.distributed.tensor._ops.utils import (
    expand_to_full_mesh_op_strategy,
    is_tensor_shardable,
    register_op_strategy,
)
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor._redistribute import (
    _gen_transform_infos,
    clear_redistribute_planner_cache,
    redistribute_local_tensor,
)
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import _ProxyTensor, get_proxy_mode, get_proxy_slot, make_fx, set_proxy_slot
import torch.fx.proxy as fx_proxy
from torch.fx.proxy import _STACK_TRACE_ANCHORS, _register_stack_trace_anchor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch._subclasses.fake_tensor import is_fake as is_fake_tensor
from torch._decomp import decomposition_table, meta_table
from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = [
    "MODULE_STATE",
    "Placed",
    "StridedShard",
    "active_local_mode",
    "below_local_mode",
    "checkpointing_as_eager",
    "clear_sharding_caches",
    "collective_nodes",
    "conversions_checked",
    "copy_holding",
    "copy_nodes",
    "cpp_wrapper_calls",
    "dead_code_asked_when_unread",
    "decomposition",
    "dispatch_mode_base",
    "distinct",
    "real_writes_refused",
    "dispatch_modes_off",
    "dispatcher_special_ops",
    "dtensor_decision",
    "dtensor_from_local",
    "dtensor_layout",
    "dtensor_layouts",
    "dtensor_like",
    "dtensor_local",
    "dtensor_parts",
    "dtensors_from_locals",
    "fake_inputs",
    "fake_mode",
    "fake_mode_active",
    "foreach_elementwise_op",
    "functional_collectives",
    "fused_adam_",
    "fused_adam_lr",
    "generator_key",
    "inductor_compile",
    "init_fake_process_group",
    "interleaved_order",
    "is_data_dependent_error",
    "value_shaped_op",
    "is_fake",
    "is_local_tensor",
    "is_shardable",
    "local_mode_disabled",
    "local_shards",
    "local_tensor_mode",
    "make_local",
    "merge_rank_results",
    "module_calls_through",
    "module_node_copy",
    "module_tables",
    "one_rank_device_mesh",
    "op_schema",
    "other_dispatch_modes",
    "overload_name",
    "pipeline_order",
    "placeholders_at_once",
    "process_group_named",
    "quick_node_values",
    "quiet_redistribute",
    "recorded_meta",
    "reconcile",
    "redistribute_local",
    "redistribute_steps",
    "reduce_partial",
    "reentrant_checkpoint_caller",
    "register_fake_via_dtype",
    "register_like",
    "register_mesh_dim_rules",
    "register_single_dim_rules",
    "register_stack_anchor",
    "kept_frames_only",
    "lazy_graph_modules",
    "registered_rules",
    "run_on_rank",
    "shape_argument_ops",
    "shard_of",
    "single_dim_strategies",
    "single_rank_device_mesh",
    "swap_local",
    "tensor_version",
    "trace_aside",
    "track_as",
    "untraced_like",
    "only_tracing_modes",
    "global_module_hooks",
    "holds_symbolic",
    "metadata_reads",
    "saved_tensor_hooks",
    "stack_trace_now",
    "torch_tree_leaves",
    "torch_tree_map",
    "trace_fake",
    "traced_node",
    "tracer",
    "undeclared_writes",
    "whole_op_strategies",
    "wrapper_tensor",
    "written_values",
]


def process_group_named(name: str) -> dist.ProcessGroup:
    """The process group whose ``group_name`` is ``name`` (what a custom op that communicates
    receives in place of the group, an op's arguments being tensors and plain values)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


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


def one_rank_device_mesh(
    device_type: str, world_size: int, name: str, rank_map: torch.Tensor | None = None
) -> DeviceMesh:
    """A DeviceMesh of one rank per copy, one copy for each of ``world_size`` ranks (a sub-mesh
    of size-1 axes): every rank sees itself, and no communicator is created. ``rank_map`` (a
    permutation of the ranks, default in order) only tells such meshes apart: DTensor takes equal
    ones for each other."""
    return DeviceMesh(
        device_type,
        _layout=_MeshLayout.from_sizes_strides((1,), (1,)),
        _rank_map=(torch.arange(world_size) if rank_map is None else rank_map).to(torch.int),
        mesh_dim_names=(name,),
        _init_backend=False,
    )


def copy_holding(dm: DeviceMesh, rank: int) -> torch.Tensor | None:
    """The global ranks of the copy of ``dm`` that holds ``rank``, shaped as ``dm`` (``None`` if no copy holds it).

    A DeviceMesh sliced from a bigger one (``root["tp"]``) exists once per group of ranks; each
    rank sees the copy it belongs to. Simulated ranks all live in one process, so vsf needs every
    rank's own copy (its position there, its groups), which only the slice's private layout records.
    """
    copies = dm._layout.remap_to_tensor(dm._rank_map)  # (number of copies, *dm.shape)
    hits = (copies == rank).flatten(1).any(1).nonzero()
    return copies[int(hits[0, 0])] if len(hits) else None


def local_tensor_mode(
    n: int, on_generator_op: Callable[[Any, tuple[Any, ...], dict[str, Any], list[torch.Generator]], Any] | None = None
) -> LocalTensorMode:
    """``LocalTensorMode(n)``: ``n`` simulated ranks with real numbers. With ``on_generator_op``,
    an op the mode would run once per rank that is given an explicit ``torch.Generator`` goes to
    ``on_generator_op(func, args, kwargs, generators)`` instead (PyTorch's mode keeps per-rank
    states only for the default generator; :mod:`vsf.runtime` keeps them for explicit ones with
    :func:`run_on_rank`, :func:`merge_rank_results` and :func:`generator_key`).

    An op that writes into a plain tensor (one value, standing for every rank's: made outside
    the mode) while it reads a ``LocalTensor`` writes the value the ranks compute for it once,
    where PyTorch's mode writes it once per rank into the same memory (``buf.add_(x)`` added
    ``x`` ``n`` times). Where the ranks compute different values for it, the op raises a
    ``ValueError``: a plain tensor holds one value.

    Example::

        >>> with local_tensor_mode(2):
        ...     x = torch.ones(2) + 1          # a LocalTensor holding each rank's value
    """
    return _SimulationMode(n, on_generator_op)


class _SimulationMode(LocalTensorMode):
    """:func:`local_tensor_mode`'s mode: PyTorch's, with writes into plain tensors done once, a
    collective's plain tensors held by every rank (run per rank, as ``n`` processes run it, not
    by the fake process group, which leaves them as they were) and ops with explicit generators
    handed to a handler."""

    def __init__(self, ranks: int, on_generator_op: Callable[..., Any] | None) -> None:
        super().__init__(ranks)
        self._on_generator_op = on_generator_op

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self._disable and _schema_name(func) in _NOT_SPMD:
            what, instead = _NOT_SPMD[_schema_name(func)]
            raise NotImplementedError(
                f"{func} under vsf.simulate: the simulated ranks run one program (SPMD), and this op runs only on "
                f"some ranks or differently on each ({what}); use {instead}, which every rank runs"
            )
        if _communicates(func) and not self._disable and not _is_in_fake_tensor_mode():
            args, kwargs = torch_tree_map(lambda a: _on_every_rank(a, self.ranks), (args, kwargs))
        if _written_arguments(func) and not _is_in_fake_tensor_mode() and _runs_per_rank(args, kwargs):
            shared = _shared_written(func, args, kwargs)
            if shared:
                return _write_once(self._run, func, types, args, kwargs, shared, self.ranks)
        return self._run(func, types, args, kwargs)

    def _run(self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        generators = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)]
        if (
            self._on_generator_op is None
            or not generators
            or self._disable
            or _is_in_fake_tensor_mode()
            or not _runs_per_rank(args, kwargs)
        ):
            return super().__torch_dispatch__(func, types, args, kwargs)
        return self._on_generator_op(func, args, kwargs, generators)


# c10d's point-to-point and rooted ops, which no simulated program runs: what each does, and its SPMD form
_NOT_SPMD = {
    "c10d::send": ("a send to one rank", "vsf.ops.ppermute"),
    "c10d::recv_": ("a receive from one rank", "vsf.ops.ppermute"),
    "c10d::recv_any_source_": ("a receive from any rank", "vsf.ops.ppermute"),
    "c10d::reduce_": ("a reduction onto one rank", "dist.all_reduce"),
    "c10d::gather_": ("a gather onto one rank", "dist.all_gather"),
}


def _schema_name(func: Any) -> str | None:
    schema = getattr(func, "_schema", None)
    return None if schema is None else schema.name


def _runs_per_rank(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Would LocalTensorMode run this op once per rank (not once, on plain tensors)?"""
    flat = torch_tree_leaves((args, kwargs))
    if _check_for_subclass(flat):
        return False
    return any(isinstance(a, LocalTensor) for a in flat) or not any(isinstance(a, torch.Tensor) for a in flat)


@functools.cache
def _communicates(func: Any) -> bool:
    """Is the op ``func`` a collective or a point-to-point op of a process group (``c10d``'s, the
    functional collectives')?"""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.name in ("process_group", "group_name") for a in schema.arguments)


def _on_every_rank(a: Any, ranks: frozenset[int]) -> Any:
    """``a``, a plain tensor (made outside ``vsf.simulate``: one value every rank holds), as the
    ``LocalTensor`` whose every rank holds it (one memory: a write into it is done once, or refused
    where the ranks compute different values for it); anything else as it is."""
    return LocalTensor(dict.fromkeys(ranks, a)) if type(a) in (torch.Tensor, torch.nn.Parameter) else a


@functools.cache
def _written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """The position and name of each argument the op ``func`` writes into (``Tensor(a!)`` in its
    schema: ``self`` of an in-place op, ``out``, ``copy_``'s destination; the first argument of a
    ``c10d`` op named in place, whose schema says nothing: ``allreduce_``'s tensors, an all-gather's
    outputs)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    if schema.name.startswith("c10d::") and schema.name.endswith("_"):
        return ((0, schema.arguments[0].name),)
    return tuple(
        (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )


def written_values(
    func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], kind: type = torch.Tensor
) -> list[tuple[str, Any]]:
    """The values of type ``kind`` that the op ``func`` called on ``args`` and ``kwargs`` writes
    into (``Tensor(a!)`` in its schema), each once, with its argument's name: the tensors of a
    call, or with ``kind=torch.fx.Node`` the nodes an FX node's op writes.

    Example::

        >>> written_values(torch.ops.aten.add_.Tensor, (x, y), {})
        [('self', x)]
    """
    written: dict[int, tuple[str, Any]] = {}
    for i, name in _written_arguments(func):
        for t in torch_tree_leaves(args[i] if i < len(args) else kwargs.get(name)):
            if isinstance(t, kind):
                written.setdefault(id(t), (name, t))
    return list(written.values())


def _shared_written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The tensors the op writes into whose memory several simulated ranks share, each with its
    argument's name: a plain tensor (every rank's), or a ``LocalTensor`` whose ranks hold one tensor
    (a constant of a ``vsf.jit`` program)."""
    return [(name, t) for name, t in written_values(func, args, kwargs) if _ranks_share_memory(t)]


def _ranks_share_memory(t: torch.Tensor) -> bool:
    """Do several simulated ranks hold ``t`` in one memory (a plain tensor: all of them)? Tensors
    without memory (no elements, data pointer 0) are no rank's shared memory."""
    if not isinstance(t, LocalTensor):
        return True
    starts = [p for p in (v.data_ptr() for v in t._local_tensors.values()) if p]
    return len(set(starts)) < len(starts)


def _write_once(
    run: Callable[[Any, Any, tuple[Any, ...], dict[str, Any]], Any],
    func: Any,
    types: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    shared: list[tuple[str, torch.Tensor]],
    ranks: frozenset[int],
) -> Any:
    """Run ``func`` per rank with each tensor in ``shared`` replaced by a copy per rank, then write
    into each memory the copies' value once (resized as an ``out=`` argument is); a ``ValueError``
    where the ranks sharing a memory compute different values for it, or where the op would change
    a shared tensor's shape or storage from per-rank values."""
    if torch.Tag.inplace_view in func.tags or func.overloadpacket in (torch.ops.aten.set_, torch.ops.aten.resize_as_):
        name, t = shared[0]
        raise ValueError(
            f"{func} changes the shape or storage of a {tuple(t.shape)} {t.dtype} tensor (its argument {name!r}) "
            "that simulated ranks share (a plain tensor made outside vsf.simulate holds one value for every "
            "rank) from per-rank values; make the tensor inside the simulation or pass it through vsf.device_put"
        )
    targets = {id(t): local_shards(t, 0) if isinstance(t, LocalTensor) else dict.fromkeys(ranks, t) for _, t in shared}
    copies = {k: LocalTensor({r: v.detach().clone() for r, v in per_rank.items()}) for k, per_rank in targets.items()}
    swapped = torch_tree_map(lambda a: copies.get(id(a), a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
    result = run(func, types, *swapped)
    for name, t in shared:
        written = copies[id(t)]._local_tensors
        memories: dict[int, dict[int, torch.Tensor]] = {}
        for r, target in targets[id(t)].items():
            memories.setdefault(target.data_ptr() or id(target), {})[r] = written[r]  # (no memory yet: the tensor)
        for per_rank in memories.values():
            differ = _first_difference(per_rank)
            if differ is not None:
                raise ValueError(
                    f"{func} writes into a {tuple(t.shape)} {t.dtype} tensor (its argument {name!r}) that simulated "
                    f"ranks {differ[0]} and {differ[1]} share (a plain tensor made outside vsf.simulate holds one "
                    "value for every rank), but they compute different values for it; make the tensor inside the "
                    "simulation (it then holds a value per rank) or pass it through vsf.device_put"
                )
            first = min(per_rank)
            target, value = targets[id(t)][first], per_rank[first]
            if target.shape != value.shape:
                target.resize_(value.shape)
            target.copy_(value)
        if isinstance(t, LocalTensor):
            t._sync_meta()
    back = {id(copies[id(t)]): t for _, t in shared}
    return torch_tree_map(lambda a: back.get(id(a), a) if isinstance(a, torch.Tensor) else a, result)


def run_on_rank(func: Any, rank: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the op ``func`` for simulated rank ``rank`` alone (each ``LocalTensor`` argument read at
    that rank): a result whose tensors are ``LocalTensor`` s holding that rank's value."""
    return _for_each_rank_run_func(func, frozenset({rank}), args, kwargs)


def merge_rank_results(results: dict[int, Any], inputs: list[Any]) -> Any:
    """One op's results, run rank by rank (:func:`run_on_rank`), as one result over all ranks; a
    result that is one of the op's ``inputs`` (in-place and ``out=`` ops) already holds every
    rank's shard."""
    given = {id(a) for a in inputs if isinstance(a, LocalTensor)}
    flat = {r: torch.utils._pytree.tree_flatten(v) for r, v in results.items()}
    leaves, spec = flat[max(results)]
    combined = [
        LocalTensor({r: flat[r][0][i]._local_tensors[r] for r in results})
        if isinstance(leaf, LocalTensor) and id(leaf) not in given
        else leaf
        for i, leaf in enumerate(leaves)
    ]
    return torch.utils._pytree.tree_unflatten(combined, spec)


def generator_key(g: torch.Generator) -> int:
    """An identity of the C++ generator behind ``g`` (each op receives a new Python wrapper of it)."""
    return g._cdata


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


def is_local_tensor(t: Any) -> bool:
    """Does ``t`` hold one value per simulated rank (a ``LocalTensor``)?"""
    return isinstance(t, LocalTensor)


def reconcile(t: torch.Tensor) -> torch.Tensor:
    """The one value every simulated rank holds of ``t`` (a ``LocalTensor`` whose ranks must agree),
    as a plain tensor: ``LocalTensor.reconcile`` with NaN equal to NaN at the same positions (a
    diverged loss is still read), and a ``ValueError`` naming the first rank that differs.

    Example::

        >>> reconcile(make_local({0: torch.tensor(float("nan")), 1: torch.tensor(float("nan"))}))   # tensor(nan)
    """
    differ = _first_difference(t._local_tensors)
    if differ is not None:
        raise ValueError(
            f"simulated ranks {differ[0]} and {differ[1]} hold different values of a replicated {tuple(t.shape)} tensor"
        )
    values = t._local_tensors
    return values[min(values)].clone().detach().requires_grad_(t.requires_grad)


def _first_difference(per_rank: dict[int, torch.Tensor]) -> tuple[int, int] | None:
    """The lowest rank and the first rank after it whose value differs from its (NaN equal to NaN
    at the same positions), or ``None`` where every rank holds the same value."""
    ranks = sorted(per_rank)
    first = per_rank[ranks[0]]
    return next(((ranks[0], r) for r in ranks[1:] if not _same_values(first, per_rank[r])), None)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Are ``a`` and ``b`` equal, NaN equal to NaN at the same positions?"""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


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
    """Empty DTensor's caches keyed by meshes: sharding propagation (Python and C++ fast path)
    and redistribution plans, which hold their DeviceMeshes (and so the meshes' process groups).

    ``torch.distributed.tensor.debug._clear_sharding_prop_cache`` clears the first two, but
    importing that package imports numpy, which neither torch nor vsf depends on."""
    _propagator().propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _gen_transform_infos.cache_clear()
    clear_redistribute_planner_cache()


# -- PyTorch's pytree (fx op arguments, DTensor schemas; user pytrees go through vsf.tree) --------


def torch_tree_leaves(x: Any) -> list[Any]:
    """The leaves of ``x`` by PyTorch's own pytree, which knows fx's immutable lists and dicts."""
    return torch.utils._pytree.tree_leaves(x)


def torch_tree_map(fn: Callable[[Any], Any], x: Any) -> Any:
    """``fn`` applied to every leaf of ``x`` by PyTorch's own pytree (see :func:`torch_tree_leaves`)."""
    return torch.utils._pytree.tree_map(fn, x)


# -- fake tensors and op schemas -----------------------------------------------------------------

_META = torch.device("meta")  # (a device given as an object: torch parses a string each call)


def fake_mode() -> FakeTensorMode:
    """A fake tensor mode (shapes and dtypes, no memory) that also accepts real inputs."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_inputs(avals: Sequence[tuple[tuple[int, ...], torch.dtype]], device: str) -> list[torch.Tensor]:
    """Fake tensors of the ``(shape, dtype)`` avals on ``device``, of one new :func:`fake_mode`, that a
    fake-mode ``make_fx`` trace takes as its inputs as they are: their mode's converter holds each
    as its own fake (``make_fx`` converts every input it is given to a fake of its mode, a new
    tensor made through the meta converter, about a fifth of a millisecond a tensor, once per trace
    of the same inputs). Each is the fake ``torch.empty`` makes in the mode, made as
    :func:`untraced_like` makes one, without dispatching ``empty`` through the mode per tensor.

    Example::

        >>> x, = fake_inputs([((4, 8), torch.float32)], "cpu")
        >>> make_fx(torch.sin, tracing_mode="fake")(x)   # sin runs on x itself, not on a copy
    """
    from torch.utils._mode_utils import no_dispatch

    mode = fake_mode()
    with mode:
        like = torch.empty(0, device=device)  # (the mode and the device as the mode's fakes name it)
    with torch._C.DisableTorchFunction(), no_dispatch():
        metas = [torch.empty(shape, dtype=dtype, device=_META) for shape, dtype in avals]
    fakes = [_fake_of(meta, like, False) for meta in metas]
    for t in fakes:
        mode.fake_tensor_converter.set_tensor_memo(t, t)
    return fakes


@contextlib.contextmanager
def lazy_graph_modules() -> Iterator[None]:
    """Inside, the graph modules ``make_fx`` makes generate and compile their Python code when first
    called or read (``gm.code``, ``gm(...)``), not when made or recompiled: a planner that only
    reads a graph's nodes does not pay for compiling it (about a tenth of a traced step's time,
    more for a deep one's long generated function)."""
    with _use_lazy_graph_module(True):
        yield


def trace_fake(
    fn: Callable[..., Any],
    inputs: Sequence[torch.Tensor],
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
) -> torch.fx.GraphModule:
    """``make_fx(fn, tracing_mode="fake")(*inputs)``, except that a real tensor an op meets (a
    constant the traced code closes over, such as a module buffer) becomes a constant of the graph
    instead of an error; an op of ``decompositions`` is traced as the ops its function runs."""
    return make_fx(fn, decompositions, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)


def inductor_compile(
    gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor], cpp_wrapper: bool = False
) -> Callable[..., Any]:
    """Inductor's compile of ``gm``, a graph of aten ops and functional collectives, for inputs
    like ``inputs`` (``torch._inductor.compile``, which ``torch.compile`` runs after Dynamo:
    AOTAutograd functionalizes the graph, in-place writes of its inputs included, and Inductor
    generates its kernels). The result takes and returns what ``gm`` does. ``cpp_wrapper``: the
    code that calls the kernels in order is C++ (Inductor's ``cpp_wrapper``), not Python (the same
    kernels; on CPU it calls the externs through C shims, where the Python wrapper pays an
    interpreter's dispatch per kernel; see :func:`cpp_wrapper_calls`). PyTorch caches the
    artifacts on disk between processes (``TORCHINDUCTOR_CACHE_DIR``): its FX graph cache looks a
    graph up only where the trace's fake mode has a shape environment, which ``compile_fx`` called
    on real inputs does not make (it compiled every graph again in each new process, 12-18 s for the
    benchmark's tiny TP and FSDP steps), so the compile runs in a tracing context whose fake mode
    has one, with the inputs' shapes static, as ``torch.compile(dynamic=False)`` traces them.
    Imported on first use: Inductor takes seconds to import."""
    from torch._inductor import compile as compile_fx
    from torch._inductor import config as inductor_config
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    context = torch._guards.TracingContext.try_get() or torch._guards.TracingContext(
        FakeTensorMode(allow_non_fake_inputs=True, static_shapes=True, shape_env=ShapeEnv())
    )
    with inductor_config.patch(cpp_wrapper=cpp_wrapper), torch._guards.tracing(context):
        return compile_fx(gm, list(inputs))


# the functional collectives Inductor's C++ wrapper calls through C shims; it passes any other to
# Python, which fails for those taking an untyped argument (all_gather_into_tensor's, torch 2.13)
_CPP_WRAPPER_COLLECTIVES = frozenset({"all_reduce", "all_reduce_", "wait_tensor"})


def cpp_wrapper_calls(gm: torch.fx.GraphModule) -> bool:
    """Can Inductor's C++ wrapper (:func:`inductor_compile`'s ``cpp_wrapper``) call every functional
    collective ``gm`` issues (all-reduces and waits: yes; gathers, scatters, all-to-alls: no)?"""
    return all(
        n.target.namespace != "_c10d_functional" or n.target.__name__.split(".")[0] in _CPP_WRAPPER_COLLECTIVES
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    )


def checkpointing_as_eager() -> contextlib.AbstractContextManager[None]:
    """Inside, ``torch.utils.checkpoint`` traced by ``make_fx`` recomputes as it does eagerly (a
    selective policy's saved results are kept and the rest is run again in the backward, where the
    trace records it), instead of running once and tagging the graph's nodes for
    ``torch.compile``'s partitioner (what it does under any proxy mode otherwise): torch's flag for
    non-strict ``make_fx`` tracing, which ``torch.export`` sets for the same reason."""
    return torch.compiler._non_strict_tracing_context()


def tracer() -> Any | None:
    """The tracer of the innermost ``make_fx`` trace running now (``None`` outside one): an opaque
    handle for :func:`traced_node`."""
    mode = get_proxy_mode()
    return mode.tracer if mode is not None else None


def traced_node(t: torch.Tensor, by: Any) -> torch.fx.Node | None:
    """The node of the graph ``by`` (a :func:`tracer`) is building that computes the traced tensor
    ``t`` (``None`` where that trace does not track ``t``)."""
    return get_proxy_slot(t, by, None, _node_of)


def _node_of(slot: Any) -> torch.fx.Node:
    return slot.proxy.node


class _KeptFrames:
    """What ``torch.utils._traceback.CapturedTraceback`` is to fx's ``create_node``, giving only the
    Python frames a stack trace recorded for forward frames keeps (``make_fx``'s tracer:
    ``forward`` frames, ``torch/__init__.py``'s, the registered anchors), without symbolizing and
    reading the source lines of the others (a quarter of tracing a GPT step)."""

    def __init__(self, frame: Any) -> None:
        self.frame = frame

    @staticmethod
    def extract(*, script: bool = False, cpp: bool = False, skip: int = 0) -> "_KeptFrames":
        assert not (script or cpp or skip), "fx records Python frames only"
        return _KeptFrames(sys._getframe(1))

    def summary(self) -> traceback.StackSummary:
        kept = []
        f = self.frame
        while f is not None:
            code = f.f_code
            if (
                code.co_name == "forward"
                or code.co_filename.endswith("torch/__init__.py")
                or (code.co_filename, code.co_name) in _STACK_TRACE_ANCHORS
            ):
                kept.append(traceback.FrameSummary(code.co_filename, f.f_lineno, code.co_name))
            f = f.f_back
        return traceback.StackSummary.from_list(kept[::-1])


@contextlib.contextmanager
def kept_frames_only() -> Iterator[None]:
    """Inside, ``make_fx(..., record_stack_traces=True)`` records on each node the stack trace it
    records anyway (the frames of ``forward`` methods and of the registered anchors, outermost
    first) at the cost of walking the Python frames: fx's own capture symbolizes every frame of
    the stack first. For ``make_fx``'s tracer only (it keeps forward frames alone)."""
    captured = fx_proxy.CapturedTraceback
    fx_proxy.CapturedTraceback = _KeptFrames
    try:
        yield
    finally:
        fx_proxy.CapturedTraceback = captured


@contextlib.contextmanager
def dead_code_asked_when_unread() -> Iterator[None]:
    """Inside, fx's ``Graph.eliminate_dead_code`` given a side-effect predicate (``make_fx``'s pass
    over the graph it made, which removes only unread shape accessors) removes what it removes,
    last first, but asks the predicate only of the nodes nothing reads, and skips its consistency
    check of the whole graph first: fx asks every node (about two milliseconds a layer of a deep
    step's trace, to remove nothing). Without a predicate, and for the graph modules a graph
    reads, fx's own pass runs."""
    original = torch.fx.Graph.eliminate_dead_code

    def eliminate_dead_code(
        graph: torch.fx.Graph, is_impure_node: Callable[[torch.fx.Node], bool] | None = None
    ) -> bool:
        if is_impure_node is None:
            return original(graph, is_impure_node)
        changed = False
        for node in reversed(graph.nodes):
            if not node.users and not is_impure_node(node):
                graph.erase_node(node)
                changed = True
        if graph.owning_module is not None:
            read = {n.target for n in graph.find_nodes(op="get_attr")}
            for name, child in graph.owning_module.named_children():
                if name in read and isinstance(child, torch.fx.GraphModule):
                    changed |= child.graph.eliminate_dead_code()
                    child.recompile()
        return changed

    torch.fx.Graph.eliminate_dead_code = eliminate_dead_code  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.fx.Graph.eliminate_dead_code = original  # type: ignore[method-assign]


@contextlib.contextmanager
def quick_node_values() -> Iterator[None]:
    """Inside, ``make_fx`` records on each node the value metadata it records anyway, quicker: the
    snapshot of a fake value (``val``: a fake aliasing its storage, of its metadata, not requiring
    grad) made by :func:`_fake_of`, past the fake tensor constructor's checks, and the ``tensor_meta`` of a fake tensor of static shape
    worked out once per shape, strides, dtype and ``requires_grad`` (its memory format: fx asks up
    to three contiguity questions through the trace's modes per node; a deep step's inputs alone
    take about a millisecond a layer). A value of a real tensor, a quantized, sparse or symbolic
    one goes fx's own way."""
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
    from torch.fx.experimental import proxy_tensor

    detach, extract = proxy_tensor.fast_detach, proxy_tensor._extract_tensor_metadata
    known: dict[tuple[Any, ...], Any] = {}

    def snapshot(mode: Any, x: FakeTensor, include_real: bool = False) -> torch.Tensor:
        if include_real and x.real_tensor is not None:
            return detach(mode, x, include_real)
        with no_python_dispatcher(), in_kernel_invocation_manager(mode), torch._C.DisableTorchFunction():
            alias = torch.ops.aten.detach.default(x)  # (past the trace's torch-function mode: it records nothing)
        return _fake_of(alias, x, False)

    def metadata(t: torch.Tensor, include_contiguity: bool = True) -> Any:
        with torch._C.DisableTorchFunction():
            static = isinstance(t, FakeTensor) and t.layout == torch.strided and not t.is_quantized
            key = (tuple(t.shape), t.stride(), t.dtype, t.requires_grad, include_contiguity) if static else None
        if key is None or any(not isinstance(n, int) for n in (*key[0], *key[1])):
            return extract(t, include_contiguity)
        if key not in known:
            known[key] = extract(t, include_contiguity)
        return known[key]._replace(qparams={})

    proxy_tensor.fast_detach, proxy_tensor._extract_tensor_metadata = snapshot, metadata
    try:
        yield
    finally:
        proxy_tensor.fast_detach, proxy_tensor._extract_tensor_metadata = detach, extract


@contextlib.contextmanager
def placeholders_at_once() -> Iterator[None]:
    """Inside, ``make_fx`` makes the placeholders of a function of plain positional tensors (the
    inputs of a trace, a few thousand for a deep model's step with its optimizer state) as it
    makes them, quicker: each node made as fx's tracer makes it (its name, ``arg3_1``, and scope),
    without the stack trace fx captures and then deletes from a placeholder, nor fx's walk of
    the argument tree; and each input tensor of static shape, strided and fake, tracked by its
    placeholder and given its metadata as fx does (``set_meta``), without fx's questions whether
    its sizes, strides, element count and offset are symbolic, each a call through the trace's
    torch-function modes (about two thirds of a placeholder's cost; the metadata mode only counts
    them, for a module-stack tracer's nodes). A function with keyword or variadic arguments or
    defaults, a trace inside preserved node metadata or a module stack, a module-stack tracer, a
    symbolic or sparse input: fx's own way."""
    from torch.fx import _symbolic_trace
    from torch.fx.experimental import proxy_tensor

    tracer_cls, track = proxy_tensor.PythonKeyTracer, proxy_tensor.track_tensor_tree
    general = _symbolic_trace.Tracer.create_args_for_root
    own = vars(tracer_cls).get("create_args_for_root")  # (a use around this one's, put back after it)

    def create_args_for_root(
        self: Any, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Callable[..., Any], list[Any]]:
        fn = inspect.unwrap(root_fn)
        code = getattr(fn, "__code__", None)
        if (
            is_module
            or code is None
            or not isinstance(concrete_args, tuple)
            or code.co_flags & _symbolic_trace.HAS_VARSTUFF
            or code.co_kwonlyargcount
            or code.co_argcount != len(concrete_args)
            or fn.__defaults__
            or any(a is not _symbolic_trace.PH for a in concrete_args)
            or torch.fx.traceback.has_preserved_node_meta()
            or self.module_stack
        ):
            return general(self, root_fn, is_module, concrete_args)
        scope, proxies = (self.scope.module_path, self.scope.module_type), []
        for name in code.co_varnames[: code.co_argcount]:
            node = self.graph.create_node("placeholder", f"{name}_1", (), {})
            self.node_name_to_scope[node.name] = scope
            proxies.append(self.proxy(node))
        return root_fn, proxies

    def static_input(t: Any, proxy: Any) -> bool:
        if not (isinstance(t, FakeTensor) and isinstance(proxy, torch.fx.Proxy) and proxy.node.op == "placeholder"):
            return False
        with torch._C.DisableTorchFunction():
            numbers = (*t.shape, *t.stride(), t.numel(), t.storage_offset())
            return t.layout == torch.strided and all(type(n) is int for n in numbers)

    def track_tensor_tree(inner_res: Any, proxy_res: Any, *, constant: Any, tracer: Any) -> Any:
        if not (
            constant is None
            and type(inner_res) is list
            and type(proxy_res) is list
            and len(inner_res) == len(proxy_res)
            and not isinstance(tracer, proxy_tensor._ModuleStackTracer)
            and all(map(static_input, inner_res, proxy_res))
        ):
            return track(inner_res, proxy_res, constant=constant, tracer=tracer)
        proxy_tensor._set_unbacked_bindings(inner_res, proxy_res)
        for t, proxy in zip(inner_res, proxy_res):
            proxy_tensor.set_proxy_slot(t, tracer, proxy_tensor._ProxyTensor(proxy, None))
            proxy_tensor.set_meta(proxy, t)
        return inner_res

    tracer_cls.create_args_for_root = create_args_for_root  # type: ignore[method-assign]
    proxy_tensor.track_tensor_tree = track_tensor_tree
    try:
        yield
    finally:
        if own is None:
            del tracer_cls.create_args_for_root
        else:
            tracer_cls.create_args_for_root = own  # type: ignore[method-assign]
        proxy_tensor.track_tensor_tree = track


def is_fake(t: torch.Tensor) -> bool:
    """Is ``t`` a fake tensor (or a wrapper of one)?"""
    return is_fake_tensor(t)


def is_data_dependent_error(e: BaseException) -> bool:
    """Did tracing stop because the function read a tensor's value (``if x.sum() > 0``, ``.item()``)?"""
    return isinstance(e, DataDependentOutputException)


def value_shaped_op(e: BaseException) -> Any:
    """The op whose output's shape depends on its input's values (``aten.nonzero``: ``torch.nonzero``,
    ``torch.where`` of a condition alone, indexing by a boolean mask; ``aten.unique``, ...) that
    stopped a fake-tensor trace with ``e``, or ``None`` where ``e`` is another error."""
    return e.func if isinstance(e, DynamicOutputShapeException) else None


def op_schema(op: Any) -> Any:
    """The ``torch.FunctionSchema`` of an op overload, or ``None`` for anything else."""
    return getattr(op, "_schema", None)


def overload_name(op: Any) -> str:
    """An op overload's name within its packet (``"Tensor"`` for ``aten.add.Tensor``)."""
    return op._overloadname


# -- DTensor's strategies and decisions ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Placed:
    """A tensor argument of an op as DTensor's propagation sees it: its (fake) value and its
    placements, one per mesh dim; the verbs below take op arguments with these in tensor positions."""

    value: torch.Tensor
    placements: tuple[Placement, ...]


def _propagator() -> Any:
    """DTensor's registry of per-op sharding strategies and rules."""
    return DTensor._op_dispatcher.sharding_propagator


@functools.cache
def _abstract_mesh(n: int) -> DeviceMesh:
    """A 1D DeviceMesh of ``n`` ranks with no process group: enough to ask DTensor's strategies."""
    return DeviceMesh("cpu", torch.arange(n), _init_backend=False, _rank=0)


def _tensor_meta(shape: Any, stride: Any, dtype: torch.dtype) -> TensorMeta:
    return TensorMeta(torch.Size(shape), tuple(stride), dtype)


def _meta_of(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def _specs(x: Any, mesh: DeviceMesh) -> Any:
    """``x`` with every :class:`Placed` replaced by DTensor's spec of it on ``mesh``."""
    return torch_tree_map(
        lambda a: DTensorSpec(mesh, a.placements, tensor_meta=_meta_of(a.value)) if isinstance(a, Placed) else a, x
    )


def registered_rules(op: Any) -> str | None:
    """``"single"`` if DTensor registers per-mesh-dim rules for ``op``, ``"full"`` if a whole-op
    strategy or rule, ``None`` if neither."""
    prop = _propagator()
    if op in prop.op_single_dim_strategy_funcs:
        return "single"
    if op in prop.op_strategy_funcs or op in prop.op_to_rules:
        return "full"
    return None


def single_dim_strategies(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, shards: Sequence[Placement] = ()
) -> list[list[Placement | None]] | None:
    """DTensor's strategies for ``op`` over one mesh dim, as ``[outputs..., inputs...]`` placement
    lists (``None`` if the op has no single-dim rule). ``args`` and ``kwargs`` hold the (fake)
    tensors the op takes, ``out`` its result (a tensor, or a list of tensors and ``None``). A rule
    that shards its tensors alike (a placeholder) is given once with plain shards and once per
    strided shard in ``shards`` (its split factor on every dim the rule shards), as DTensor's
    dispatcher fills it for inputs that arrive strided."""
    info = _propagator().op_single_dim_strategy_funcs.get(op)
    if info is None:
        return None
    to_meta = lambda a: _meta_of(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
    args_meta, kwargs_meta = torch_tree_map(to_meta, args), torch_tree_map(to_meta, kwargs)
    out_meta = _meta_of(out) if isinstance(out, torch.Tensor) else [None if o is None else _meta_of(o) for o in out]
    rules = info.func(op, args_meta, kwargs_meta)
    n_in = sum(
        isinstance(a, TensorMeta)
        for a in torch.utils._pytree.tree_leaves((args_meta, kwargs_meta), is_leaf=lambda x: isinstance(x, TensorMeta))
    )
    n_out = (len(rules[0]) - n_in) if rules else (1 if isinstance(out_meta, TensorMeta) else len(out_meta))
    rules = _insert_single_dim_replication_strategy(rules, n_out, n_in, out_meta)
    return _fill_single_dim_strategy_placeholders({Shard(0), *shards}, rules)


Strategy1D = tuple[tuple[Placement, ...], tuple[Placement | None, ...]]


def whole_op_strategies(op: Any, args: Any, kwargs: dict[str, Any], n: int) -> list[Strategy1D] | None:
    """What DTensor's whole-op strategy function (or rule) of ``op`` offers on a 1D mesh of ``n``
    ranks for inputs placed as the :class:`Placed` arguments say: ``(input placements, output
    placements)`` pairs (``None`` if the op has no such function). Raises whatever DTensor raises
    when it rejects the input placements."""
    prop = _propagator()
    func, rule = prop.op_strategy_funcs.get(op), prop.op_to_rules.get(op)
    if func is None and rule is None:
        return None
    n_in = sum(isinstance(a, Placed) for a in torch_tree_leaves((args, kwargs)))
    mesh = _abstract_mesh(n)
    args, kwargs = _specs(args, mesh), _specs(kwargs, mesh)
    if func is not None:
        result = func(_dispatch_schema(op, tuple(_wrap(a) for a in args), {k: _wrap(v) for k, v in kwargs.items()}))
        specs = result.strategies if isinstance(result, OpStrategy) else _tuple_strategy_specs(result)
        out = []
        for s in specs:
            outs = s.output_specs if isinstance(s.output_specs, (tuple, list)) else (s.output_specs,)
            ins = s.input_specs if s.input_specs is not None else (s.output_specs,) * n_in
            out.append(
                (tuple(i.placements[0] for i in ins), tuple(None if o is None else o.placements[0] for o in outs))
            )
        return out
    schema = _dispatch_schema(op, tuple(args), dict(kwargs))
    res = rule(schema)
    if res.output_spec is None:
        schema = res.redistribute_schema
        res = rule(schema)
    ins = [a for a in torch_tree_leaves((schema.args_schema, schema.kwargs_schema)) if isinstance(a, DTensorSpec)]
    outs = res.output_spec if isinstance(res.output_spec, (tuple, list)) else (res.output_spec,)
    return [(tuple(i.placements[0] for i in ins), tuple(None if o is None else o.placements[0] for o in outs))]


def _dispatch_schema(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpSchema:
    """DTensor's description of a call of ``op`` (specs in place of tensors) with the op's
    registered runtime info, as DTensor's dispatcher builds it: that info says which non-tensor
    arguments (a reduction's dims, a view's shape) tell calls apart in DTensor's sharding cache.
    Without it every call with equal specs is one cache entry: ``sum(x, [0, 1])`` answered for
    ``sum(x, [2])`` (the plan said Partial where the program got Shard(0))."""
    prop = _propagator()
    info = prop.op_to_schema_info.get(op) or prop.op_to_schema_info_for_single_dim_strategy.get(op)
    return OpSchema(op, args, kwargs, schema_info=info)


def _wrap(a: Any) -> Any:
    if isinstance(a, DTensorSpec):
        return OpStrategy([OpSpec(a)])
    if isinstance(a, (list, tuple)) and a and all(isinstance(x, DTensorSpec) for x in a):
        return TupleStrategy(tuple(_wrap(x) for x in a))
    return a


def _tuple_strategy_specs(result: Any) -> list[Any]:
    """A TupleStrategy (one child per output) as a list of combined single-output specs."""
    children = result.children
    if not children:
        return []
    combos = []
    for i in range(len(children[0].strategies)):
        specs = [c.strategies[min(i, len(c.strategies) - 1)] for c in children]
        combos.append(
            _Combined(tuple(s.output_specs for s in specs), tuple(x for s in specs for x in (s.input_specs or ())))
        )
    return combos


@dataclasses.dataclass(frozen=True)
class _Combined:
    output_specs: Any
    input_specs: Any


def dtensor_decision(
    op: Any, args: Any, kwargs: Any, mesh: DeviceMesh
) -> tuple[list[tuple[Placement, ...]], list[tuple[Placement, ...] | None]]:
    """What DTensor's dispatcher does for ``op`` on ``mesh`` when its tensor inputs arrive placed as
    the :class:`Placed` arguments say: the input placements it redistributes them to, and the
    placements of its outputs (``None`` for a non-tensor output).

    An op with per-mesh-dim rules is first asked on the mesh dims some input is not replicated
    on (:func:`_on_split_dims`): DTensor combines such rules over every mesh dim, so the full
    question costs the rules' count to the power of the mesh's dims (a ``bmm`` on a 5D mesh:
    minutes), while the dims every input replicates do not change an answer that moves nothing.
    So is an op whose whole-op strategy expands such rules itself (:data:`_EXPANDS_RULES`)."""
    if registered_rules(op) == "single" or op in _EXPANDS_RULES:
        answer = _on_split_dims(op, args, kwargs, mesh)
        if answer is not None:
            return answer
    return _full_decision(op, args, kwargs, mesh)


# ops whose DTensor whole-op strategy is one list of per-mesh-dim rules, read off the op's arguments
# alone (not the mesh), expanded over every mesh dim by ``expand_to_full_mesh_op_strategy`` with no
# validity callback: DTensor's own product, so :func:`_on_split_dims` holds for them as for
# per-mesh-dim rules (``gather``, a loss's: 0.13 s on a 5D mesh, once per plan).
# tests/jit/test_plan_time.py compares their answers with the whole mesh's.
_EXPANDS_RULES = frozenset({torch.ops.aten.gather.default})


def _on_split_dims(
    op: Any, args: Any, kwargs: Any, mesh: DeviceMesh
) -> tuple[list[tuple[Placement, ...]], list[tuple[Placement, ...] | None]] | None:
    """DTensor's decision for an op with per-mesh-dim rules on ``mesh``, asked on an abstract mesh
    of the dims where some input is not replicated (same sizes, same order), where that answer
    moves no input; ``None`` otherwise (ask the whole mesh).

    It is the whole mesh's answer: DTensor expands such rules as the product of one rule per mesh
    dim and, where some combination takes every input as it arrives, runs the last such one
    (nothing negative-cost comes out of the expansion). On a dim every input replicates, the
    rules taking them as they are end, last, in the one that keeps the outputs replicated (asked
    on a one-dim mesh: checked, not assumed); combined with the others, that adds no partial
    type, so the last combination of the whole mesh is the small mesh's last one with those
    dims replicated."""
    leaves = [a.placements for a in torch_tree_leaves((args, kwargs)) if isinstance(a, Placed)]
    split = [k for k in range(mesh.ndim) if any(not isinstance(p[k], Replicate) for p in leaves)]
    if len(split) == mesh.ndim or not leaves:
        return None
    replicated = lambda x: torch_tree_map(lambda a: Placed(a.value, (Replicate(),)) if isinstance(a, Placed) else a, x)  # noqa: E731
    one_ins, outs = _full_decision(op, replicated(args), replicated(kwargs), _abstract_mesh(2))
    if any(p != (Replicate(),) for p in one_ins) or any(o is not None and o != (Replicate(),) for o in outs):
        return None
    if split:
        narrow = lambda x: torch_tree_map(
            lambda a: Placed(a.value, tuple(a.placements[k] for k in split)) if isinstance(a, Placed) else a, x
        )  # noqa: E731
        try:
            ins, outs = _full_decision(
                op, narrow(args), narrow(kwargs), _abstract_grid(tuple(mesh.size(k) for k in split))
            )
        except Exception:  # noqa: BLE001 - refused on the small mesh: the whole mesh answers for itself
            return None
        if ins != [tuple(p[k] for k in split) for p in leaves]:
            return None

    def widen(p: tuple[Placement, ...]) -> tuple[Placement, ...]:
        out: list[Placement] = [Replicate()] * mesh.ndim
        for k, q in zip(split, p):
            out[k] = q
        return tuple(out)

    return [tuple(p) for p in leaves], [None if o is None else widen(o) for o in outs]


@functools.cache
def _abstract_grid(sizes: tuple[int, ...]) -> DeviceMesh:
    """A DeviceMesh of ``sizes`` with no process group: enough to ask DTensor's strategies."""
    return DeviceMesh("cpu", torch.arange(math.prod(sizes)).reshape(sizes), _init_backend=False, _rank=0)


def _full_decision(
    op: Any, args: Any, kwargs: Any, mesh: DeviceMesh
) -> tuple[list[tuple[Placement, ...]], list[tuple[Placement, ...] | None]]:
    """:func:`dtensor_decision` asked of DTensor on the whole of ``mesh``."""
    placed = [a.placements for a in torch_tree_leaves((args, kwargs)) if isinstance(a, Placed)]
    out = _propagator().propagate_op_sharding(_dispatch_schema(op, _specs(args, mesh), _specs(kwargs, mesh)))
    suggested = placed
    if out.needs_redistribute and out.redistribute_schema is not None:
        schema = out.redistribute_schema
        suggested = [
            s.placements
            for s in torch_tree_leaves((schema.args_schema, schema.kwargs_schema))
            if isinstance(s, DTensorSpec)
        ]
    specs = out.output_spec if isinstance(out.output_spec, (tuple, list)) else (out.output_spec,)
    return [tuple(p) for p in suggested], [None if s is None else tuple(s.placements) for s in specs]


def is_shardable(t: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> bool:
    """DTensor's own filter on a layout: every sharded dim of ``t`` has a row per shard."""
    return is_tensor_shardable(t.shape, DTensorSpec(mesh, placements, tensor_meta=_meta_of(t)))


def shard_of(
    t: torch.Tensor, placements: Sequence[Placement], sizes: Sequence[int], coordinate: Sequence[int]
) -> torch.Tensor:
    """The shard of ``t`` that the rank at ``coordinate`` of a mesh of ``sizes`` holds when ``t`` is
    laid out as ``placements``: DTensor's own split of each sharded mesh dim in mesh order (as
    ``distribute_tensor`` makes it), a strided shard's pieces included.

    Example::

        >>> shard_of(torch.arange(8), (StridedShard(0, split_factor=2),), (2,), (1,))
        tensor([2, 3, 6, 7])
    """
    for p, n, c in zip(placements, sizes, coordinate):
        if isinstance(p, (Shard, StridedShard)):
            t = p._split_tensor(t, n, with_padding=False, contiguous=False)[0][c]
    return t


# -- redistribution and DTensor internals ---------------------------------------------------------


def redistribute_steps(
    mesh: DeviceMesh, src: tuple[Placement, ...], dst: tuple[Placement, ...], t: torch.Tensor
) -> list[tuple[int, Placement, Placement, tuple[int, ...]]]:
    """The per-mesh-dim steps DTensor takes moving ``t`` from ``src`` to ``dst``: ``(mesh_dim, from, to, logical_shape)``."""
    meta = _meta_of(t)
    infos = _gen_transform_infos(_moved_spec(mesh, src, meta), _moved_spec(mesh, dst, meta))
    return [(i.mesh_dim, *i.src_dst_placements, tuple(i.logical_shape)) for i in infos]


def redistribute_local(
    local: torch.Tensor,
    mesh: DeviceMesh,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    *,
    shape: Any,
    stride: Any,
    dtype: torch.dtype,
) -> torch.Tensor:
    """This rank's shard of a tensor of global ``shape``/``stride``/``dtype``, moved from ``src`` to
    ``dst`` by DTensor's redistribution (explicit collectives on the local shard)."""
    meta = _tensor_meta(shape, stride, dtype)
    return redistribute_local_tensor(local, _moved_spec(mesh, src, meta), _moved_spec(mesh, dst, meta))


def _moved_spec(mesh: DeviceMesh, placements: tuple[Placement, ...], meta: TensorMeta) -> DTensorSpec:
    """DTensor's spec of a value laid out as ``placements`` for a redistribution, each
    ``_StridedShard`` read as a split factor: the layout DTensor's own view rules give (a merge of
    two dims split over two mesh dims: ``(_StridedShard(0, sf=4), _StridedShard(0, sf=4))``), which
    also reads vsf's axis orders (``P(("tp", "fsdp"))``) right. Given no shard order, torch 2.13
    reads a ``_StridedShard`` as one, and moved such a merged view's pieces to the wrong rows."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta, use_strided_shard_as_shard_order=False)


def dtensor_layout(mesh: DeviceMesh, placements: tuple[Placement, ...], t: torch.Tensor) -> Any:
    """DTensor's description of ``t``'s global shape laid out as ``placements`` on ``mesh``: built
    once, passed to :func:`dtensor_from_local` on every call (an opaque value)."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=_meta_of(t))


def dtensor_layouts(mesh: DeviceMesh, laid_out: Iterable[tuple[tuple[Placement, ...], torch.Tensor]]) -> list[Any]:
    """:func:`dtensor_layout` of each ``(placements, t)``, values laid out alike sharing one (the
    same placements, of the same types, and the same shape, strides and dtype): a step's
    thousands of results hold a few dozen layouts, and DTensor never changes a spec it holds
    (its sharding propagation's cache hands one spec to the results of many calls).

    Example::

        >>> a, b = dtensor_layouts(mesh.device_mesh, [((Shard(0),), x), ((Shard(0),), x.clone())])
        >>> a is b
        True
    """
    made: dict[Any, Any] = {}
    out = []
    for placements, t in laid_out:
        key = (tuple(map(type, placements)), tuple(placements), t.shape, t.stride(), t.dtype)
        if key not in made:
            made[key] = dtensor_layout(mesh, placements, t)
        out.append(made[key])
    return out


def swap_local(x: DTensor, local: torch.Tensor) -> None:
    """Make ``local`` the local shard ``x`` holds (``x`` keeps its mesh, placements and shape)."""
    x._local_tensor = local


def wrapper_tensor(cls: type, like: torch.Tensor) -> torch.Tensor:
    """A tensor of subclass ``cls`` with ``like``'s shape, dtype and device and no storage."""
    return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)


def register_stack_anchor(fn: Any) -> None:
    """Make fx record stack frames of ``fn`` on traced nodes (for errors that name the user's line)."""
    _register_stack_trace_anchor(fn)


def dtensor_from_local(local: torch.Tensor, layout: Any) -> DTensor:
    """Wrap ``local`` as a DTensor laid out as ``layout`` (:func:`dtensor_layout`; no checks, no
    autograd node: the fast path, :func:`_new_dtensor`). A ``local`` that requires grad (a shard
    of ``DTensor.from_local``'s, a pipeline stage's input) is wrapped detached, as DTensor asks
    (it warns otherwise): the DTensor does not require grad either way."""
    return _new_dtensor(local.detach() if local.requires_grad else local, layout, False)


def dtensors_from_locals(locals_: Sequence[torch.Tensor], layouts: Sequence[Any]) -> list[DTensor]:
    """:func:`dtensor_from_local` of each local and layout, in one loop (a step's hundreds of
    results: 0.8 us a DTensor, against 1.3 through the verb for one)."""
    new = DTensor.__new__
    return [new(DTensor, t, layout, requires_grad=False) for t, layout in zip(locals_, layouts)]


def foreach_elementwise_op(op: Any) -> Any:
    """The per-tensor op a ``_foreach_*`` overload applies to each element (``None`` if unknown)."""
    return _resolve_foreach_elementwise_overload(op)


def dispatcher_special_ops() -> frozenset[Any]:
    """Ops DTensor's dispatcher runs its own way (random ops, custom handlers): lower them through DTensor."""
    d = DTensor._op_dispatcher
    return frozenset(d._random_ops) | frozenset(d._custom_op_handlers)


def shape_argument_ops() -> frozenset[Any]:
    """Ops that take sizes of their global tensors as arguments (``native_group_norm``'s N, C and
    HxW, an upsample backward's input size, a view's or ``new_zeros``' shape, ``squeeze``'s dims),
    which DTensor's sharding propagation rewrites to a shard's before it runs the op locally: on a
    shard they must run through DTensor's dispatcher.

    Example::

        >>> torch.ops.aten.native_group_norm.default in shape_argument_ops()
        True
    """
    prop = _propagator()
    return (
        frozenset(prop.op_to_shape_and_stride_idx)
        | frozenset(prop.op_to_scalar_shape_adjuster)
        | frozenset(prop.squeeze_op_to_dims_variant)
    )


def dtensor_local(x: DTensor) -> torch.Tensor:
    """A DTensor's local shard itself: ``to_local()`` without its autograd function and view
    (which cost milliseconds per call under ``LocalTensorMode``). For non-differentiable math."""
    return x._local_tensor


def dtensor_parts(xs: Sequence[Any]) -> list[tuple[torch.Tensor, torch.Size, tuple[Placement, ...], DeviceMesh]] | None:
    """Each DTensor's local shard, global shape, placements and DeviceMesh, read in one pass from
    the layout it carries (its public ``shape`` and ``dtype`` go through the tensor subclass's
    dispatch: 0.17 us a read against 0.03; its dtype is its local shard's); ``None`` if one of
    ``xs`` is not a DTensor."""
    if not all(isinstance(x, DTensor) for x in xs):
        return None
    return [(x._local_tensor, x._spec.tensor_meta.shape, x._spec.placements, x._spec.mesh) for x in xs]


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` (same dtype as ``like``) as a DTensor with ``like``'s mesh, placements and global
    shape: ``DTensor.from_local`` without its autograd function and view. ``local`` may live on
    another device than the mesh (a host copy staged for an async checkpoint)."""
    return _new_dtensor(local, like._spec, local.requires_grad)


def _new_dtensor(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    """``DTensor(local, spec, requires_grad=...)`` without calling ``DTensor.__init__``, which does
    nothing (``Tensor.__init__``) behind Dynamo's disable and export wrappers: 1.4 us a DTensor
    against 5.1. The object is the one ``__new__`` (C++) builds either way."""
    return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)


def fused_adam_(
    update: torch.Tensor,
    grad: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    count: torch.Tensor,
    lr: torch.Tensor,
    b1: float,
    b2: float,
    eps: float,
) -> None:
    """PyTorch's fused Adam kernel (``torch.optim.Adam(fused=True)``'s) on one tensor of each kind,
    all of one dtype and memory order: ``update`` is stepped as the param (no weight decay),
    ``mu`` and ``nu`` are updated in place; ``count`` is the step number (float32, on their
    device), ``lr`` from :func:`fused_adam_lr`."""
    torch._fused_adam_(
        [update],
        [grad],
        [mu],
        [nu],
        [],
        [count],
        lr=lr,
        beta1=b1,
        beta2=b2,
        weight_decay=0.0,
        eps=eps,
        amsgrad=False,
        maximize=False,
    )


def fused_adam_lr(lr: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The learning rate as a 0-d tensor for the fused Adam kernel on ``device``: a float64 CPU
    tensor, which the CPU kernel reads as the double a Python float is (bit for bit), or a
    schedule's value computed on an accelerator, kept there as float32 (not run: no GPU here)."""
    if not isinstance(lr, torch.Tensor):
        return torch.full((), lr, dtype=torch.float64)
    return lr.to(dtype=torch.float64) if device.type == "cpu" else lr.to(device=device, dtype=torch.float32)


def register_single_dim_rules(op: Any, rules: Callable[[list[torch.Size]], list[list[Placement | int]]]) -> None:
    """Register with DTensor per-mesh-dim rules for ``op``: ``rules(shapes)`` receives the shapes of
    the op's positional tensor arguments and returns its strategies on one mesh dim, each the
    placements of its results then those arguments; an ``int`` ``d`` stands for a shard of dim
    ``d`` of any kind DTensor fills in (a plain or a strided shard, as its inputs arrive).

    Example::

        >>> register_single_dim_rules(op, lambda shapes: [[d, d] for d in range(len(shapes[0]))])
    """

    def single(op: Any, args: Any, kwargs: Any) -> list[list[Any]]:
        shapes = [a.shape for a in args if isinstance(a, TensorMeta)]
        return [[_ShardingPlaceholder(p) if isinstance(p, int) else p for p in rule] for rule in rules(shapes)]

    register_single_dim_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=len(op._schema.arguments)))(single)


def decomposition(op: Any) -> Any:
    """PyTorch's own decomposition of ``op`` into other aten ops (``torch._decomp``), or ``None``."""
    return decomposition_table.get(op)


def register_mesh_dim_rules(
    op: Any,
    rules: Callable[[dict[str, Any]], list[list[Placement]]],
    *,
    static_from: str,
    valid: Callable[[dict[str, Any], list[tuple[torch.Size, tuple[Placement, ...]]], tuple[int, ...]], bool]
    | None = None,
) -> None:
    """Register with DTensor a whole-op strategy for ``op`` built from rules over one mesh dim,
    which DTensor expands over every mesh dim (``expand_to_full_mesh_op_strategy``).

    ``rules(given)`` receives the op's arguments by schema name, a tensor argument as its shape
    (a ``torch.Size``), and returns the strategies on one mesh dim, each the placements of the
    op's tensor results then its tensor arguments in schema order. ``valid(given, layouts,
    mesh_shape)`` (optional) keeps only the expanded combinations it accepts: ``layouts`` holds
    each tensor's ``(shape, placements)``. Arguments from ``static_from`` on tell calls apart in
    DTensor's sharding cache.

    Example::

        >>> register_mesh_dim_rules(op, lambda given: [[Replicate()] * 3, [Shard(0)] * 3], static_from="dropout_p")
    """
    names = [a.name for a in op._schema.arguments]
    n_out = sum(isinstance(r.type, torch.TensorType) for r in op._schema.returns)

    def strategy(op_schema: OpSchema) -> OpStrategy:
        mesh = op_schema.get_mesh_from_args(validate=False)
        given = {**dict(zip(names, op_schema.args_schema)), **op_schema.kwargs_schema}
        given = {k: torch.Size(v.shape) if isinstance(v, OpStrategy) else v for k, v in given.items()}

        def check(input_specs: list[DTensorSpec], output_specs: Any) -> bool:
            specs = [*input_specs, *(output_specs if isinstance(output_specs, (tuple, list)) else (output_specs,))]
            layouts = [
                (s.tensor_meta.shape, tuple(s.placements)) for s in specs if s is not None and s.tensor_meta is not None
            ]
            return valid(given, layouts, tuple(mesh.shape))

        return expand_to_full_mesh_op_strategy(
            mesh, op_schema, rules(given), input_index=n_out, is_valid_strategy_cb=None if valid is None else check
        )

    register_op_strategy(op, schema_info=RuntimeSchemaInfo(static_argnum=names.index(static_from)))(strategy)


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
        floats = [a for a in torch_tree_leaves(given) if isinstance(a, torch.Tensor) and a.is_floating_point()]
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
    prop = _propagator()
    if twin in prop.op_single_dim_strategy_funcs:
        prop.register_single_dim_op_strategy(
            op, prop.op_single_dim_strategy_funcs[twin], prop.op_to_schema_info_for_single_dim_strategy.get(twin)
        )
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


_DEVICE = torch.ops.prim.device.default


@contextlib.contextmanager
def real_writes_refused(refuse: Callable[[Any, str, torch.Tensor], BaseException]) -> Iterator[None]:
    """Inside (around a fake trace, ``make_fx``), an op about to write into a tensor with memory
    (not fake, not on the meta device: one that existed before the trace, which the trace would
    write for real) raises ``refuse(op, argument name, tensor)`` instead. The ops a fake trace runs
    on fake tensors never reach this mode; only those that run for real do.

    Example::

        >>> with real_writes_refused(lambda op, name, t: ValueError(f"{op} writes {name}")):
        ...     make_fx(step, tracing_mode="fake")(*fakes)
    """

    with _RealWritesRefused(refuse):
        yield


class _RealWritesRefused(dispatch_mode_base()):  # type: ignore[misc]
    """:func:`real_writes_refused`'s mode (a tracing mode to :func:`only_tracing_modes`: it sees
    only what a trace runs for real, and changes nothing it lets through). A fake tensor's device
    asked from C++ (autograd asks it of each gradient its engine passes on and of each input and
    output of a ``torch.autograd.Function``: dozens a layer of a stamped model's step) is answered
    here as the fake tensor answers it, which is where the trace's modes below pass the question
    (``make_fx``'s proxy mode records nothing for it), without their Python dispatch."""

    def __init__(self, refuse: Callable[[Any, str, torch.Tensor], BaseException]) -> None:
        super().__init__()
        self.refuse = refuse

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is _DEVICE and type(args[0]) is FakeTensor:
            return args[0].device  # (the meta device inside a fake kernel, as FakeTensor's handler says)
        kwargs = kwargs or {}
        for name, t in written_values(func, args, kwargs):
            if not is_fake(t) and t.device.type != "meta":
                raise self.refuse(func, name, t)
        return func(*args, **kwargs)


@contextlib.contextmanager
def below_local_mode(mode: Any) -> Iterator[None]:
    """Run with the dispatch mode ``mode`` just below the enabled ``LocalTensorMode``, where it sees
    the plain ops that mode runs for each simulated rank (and those LocalTensor itself runs, as
    ``contiguous``), one rank's tensors at a time, instead of the ops on ``LocalTensor`` s.

    Example::

        >>> with below_local_mode(recorder):
        ...     y = x + 1          # recorder sees aten.add on each rank's tensor
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    stack = _get_current_dispatch_mode_stack()
    local = next((i for i, m in enumerate(stack) if isinstance(m, LocalTensorMode)), None)
    if local is None:
        raise RuntimeError("below_local_mode needs an enabled LocalTensorMode (vsf.simulate)")
    above = [_pop_mode() for _ in range(len(stack) - local)][
        ::-1
    ]  # bottom first: the LocalTensorMode, then the modes above it
    _push_mode(mode)
    for m in above:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in range(len(above)):
            _pop_mode()
        if _pop_mode() is not mode:
            raise RuntimeError("below_local_mode: the dispatch mode stack changed inside the block")
        for m in above:
            _push_mode(m)


def other_dispatch_modes() -> bool:
    """Is a dispatch mode other than ``LocalTensorMode`` enabled (``CommDebugMode``, a user's
    mode watching the ops a program runs)?"""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(not isinstance(m, LocalTensorMode) for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def dispatch_modes_off() -> Iterator[None]:
    """Run plain tensor code with no dispatch mode on the stack (under ``vsf.simulate`` a plain op
    otherwise passes through ``LocalTensorMode``'s handler, 8x the cost of the op on small tensors)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def pipeline_order(schedule: type, stages: int, microbatches: int) -> dict[int, list[tuple[int, str, int]]]:
    """The compute actions a single-stage ``torch.distributed.pipelining`` schedule class
    (``ScheduleGPipe``, ``Schedule1F1B``) runs on each pp rank, in its order, read from the
    schedule's own IR (``_get_pipeline_order``, which needs only the two sizes): ``{rank:
    [(stage, "F" | "B", microbatch), ...]}`` (its gradient-reduction markers left out).

    Example::

        >>> pipeline_order(ScheduleGPipe, 2, 2)[1]
        [(1, 'F', 0), (1, 'F', 1), (1, 'B', 0), (1, 'B', 1)]
    """
    sizes = type("_Sizes", (), {"_num_stages": stages, "_n_microbatches": microbatches})()
    order = schedule._get_pipeline_order(sizes)
    return {
        rank: [
            (a.stage_index, a.computation_type.value, a.microbatch_index)
            for a in actions
            if a is not None and a.computation_type.value in ("F", "B")
        ]
        for rank, actions in order.items()
    }


def interleaved_order(
    schedule: type, stages_per_rank: int, ranks: int, microbatches: int
) -> list[list[tuple[int, str, int]]]:
    """The compute actions a multi-stage ``schedule`` (``ScheduleInterleaved1F1B``,
    ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) runs on
    each of ``ranks`` pp ranks holding ``stages_per_rank`` stages each, in its order, from the
    schedule's own per-rank computation (``_calculate_single_rank_operations``, which needs only
    the sizes): ``[[(stage, "F" | "B" | "I" | "W", microbatch), ...] per rank]``, an overlapped
    forward-and-backward (DualPipe-V's ``OVERLAP_F_B``) as its two actions in their order.

    Example::

        >>> interleaved_order(ScheduleInterleaved1F1B, 2, 2, 2)[0][:4]
        [(0, 'F', 0), (0, 'F', 1), (2, 'F', 0), (2, 'F', 1)]
    """
    rounds = max(1, microbatches // ranks)
    sizes = type(
        "_Sizes",
        (),
        {
            "n_local_stages": stages_per_rank,
            "pp_group_size": ranks,
            "_n_microbatches": microbatches,
            "num_stages": stages_per_rank * ranks,
            "number_of_rounds": rounds,
            "microbatches_per_round": microbatches // rounds,
        },
    )()
    order = [schedule._calculate_single_rank_operations(sizes, rank) for rank in range(ranks)]
    flat = [[sub for a in acts if a is not None for sub in (a.sub_actions or (a,))] for acts in order]
    return [[(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts] for acts in flat]


# the op namespaces torch.distributed's collectives trace to (its all_reduce & co., the functional ones)
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


def collective_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The nodes of ``graph`` that call one of ``torch.distributed``'s collectives (``dist.all_reduce``
    traces to ``c10d.allreduce_``; a functional collective to ``_c10d_functional``'s op).

    Example::

        >>> [n.target for n in collective_nodes(gm.graph)]
        [<OpOverload(op='c10d.allreduce_', overload='default')>]
    """
    return [
        n
        for n in graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace in _COLLECTIVE_NAMESPACES
    ]


# the attributes nn.Module itself sets on every module (its tables, hooks and training flag): the
# others are what a module's own code set
MODULE_STATE = frozenset(vars(torch.nn.Module())) | {"_apply"}  # (and the hook :func:`conversions_checked` sets)


def conversions_checked(module: torch.nn.Module, check: Callable[[str, torch.Tensor, torch.Tensor], None]) -> None:
    """Make every conversion of ``module`` (``module.to(...)``, ``.float()``, ``.cuda()``: each calls
    ``nn.Module._apply``) change none of its tensors: each of its own parameters and buffers is
    converted, the result passed to ``check(name, tensor, converted)`` and dropped; its children
    are converted by their own ``_apply``. A node of the module tree :func:`vsf.tree.apply` runs on.

    Example::

        >>> conversions_checked(node, lambda name, t, new: None)
        >>> node.to("meta") is node     # its tensors unchanged
        True
    """

    def convert(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> torch.nn.Module:
        if recurse:
            for child in module.children():
                child._apply(fn)
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    with torch.no_grad():
                        check(name, t, fn(t))
        return module

    vars(module)["_apply"] = convert


def module_node_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of one module whose tables of parameters, buffers and child modules are its
    own (the tensors and children in them still the original's, until replaced through
    :func:`module_tables`): a node of the module tree :func:`vsf.tree.apply` runs on."""
    new = object.__new__(type(module))  # (not copy.copy: a parametrized module refuses to be pickled)
    new.__dict__.update(module.__dict__)
    new._parameters, new._buffers, new._modules = dict(module._parameters), dict(module._buffers), dict(module._modules)
    return new


def module_tables(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A module's own ``(parameters, buffers, children)`` tables (``nn.Module``'s dicts themselves:
    writing one changes what the module's code reads, as ``torch.func.functional_call`` does)."""
    return module._parameters, module._buffers, module._modules


def tensor_version(t: torch.Tensor) -> int | None:
    """How many times ``t`` was written in place (autograd's version counter; ``None`` for an
    inference-mode tensor, which has none), read past the torch-function modes in force."""
    with torch._C.DisableTorchFunction():
        return None if t.is_inference() else t._version


def reentrant_checkpoint_caller(func: Any, args: Sequence[Any]) -> str | None:
    """If the torch function call ``func(*args)`` turns grad mode off inside ``torch.utils.checkpoint``'s
    reentrant ``CheckpointFunction.forward`` (``use_reentrant=True``), the first line outside torch
    that led there (the call of ``checkpoint``, as ``file:line``), else ``None``. For a
    ``TorchFunctionMode`` that refuses reentrant checkpointing."""
    if func is not torch._C._set_grad_enabled or not args or args[0]:
        return None
    from torch.utils.checkpoint import CheckpointFunction

    frame = inspect.currentframe()
    while frame is not None and frame.f_code is not CheckpointFunction.forward.__code__:
        frame = frame.f_back
    if frame is None:
        return None
    torch_dir = os.path.dirname(torch.__file__)
    while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
        frame = frame.f_back
    return "<unknown location>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


_BATCH_NORM_ARGS = (
    "input",
    "weight",
    "bias",
    "running_mean",
    "running_var",
    "training",
    "momentum",
    "eps",
    "cudnn_enabled",
)


def undeclared_writes(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors the torch function call ``func(*args, **kwargs)`` writes in place although no
    aten schema says so, which autograd's version counter therefore misses: batch norm's running
    statistics in training (``native_batch_norm``'s schema hides the write; PyTorch's own tracers
    always decompose it for that reason, ``torch._decomp._should_decompose_because_unsafe_op``)."""
    if func is torch.nn.functional.batch_norm:
        bound = inspect.signature(func).bind(*args, **kwargs).arguments
    elif func is torch.batch_norm:
        bound = dict(zip(_BATCH_NORM_ARGS, args)) | kwargs
    else:
        return []
    if not bound.get("training", False):
        return []
    return [t for t in (bound.get("running_mean"), bound.get("running_var")) if t is not None]


# Stamping a traced block out (vsf.jit.stamp): the running make_fx trace's module calls, a trace
# beside it, and values added to its graph without dispatching an op.


@contextlib.contextmanager
def module_calls_through(
    tracer: Any, call: Callable[[torch.nn.Module, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
) -> Iterator[None]:
    """While the make_fx trace ``tracer`` (a :func:`tracer`) runs: each module call it records goes
    through ``call(module, forward, args, kwargs)`` instead (``forward(*args, **kwargs)`` runs the
    module as it would have run: fx's tracer hands every ``Module.__call__`` to its ``call_module``)."""
    tracer.call_module = call
    try:
        yield
    finally:
        del tracer.call_module


_NODE, _MAP_ARG, _IMMUTABLE_DICT = torch.fx.Node, torch.fx.node.map_arg, torch.fx.immutable_collections.immutable_dict


def copy_nodes(graph: torch.fx.Graph, nodes: Sequence[torch.fx.Node], env: dict[torch.fx.Node, Any]) -> None:
    """``env[n] = graph.node_copy(n, env.__getitem__)`` for each of ``nodes`` in order (a node like
    ``n``, each node it reads mapped by ``env``, its name made unique in ``graph``, a copy of its
    metadata, appended where ``graph`` inserts), for nodes whose arguments hold no symbolic number:
    fx's ``create_node`` walks every argument of a new node looking for one, to warn of it, which
    is most of the cost of copying a node (a stamped block copies a few hundred per call:
    :mod:`vsf.jit.stamp` checks its nodes once); the graph's namespace, insert point, lookup table
    and node hooks are looked up once for all of ``nodes``."""
    names, insert, lookup = graph._graph_namespace, graph._insert, graph._find_nodes_lookup_table
    hooks = getattr(graph.owning_module, "_create_node_hooks", None) or ()
    read = env.__getitem__
    for node in nodes:
        args = _MAP_ARG(node.args, read) or ()
        kwargs = _MAP_ARG(node.kwargs, read) or _IMMUTABLE_DICT()
        name = names.create_name(node.name, None)
        new = _NODE(graph, name, node.op, node.target, args, kwargs, node.type)
        for hook in hooks:
            hook(new)
        names.associate_name_with_obj(name, new)
        insert(new)
        lookup.insert(new)
        graph._len += 1
        new.meta.update(node.meta)
        env[node] = new


def recorded_meta(node: torch.fx.Node) -> dict[str, Any]:
    """The metadata a trace run under ``node``'s preserved metadata (``preserve_node_meta`` and
    ``set_current_meta``, as :class:`torch.fx.Interpreter` runs a node) gives each node it records
    from it: its stack trace and the fields fx copies (module stack, source, provenance, ...).

    Example::

        >>> recorded_meta(node)["stack_trace"] == node.meta["stack_trace"]
        True
    """
    import torch.fx.traceback as fx_traceback

    with fx_traceback.preserve_node_meta(), fx_traceback.set_current_meta(node):
        current = fx_traceback.get_current_meta()
    out = {f: copy.copy(current[f]) for f in fx_proxy._COPY_META_FIELDS if f in current}
    if current.get("stack_trace"):
        out["stack_trace"] = current["stack_trace"]
        if fx_traceback.GRADIENT_ACC_SPECIAL_STACK in current["stack_trace"]:
            out |= {"is_gradient_acc": True, "autograd_backward": True}
    return out


def metadata_reads() -> contextlib.AbstractContextManager[None]:
    """Inside, Python reads of a tensor's metadata (``shape``, ``stride()``, ``dtype``, ...) go
    straight to the tensor, past the torch-function modes in force (a ``make_fx`` trace's, which
    notes each call it sees and returns the tensor's own answer): the same values, at a fraction
    of the cost of each read (a stamped call's key reads every operand's)."""
    return torch._C.DisableTorchFunction()


def holds_symbolic(node: torch.fx.Node) -> bool:
    """Does an argument of ``node`` hold a symbolic number (``SymInt``, ``SymFloat``, ``SymBool``)?"""
    return any(
        isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))
        for v in torch_tree_leaves((node.args, node.kwargs))
    )


def trace_aside(fun: Callable[..., Any], fakes: Sequence[torch.Tensor], decompositions: Any) -> torch.fx.GraphModule:
    """``make_fx`` of ``fun(*fakes)`` while another trace runs, which records none of it: ``fakes``
    are fake tensors of the running trace's fake mode, and the graph records stack traces as
    :func:`vsf.jit.trace.trace`'s does."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():
        return make_fx(fun, decomposition_table=decompositions, tracing_mode="fake", record_stack_traces=True)(*fakes)


def untraced_like(t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """A new fake tensor of the fake ``t``'s shape, strides, dtype and device (and mode), of storage
    of its own, that the running trace does not record (:func:`_fake_of` makes it)."""
    if not isinstance(t, FakeTensor):
        raise TypeError(f"expected a fake tensor, got {type(t).__name__}")
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)
    return _fake_of(meta, t, requires_grad)


def distinct(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fake ``values`` with each tensor met before replaced by a new one like it
    (:func:`untraced_like`): a trace takes one tensor passed twice as one input, and the nodes of a
    stamped block's copies hold one value (:mod:`vsf.jit.stamp`).

    Example::

        >>> a, b = distinct([t, t]); a is t, b is t
        (True, False)
    """
    seen: set[int] = set()
    out = []
    for v in values:
        out.append(v if id(v) not in seen else untraced_like(v))
        seen.add(id(v))
    return out


def _fake_of(meta: torch.Tensor, like: Any, requires_grad: bool) -> torch.Tensor:
    """The fake tensor ``FakeTensor(mode, meta, device)`` makes of the meta tensor ``meta`` in the
    mode and on the device of the fake ``like`` (its state set as that constructor sets it,
    :func:`_blank_fake_state`), made without the constructor's argument checks and outside the
    torch-function modes of a trace: a stamped block makes one per copied node and two per output
    (its value and the snapshot its node holds), at about a third of the constructor's cost there."""
    with torch._C.DisableTorchFunction():
        device, mode = like.fake_device, like.fake_mode
        new = torch.Tensor._make_subclass(
            FakeTensor, meta, requires_grad, dispatch_device=True, device_for_backend_keys=device
        )
        if mode._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(new)
        else:
            torch._C._set_throw_on_mutable_data_ptr(new)
        state = vars(new)
        state.update(_blank_fake_state())
        state["fake_mode"], state["_fake_device"] = mode, device
    return new


@functools.cache
def _blank_fake_state() -> dict[str, Any]:
    """The attributes ``FakeTensor(mode, meta, device)`` sets on a new fake tensor other than its
    mode and device (no constant, no real tensor, empty memos), read off one such tensor."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        meta = torch.empty(0, device="meta")
    state = dict(vars(FakeTensor(FakeTensorMode(), meta, torch.device("cpu"))))
    del state["fake_mode"], state["_fake_device"]
    return state


def track_as(t: torch.Tensor, node: torch.fx.Node, tracer: Any) -> torch.Tensor:
    """Make the trace ``tracer`` read the fake tensor ``t`` as the value of its graph's ``node``:
    ops on ``t`` then read ``node``. The node's metadata (``val``, ``tensor_meta``: those of a node
    like it, which ``t`` is like) stays as it is, not worked out again from ``t``."""
    if not isinstance(t, FakeTensor):
        raise TypeError(f"expected a fake tensor, got {type(t).__name__}")
    set_proxy_slot(t, tracer, _ProxyTensor(torch.fx.Proxy(node, tracer), None))
    return t


def only_tracing_modes() -> bool:
    """Are the modes on the dispatch stack only those of a running ``make_fx`` trace (its fake and
    proxy modes, and ``vsf.simulate``'s while a trace turns it off), so that the ops a traced function runs reach nothing else (no
    ``vsf.random.keyed`` draws, no user's mode)?"""
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return all(
        isinstance(m, (FakeTensorMode, ProxyTorchDispatchMode, _RealWritesRefused))
        or isinstance(m, LocalTensorMode)
        and m._disable
        for m in _get_current_dispatch_mode_stack()
    )


def global_module_hooks() -> bool:
    """Is a hook registered for every module's calls (``torch.nn.modules.module.register_module_*_hook``)?"""
    from torch.nn.modules import module

    return any(
        getattr(module, name)
        for name in (
            "_global_forward_hooks",
            "_global_forward_pre_hooks",
            "_global_backward_hooks",
            "_global_backward_pre_hooks",
        )
    )


def saved_tensor_hooks() -> bool:
    """Are hooks on the tensors autograd saves in force (``torch.autograd.graph.saved_tensors_hooks``:
    activation checkpointing's, which drop them and recompute the forward in the backward)?"""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def stack_trace_now(tracer: Any) -> str | None:
    """The stack trace the make_fx trace ``tracer`` would record on a node it made now (``None``
    where it records none): the Python frames its filter keeps, outermost first."""
    if not tracer.record_stack_traces:
        return None
    summary = fx_proxy.CapturedTraceback.extract().summary()
    kept = tracer._filter_traceback_frames(summary) if summary else None
    return "".join(kept.format()).strip() or None if kept else None
