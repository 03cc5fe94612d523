"""Every verb ``vsf._compat`` exports, called on tiny inputs against an independent oracle (the
math of the op, PyTorch's own public API, a hand-written answer): a PyTorch upgrade is checked
against this file alone (docs/architecture.md, "The `_compat` contract").

The last test fails when ``_compat`` exports a name no test here calls.
"""

from __future__ import annotations

import ast
import inspect
import logging
import operator
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint
from torch.overrides import TorchFunctionMode

import vsf
from toy_models import chain_program
from vsf import _compat

aten = torch.ops.aten

lib = torch.library.Library("vsfcompat", "DEF")
lib.define("double(Tensor x) -> Tensor")
lib.define("scaled(Tensor x, Tensor y, float s) -> Tensor")
lib.define("nothing(Tensor x) -> Tensor")
for _name, _fn in {
    "double": lambda x: x * 2,
    "scaled": lambda x, y, s: (x + y) * s,
    "nothing": lambda x: x.clone(),
}.items():
    lib.impl(_name, _fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"vsfcompat::{_name}", lambda *a, **k: torch.empty_like(a[0]), lib=lib)


def _mesh(n: int):
    return vsf.make_mesh((n,), ("x",)).device_mesh


class _Recorder(_compat.dispatch_mode_base()):
    """A dispatch mode that records the ops it sees on plain tensors (a LocalTensor runs its own,
    per rank, and they come back here)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_compat.is_local_tensor(a) for a in _compat.torch_tree_leaves((args, kwargs))):
            return NotImplemented
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


# -- process groups and meshes -------------------------------------------------------------------


def test_fake_process_group_and_one_rank_meshes():
    assert not dist.is_initialized()
    _compat.init_fake_process_group(4)
    try:
        assert (dist.get_world_size(), dist.get_backend()) == (4, "fake")
        one = _compat.single_rank_device_mesh("cpu", 2, "x")
        assert (one.size(), one.mesh_dim_names, one.mesh.tolist()) == (1, ("x",), [2])
        each = _compat.one_rank_device_mesh("cpu", 4, "y", rank_map=torch.tensor([3, 2, 1, 0]))
        assert (each.size(), each.mesh_dim_names) == (1, ("y",))
        assert [_compat.copy_holding(each, r).tolist() for r in range(4)] == [
            [0],
            [1],
            [2],
            [3],
        ]  # each rank its own copy
    finally:
        dist.destroy_process_group()


def test_copy_holding_each_rank_of_a_sliced_mesh(sim):
    sim(4)
    tp = vsf.make_mesh((2, 2), ("dp", "tp")).device_mesh["tp"]  # copies {0, 1} and {2, 3}
    assert [_compat.copy_holding(tp, r).tolist() for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    dp = vsf.make_mesh((2, 2), ("dp", "tp")).device_mesh["dp"]  # copies {0, 2} and {1, 3}
    assert [_compat.copy_holding(dp, r).tolist() for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_quiet_redistribute_silences_dtensors_logger_and_restores_it():
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    before = log.level
    with _compat.quiet_redistribute():
        assert log.level == logging.ERROR
    assert log.level == before


# -- simulated ranks -------------------------------------------------------------------------------


def test_local_tensor_mode_holds_a_value_per_rank():
    assert _compat.active_local_mode() is None
    mode = _compat.local_tensor_mode(2)
    with mode:
        assert _compat.active_local_mode() is mode
        x = _compat.make_local({0: torch.tensor([1.0]), 1: torch.tensor([2.0])})
        y = x * 10
        assert _compat.is_local_tensor(y)
        with _compat.local_mode_disabled():
            assert not _compat.is_local_tensor(torch.ones(1) + 1)
    shards = _compat.local_shards(y, 0)
    assert {r: v.tolist() for r, v in shards.items()} == {0: [10.0], 1: [20.0]}
    plain = torch.ones(2)
    assert _compat.local_shards(plain, 3) == {3: plain} and not _compat.is_local_tensor(plain)


def test_reconcile_reads_nan_and_names_differing_ranks():
    with _compat.local_tensor_mode(2):
        nan = _compat.make_local({0: torch.tensor([float("nan"), 1.0]), 1: torch.tensor([float("nan"), 1.0])})
        other = _compat.make_local({0: torch.tensor([1.0]), 1: torch.tensor([2.0])})
    one = _compat.reconcile(nan)
    assert not _compat.is_local_tensor(one) and one[0].isnan() and one[1] == 1.0
    with pytest.raises(ValueError, match="ranks 0 and 1"):
        _compat.reconcile(other)


def test_generator_ops_go_to_the_handler_which_runs_each_rank_alone():
    expected = torch.rand(3, generator=torch.Generator().manual_seed(5))
    calls = []

    def each_rank_from_the_same_state(func, args, kwargs, generators):
        calls.append((func, len(generators)))
        g = generators[0]
        start = g.get_state()
        results = {}
        for r in (0, 1):
            g.set_state(start)
            results[r] = _compat.run_on_rank(func, r, args, kwargs)
        return _compat.merge_rank_results(results, _compat.torch_tree_leaves((args, kwargs)))

    g = torch.Generator().manual_seed(5)
    with _compat.local_tensor_mode(2, each_rank_from_the_same_state):
        x = torch.rand(3, generator=g)
        y = torch.ones(3) * 2  # no generator: the mode's own path
    assert [op for op, n in calls] == [aten.rand.generator] and calls[0][1] == 1
    assert all(torch.equal(v, expected) for v in _compat.local_shards(x, 0).values())
    assert sorted(_compat.local_shards(x, 0)) == [0, 1]
    assert all(torch.equal(v, torch.full((3,), 2.0)) for v in _compat.local_shards(y, 0).values())
    other = torch.Generator()
    assert _compat.generator_key(g) == _compat.generator_key(g) != _compat.generator_key(other)


def test_dispatch_modes_below_beside_and_off():
    with _compat.local_tensor_mode(2):
        assert not _compat.other_dispatch_modes()
        x = _compat.make_local({0: torch.ones(1), 1: torch.zeros(1)})
        below = _Recorder()
        with _compat.below_local_mode(below):
            x + 1
        assert aten.add.Tensor in below.seen  # run per rank, on each rank's plain tensor
    beside = _Recorder()
    with beside:
        assert _compat.other_dispatch_modes()
        torch.ones(1) + 1
        with _compat.dispatch_modes_off():
            torch.ones(1) * 3
    assert aten.add.Tensor in beside.seen and aten.mul.Tensor not in beside.seen


def test_functional_collectives_reduce_across_simulated_ranks(sim):
    sim(2)
    x = _compat.make_local({0: torch.tensor([1.0, 2.0]), 1: torch.tensor([10.0, 20.0])})
    out = _compat.functional_collectives.all_reduce(x, "sum", dist.group.WORLD)
    if isinstance(out, _compat.functional_collectives.AsyncCollectiveTensor):
        out = out.wait()
    assert [v.tolist() for v in _compat.local_shards(out, 0).values()] == [[11.0, 22.0]] * 2


# -- placements and DTensor ----------------------------------------------------------------------


def test_reduce_partial_carries_out_each_pending_reduction(sim):
    values = [torch.tensor(1.0), torch.tensor(3.0)]
    assert [_compat.reduce_partial(Partial(op), values).item() for op in ("sum", "avg", "max", "min")] == [
        4.0,
        2.0,
        3.0,
        1.0,
    ]
    sim(2)
    # DTensor's own partial 2-norm of a sharded vector norm: sqrt(3^2 + 4^2)
    x = torch.ones(4)
    _, outs = _compat.dtensor_decision(aten.linalg_vector_norm.default, (_compat.Placed(x, (Shard(0),)),), {}, _mesh(2))
    (norm,) = outs[0]
    assert isinstance(norm, Partial) and _compat.reduce_partial(
        norm, [torch.tensor(3.0), torch.tensor(4.0)]
    ).item() == pytest.approx(5.0)


def test_dtensor_decision_and_whole_op_strategies_for_matmul_and_sum(sim):
    sim(2)
    a, b = torch.ones(4, 6), torch.ones(6, 8)
    ins, outs = _compat.dtensor_decision(
        aten.mm.default, (_compat.Placed(a, (Shard(0),)), _compat.Placed(b, (Replicate(),))), {}, _mesh(2)
    )
    assert (ins, outs) == ([(Shard(0),), (Replicate(),)], [(Shard(0),)])
    offered = _compat.whole_op_strategies(aten.sum.default, (_compat.Placed(a, (Shard(0),)),), {}, 2)
    assert ((Shard(0),), (Partial(),)) in offered  # a sum of row shards is a partial sum
    assert (
        _compat.whole_op_strategies(torch.ops.vsfcompat.nothing.default, (_compat.Placed(a, (Shard(0),)),), {}, 2)
        is None
    )


def test_single_dim_strategies_of_matmul():
    a, b = torch.ones(4, 6), torch.ones(6, 8)
    rules = _compat.single_dim_strategies(aten.mm.default, (a, b), {}, torch.ones(4, 8))
    assert [Shard(0), Shard(0), Replicate()] in rules  # rows of a -> rows of the product
    assert [Shard(1), Replicate(), Shard(1)] in rules  # columns of b -> columns of the product
    assert [Partial(), Shard(1), Shard(0)] in rules  # the contracted dim -> a partial sum
    strided = _compat.StridedShard(0, split_factor=2)
    assert [strided, strided, Replicate()] in _compat.single_dim_strategies(
        aten.mm.default, (a, b), {}, torch.ones(4, 8), shards=(strided,)
    )
    assert _compat.single_dim_strategies(aten.sum.default, (a,), {}, torch.ones(())) is None
    assert [
        _compat.registered_rules(op) for op in (aten.mm.default, aten.sum.default, torch.ops.vsfcompat.nothing.default)
    ] == ["single", "full", None]


def test_is_shardable_and_shard_of(sim):
    sim(2)
    dm = _mesh(2)
    assert _compat.is_shardable(torch.ones(4, 1), dm, (Shard(0),)) and not _compat.is_shardable(
        torch.ones(4, 1), dm, (Shard(1),)
    )
    t = torch.arange(8)
    assert _compat.shard_of(t, (_compat.StridedShard(0, split_factor=2),), (2,), (1,)).tolist() == [2, 3, 6, 7]
    assert _compat.shard_of(t, (Shard(0),), (2,), (1,)).tolist() == [4, 5, 6, 7]
    assert _compat.shard_of(t.reshape(2, 4), (Replicate(), Shard(1)), (2, 2), (1, 0)).tolist() == [[0, 1], [4, 5]]


def test_redistribution_reads_a_merged_views_strided_shards_as_dtensors_view_laid_them_out(sim):
    """A [4, 4, 2, 2] value split on dim 1 over both dims of a 2 x 2 mesh, viewed as [16, 2, 2]:
    DTensor's view rule says ``(_StridedShard(0, sf=4), _StridedShard(0, sf=4))``, and gathering
    those local pieces must give the view of the whole (torch 2.13 read them as an order of mesh
    dims when given no shard order, and put the rows out of order)."""
    sim(4)
    dm = vsf.make_mesh((2, 2), ("a", "b")).device_mesh
    x = torch.arange(64.0).view(4, 4, 2, 2)
    merged = distribute_tensor(x, dm, [Shard(1), Shard(1)]).view(16, 2, 2)
    whole = x.view(16, 2, 2)
    assert merged.placements == (_compat.StridedShard(0, split_factor=4),) * 2
    gathered = _compat.redistribute_local(
        merged.to_local(), dm, merged.placements, (Replicate(),) * 2, shape=(16, 2, 2), stride=(4, 2, 1), dtype=x.dtype
    )
    assert all(torch.equal(g, whole) for g in _compat.local_shards(gathered, 0).values())


def test_redistribution_and_dtensor_wrapping(sim):
    sim(2)
    dm, t = _mesh(2), torch.arange(4.0)
    assert _compat.redistribute_steps(dm, (Shard(0),), (Replicate(),), t) == [(0, Shard(0), Replicate(), (4,))]
    local = _compat.make_local({0: t[:2], 1: t[2:]})
    whole = _compat.redistribute_local(local, dm, (Shard(0),), (Replicate(),), shape=(4,), stride=(1,), dtype=t.dtype)
    assert [v.tolist() for v in _compat.local_shards(whole, 0).values()] == [t.tolist()] * 2
    d = _compat.dtensor_from_local(local, _compat.dtensor_layout(dm, (Shard(0),), t))
    assert isinstance(d, DTensor) and d.shape == (4,) and d.placements == (Shard(0),)
    assert _compat.dtensor_local(d) is local
    doubled = _compat.make_local({0: t[:2] * 2, 1: t[2:] * 2})
    _compat.swap_local(d, doubled)
    assert _compat.dtensor_local(d) is doubled
    like = _compat.dtensor_like(local, d)
    assert (like.shape, like.placements, like.device_mesh) == (
        d.shape,
        d.placements,
        d.device_mesh,
    ) and _compat.dtensor_local(like) is local
    layout = _compat.dtensor_layout(dm, (Shard(0),), t)
    built = _compat.dtensors_from_locals([local, doubled], [layout, layout])
    assert [(x.shape, x.placements, x.requires_grad, _compat.dtensor_local(x)) for x in built] == [
        ((4,), (Shard(0),), False, local),
        ((4,), (Shard(0),), False, doubled),
    ]
    parts = _compat.dtensor_parts([d, like])
    assert [(local, tuple(shape), pl, mesh) for local, shape, pl, mesh in parts] == [
        (_compat.dtensor_local(x), tuple(x.shape), x.placements, x.device_mesh) for x in (d, like)
    ]
    assert [local.dtype for local, *_ in parts] == [d.dtype, like.dtype]
    assert _compat.dtensor_parts([d, t]) is None  # a plain tensor among them
    _compat.clear_sharding_caches()
    assert DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize == 0
    assert (d + 1).placements == (Shard(0),)  # propagation works again after the caches went


def test_dtensor_layouts_share_a_spec_only_between_values_laid_out_alike(sim):
    sim(2)

    class Split(Shard):  # (equal to a Shard of its dim, as a placement's subclass is)
        pass

    dm, t = _mesh(2), torch.zeros(4, 6)
    laid_out = [
        ((Shard(0),), t),
        ((Shard(0),), torch.ones(4, 6)),  # alike: shares the first one's
        ((Split(0),), t),
        ((Shard(0),), torch.zeros(6, 4).t()),  # other strides
        ((Shard(0),), t.double()),
        ((Shard(0),), torch.zeros(2, 6)),  # the same strides, another shape
        ((Partial("avg"),), t),
        ((Partial("sum"),), t),
    ]
    specs = _compat.dtensor_layouts(dm, laid_out)
    assert specs[0] is specs[1]
    assert len({id(s) for s in specs}) == len(laid_out) - 1
    for spec, (placements, x) in zip(specs, laid_out):
        alone = _compat.dtensor_layout(dm, placements, x)
        assert (spec, [type(p) for p in spec.placements]) == (alone, [type(p) for p in placements])


def test_wrapper_tensor_has_the_shape_and_no_storage():
    class Stub(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise RuntimeError("no data")

    like = torch.ones(2, 3, dtype=torch.float16)
    w = _compat.wrapper_tensor(Stub, like)
    assert type(w) is Stub and (w.shape, w.dtype, w.device) == (like.shape, like.dtype, like.device)
    with pytest.raises(RuntimeError, match="no data"):
        w + 1


# -- tracing: fake tensors, pytrees, schemas, decompositions -------------------------------------


def test_fake_tensors_and_tracing():
    assert not _compat.fake_mode_active() and not _compat.is_fake(torch.ones(1))
    real = torch.tensor([1.0, 2.0])
    with _compat.fake_mode():
        assert _compat.fake_mode_active()
        y = torch.ones(2) + real  # a real input is accepted
        assert _compat.is_fake(y) and y.shape == (2,)
    gm = _compat.trace_fake(lambda x: x * real, [torch.ones(2)])
    assert torch.equal(gm(torch.tensor([3.0, 4.0])), torch.tensor([3.0, 8.0]))
    # an op given a decomposition is traced as the ops it runs
    gm = _compat.trace_fake(torch.sinc, [torch.ones(2)], {aten.sinc.default: lambda x: torch.sin(x) / x})
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_function"] == ["aten.sin.default", "aten.div.Tensor"]

    with pytest.raises(Exception) as e, _compat.fake_mode():
        bool(torch.ones(2).sum() > 0)
    assert _compat.is_data_dependent_error(e.value) and not _compat.is_data_dependent_error(ValueError())
    with pytest.raises(Exception) as e, _compat.fake_mode():
        torch.nonzero(torch.ones(2))
    assert _compat.value_shaped_op(e.value) is aten.nonzero.default and _compat.value_shaped_op(ValueError()) is None


def test_fake_inputs_are_the_tensors_a_fake_trace_runs_on():
    """``fake_inputs`` makes fakes of the avals, and a fake-mode ``make_fx`` trace runs the traced
    function on those very tensors (a plain fake of another mode is converted to a new one)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, i = _compat.fake_inputs([((4, 3), torch.float32), ((5,), torch.int64)], "cpu")
    assert _compat.is_fake(x) and (x.shape, x.dtype, i.shape, i.dtype) == ((4, 3), torch.float32, (5,), torch.int64)
    with x.fake_mode:  # each is the fake torch.empty makes in its mode
        made = [torch.empty(4, 3), torch.empty(5, dtype=torch.int64)]
    meta = lambda t: (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.storage_offset())  # noqa: E731
    for t, want in zip((x, i), made):
        assert type(t) is type(want) and vars(t) == vars(want) and meta(t) == meta(want)
    assert x.untyped_storage()._cdata != i.untyped_storage()._cdata
    seen = []
    gm = make_fx(lambda a, b: seen.extend([a, b]) or a.sum() + b.sum(), tracing_mode="fake")(x, i)
    assert seen[0] is x and seen[1] is i
    assert [n.meta["val"].shape for n in gm.graph.find_nodes(op="placeholder")] == [(4, 3), (5,)]
    with _compat.fake_mode():
        other = torch.empty(4, 3)
    make_fx(lambda a: seen.append(a) or a * 2, tracing_mode="fake")(other)
    assert seen[2] is not other


def test_stack_anchor_makes_fx_record_the_anchored_functions_line():
    from torch.fx.experimental.proxy_tensor import make_fx

    def user_step(x):
        return x.sin()  # the line fx should record

    def run(x):
        return user_step(x)

    _compat.register_stack_anchor(user_step)
    gm = make_fx(run, tracing_mode="fake", record_stack_traces=True)(torch.ones(2))
    (sin,) = [n for n in gm.graph.nodes if n.target is aten.sin.default]
    assert "x.sin()" in sin.meta.get("stack_trace", "") or "user_step" in sin.meta.get("stack_trace", "")


def test_kept_frames_only_records_the_stack_traces_fx_records():
    from torch.fx.experimental.proxy_tensor import make_fx

    class Block(torch.nn.Module):
        def forward(self, x):
            return x.cos() * 2  # a module's forward: kept

    def user_step(x):
        return Block()(x.sin()).sum()  # the anchored function: kept

    def run(x):
        return user_step(x)

    _compat.register_stack_anchor(user_step)
    traces = lambda gm: [(n.name, n.meta.get("stack_trace")) for n in gm.graph.nodes]  # noqa: E731
    full = make_fx(run, tracing_mode="fake", record_stack_traces=True)(torch.ones(2))
    with _compat.kept_frames_only():
        fast = make_fx(run, tracing_mode="fake", record_stack_traces=True)(torch.ones(2))
    assert traces(fast) == traces(full)
    (cos,) = [n for n in fast.graph.nodes if n.target is aten.cos.default]
    assert "x.cos() * 2" in cos.meta["stack_trace"] and "Block()(x.sin())" in cos.meta["stack_trace"]


def test_lazy_graph_modules_compile_when_used():
    from torch.fx.experimental.proxy_tensor import make_fx

    compiled = []
    real = torch.fx.GraphModule.recompile

    def f(x):
        return x.sin() * 2

    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch.fx.GraphModule, "recompile", lambda self: compiled.append(1) or real(self))
        with _compat.lazy_graph_modules():
            gm = make_fx(f)(torch.ones(3))
        assert compiled == []  # made, not compiled
        x = torch.arange(3.0)
        torch.testing.assert_close(gm(x), f(x))  # compiled on its first call, and right
        assert len(compiled) == 1 and "sin" in gm.code
        gm.graph.eliminate_dead_code()
        gm.recompile()  # (outside the context: a lazy module stays lazy)
        assert len(compiled) == 1


def test_torch_pytree_and_op_schemas():
    tree = {"a": [1, (2, 3)], "b": torch.fx.immutable_collections.immutable_list([4])}
    assert _compat.torch_tree_leaves(tree) == [1, 2, 3, 4]
    assert _compat.torch_tree_leaves(_compat.torch_tree_map(lambda v: v * 10, tree)) == [10, 20, 30, 40]
    assert [a.name for a in _compat.op_schema(aten.add.Tensor).arguments] == ["self", "other", "alpha"]
    assert _compat.op_schema(len) is None
    assert _compat.overload_name(aten.add.Tensor) == "Tensor"
    assert _compat.foreach_elementwise_op(aten._foreach_add.List) is aten.add.Tensor
    assert {aten.normal_.default, aten.native_dropout.default} <= _compat.dispatcher_special_ops()
    x, w, b = torch.randn(2, 3), torch.randn(3, 4), torch.randn(4)
    assert torch.allclose(_compat.decomposition(aten.addmm.default)(b, x, w), torch.addmm(b, x, w))
    assert _compat.decomposition(torch.ops.vsfcompat.nothing.default) is None


# -- registering rules with DTensor and fakes with PyTorch ----------------------------------------


def test_register_single_dim_rules_splits_alike():
    op = torch.ops.vsfcompat.double.default
    _compat.register_single_dim_rules(op, lambda shapes: [[d, d] for d in range(len(shapes[0]))])
    x = torch.ones(4, 6)
    rules = _compat.single_dim_strategies(op, (x,), {}, x)
    assert [Shard(0), Shard(0)] in rules and [Shard(1), Shard(1)] in rules and [Replicate(), Replicate()] in rules


def test_register_mesh_dim_rules_and_its_filter(sim):
    sim(2)
    op = torch.ops.vsfcompat.scaled.default
    seen = []

    def rules(given):
        seen.append(given)
        return [[Replicate()] * 3, [Shard(0)] * 3]

    _compat.register_mesh_dim_rules(
        op,
        rules,
        static_from="s",
        valid=lambda given, layouts, mesh_shape: not any(p == Shard(0) and s[0] % 4 for s, ps in layouts for p in ps),
    )
    x = torch.ones(4, 2)
    _, outs = _compat.dtensor_decision(
        op, (_compat.Placed(x, (Shard(0),)), _compat.Placed(x, (Shard(0),)), 0.5), {}, _mesh(2)
    )
    assert outs == [(Shard(0),)] and seen[-1] == {"x": torch.Size([4, 2]), "y": torch.Size([4, 2]), "s": 0.5}
    y = torch.ones(6, 2)  # 6 rows: the filter rejects the split
    _, outs = _compat.dtensor_decision(
        op, (_compat.Placed(y, (Shard(0),)), _compat.Placed(y, (Shard(0),)), 0.5), {}, _mesh(2)
    )
    assert outs == [(Replicate(),)]


def test_register_like_copies_a_twins_strategy():
    assert _compat.register_like(aten.copy.default, aten.copy_.default)
    assert _compat.registered_rules(aten.copy.default) == _compat.registered_rules(aten.copy_.default) == "single"
    assert not _compat.register_like(aten.copy.default, torch.ops.vsfcompat.nothing.default)


def test_register_fake_via_dtype_traces_other_float_dtypes():
    lib.define("bf16_only(Tensor x) -> Tensor")
    lib.impl("bf16_only", lambda x: x * 2, "CompositeExplicitAutograd")
    op = torch.ops.vsfcompat.bf16_only.default

    def meta(x):
        assert x.dtype == torch.bfloat16, "bf16 only"
        return torch.empty(x.shape[0], 1, dtype=x.dtype, device=x.device)

    torch._decomp.meta_table[op] = meta
    _compat.register_fake_via_dtype(op, torch.bfloat16)
    with _compat.fake_mode():
        out = op(torch.ones(3, 5))
    assert (out.shape, out.dtype) == ((3, 1), torch.float32)


# -- optimizers, pipelines, modules ----------------------------------------------------------------


def test_fused_adam_steps_like_torch_adam():
    p0, g = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([0.5, 0.25, -1.0])
    param = p0.clone().requires_grad_()
    opt = torch.optim.Adam([param], lr=0.1, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    param.grad = g.clone()
    opt.step()
    update, mu, nu = p0.clone(), torch.zeros(3), torch.zeros(3)
    lr = _compat.fused_adam_lr(0.1, torch.device("cpu"))
    assert lr.dtype == torch.float64 and lr.item() == 0.1
    assert _compat.fused_adam_lr(torch.tensor(0.1), torch.device("cpu")).dtype == torch.float64
    _compat.fused_adam_(update, g, mu, nu, torch.tensor(1.0), lr, 0.9, 0.99, 1e-8)
    assert (
        torch.allclose(update, param.detach())
        and torch.allclose(mu, opt.state[param]["exp_avg"])
        and torch.allclose(nu, opt.state[param]["exp_avg_sq"])
    )


def test_pipeline_schedules_orders():
    assert _compat.pipeline_order(ScheduleGPipe, 2, 2)[1] == [(1, "F", 0), (1, "F", 1), (1, "B", 0), (1, "B", 1)]
    assert _compat.interleaved_order(ScheduleInterleaved1F1B, 2, 2, 2)[0][:4] == [
        (0, "F", 0),
        (0, "F", 1),
        (2, "F", 0),
        (2, "F", 1),
    ]


def test_module_node_copy_and_its_tables():
    lin = torch.nn.Linear(2, 2)
    node = _compat.module_node_copy(lin)
    params, buffers, children = _compat.module_tables(node)
    assert params["weight"] is lin.weight and buffers == {} and children == {}
    params["weight"] = torch.nn.Parameter(torch.zeros(2, 2))
    assert torch.allclose(node(torch.ones(1, 2)), lin.bias.detach())  # the copy reads its own table
    assert torch.allclose(lin(torch.ones(1, 2)), lin.weight.detach().sum(1) + lin.bias.detach())
    assert _compat.module_tables(lin)[0]["weight"] is lin.weight and lin.weight is not params["weight"]


def test_conversions_checked_converts_a_node_s_tensors_for_the_check_and_keeps_none():
    outer = torch.nn.Sequential(torch.nn.Linear(2, 2))
    nodes = [_compat.module_node_copy(m) for m in (outer, outer[0])]
    _compat.module_tables(nodes[0])[2]["0"] = nodes[1]
    seen = []
    for node in nodes:
        _compat.conversions_checked(node, lambda name, t, new: seen.append((name, t, new)))
    assert nodes[0].to(torch.float64) is nodes[0]
    assert [(name, t is getattr(outer[0], name), new.dtype) for name, t, new in seen] == [
        ("weight", True, torch.float64),
        ("bias", True, torch.float64),
    ]
    assert nodes[1].weight.dtype == torch.float32 and outer[0].weight.dtype == torch.float32
    assert "_apply" in _compat.MODULE_STATE  # (not an attribute a module's code reads)


def test_collective_nodes_are_torch_distributed_s_and_only_those():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    targets = [
        torch.ops.aten.exp.default,
        torch.ops.c10d.allreduce_.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.wait_tensor.default,
        operator.getitem,
    ]
    nodes = [graph.call_function(t, (x,)) for t in targets]
    assert _compat.collective_nodes(graph) == nodes[1:4]


def test_module_state_names_what_nn_module_sets_and_nothing_a_module_sets_itself():
    lin = torch.nn.Linear(2, 2)
    lin.register_forward_hook(lambda *a: None)
    assert {"_parameters", "_buffers", "_modules", "training", "_forward_hooks"} <= _compat.MODULE_STATE
    assert set(vars(lin)) - _compat.MODULE_STATE == {"in_features", "out_features"}


def test_tensor_version_counts_in_place_writes():
    t = torch.zeros(2)
    assert _compat.tensor_version(t) == 0
    t.add_(1)
    assert _compat.tensor_version(t) == 1
    with torch.inference_mode():
        assert _compat.tensor_version(torch.zeros(1)) is None


def test_reentrant_checkpoint_caller_names_the_checkpoint_call():
    found = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            found.append(_compat.reentrant_checkpoint_caller(func, args))
            return func(*args, **(kwargs or {}))

    x = torch.ones(2, requires_grad=True)
    with Watch():
        checkpoint(torch.sin, x, use_reentrant=False)
    assert not any(found)
    with Watch():
        line = inspect.currentframe().f_lineno + 1
        checkpoint(torch.sin, x, use_reentrant=True)
    assert f"{__file__}:{line}" in found


def test_undeclared_writes_of_batch_norm():
    x, rm, rv = torch.randn(4, 3), torch.zeros(3), torch.ones(3)
    assert _compat.undeclared_writes(F.batch_norm, (x, rm, rv), {"training": True}) == [rm, rv]
    assert _compat.undeclared_writes(F.batch_norm, (x, rm, rv), {"training": False}) == []
    assert _compat.undeclared_writes(torch.batch_norm, (x, None, None, rm, rv, True, 0.1, 1e-5, False), {}) == [rm, rv]
    assert _compat.undeclared_writes(torch.add, (x, x), {}) == []


def test_every_exported_verb_is_called_here():
    tree = ast.parse(pathlib.Path(__file__).read_text())
    named = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "_compat"
    }
    assert sorted(set(_compat.__all__) - named) == [], (
        "exported by vsf._compat but not exercised in tests/test_compat.py"
    )


def test_process_group_named_resolves_a_mesh_group():
    with vsf.simulate(2):
        group = vsf.make_mesh((2,), ("x",)).device_mesh.get_group(0)
        assert _compat.process_group_named(group.group_name) is group


@pytest.mark.parametrize("cpp_wrapper", [False, True], ids=["python_wrapper", "cpp_wrapper"])
def test_inductor_compile_runs_an_fx_graph_as_written(cpp_wrapper):
    gm = torch.fx.symbolic_trace(lambda x, y: (x.sin() * y).sum(0))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    compiled = _compat.inductor_compile(gm, [x, y], cpp_wrapper=cpp_wrapper)
    out = compiled(x, y)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, (x.sin() * y).sum(0))


def test_cpp_wrapper_calls_all_reduces_and_waits_not_gathers():
    """Inductor's C++ wrapper has C shims for the all-reduces and the wait, and no other collective."""

    c10d = torch.ops._c10d_functional
    assert _compat.cpp_wrapper_calls(chain_program(aten.sin.default))
    assert _compat.cpp_wrapper_calls(chain_program(c10d.all_reduce_.default, c10d.wait_tensor.default, aten.mul.Tensor))
    assert _compat.cpp_wrapper_calls(chain_program(c10d.all_reduce.default, c10d.wait_tensor.default))
    for collective in (c10d.all_gather_into_tensor, c10d.reduce_scatter_tensor, c10d.all_to_all_single):
        assert not _compat.cpp_wrapper_calls(
            chain_program(aten.sin.default, collective.default, c10d.wait_tensor.default)
        )


def test_checkpointing_as_eager_traces_the_recompute_eager_autograd_runs():
    from torch.utils._python_dispatch import TorchDispatchMode

    def f(x):
        y = checkpoint(lambda t: t.sin().sin(), x, use_reentrant=False)
        return torch.autograd.grad(y.sum(), x)[0]

    class Count(TorchDispatchMode):
        sins = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.sins += func == aten.sin.default
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, requires_grad=True)
    with Count():
        f(x)
    with _compat.checkpointing_as_eager():
        graph = _compat.trace_fake(f, (x,))
    assert Count.sins == 3  # two forward, the inner one again in the backward
    assert sum(n.target == aten.sin.default for n in graph.graph.nodes) == Count.sins


def test_shape_argument_ops_are_the_ops_taking_global_sizes():
    ops = _compat.shape_argument_ops()
    assert {aten.native_group_norm.default, aten.view.default, aten.new_zeros.default} <= ops
    assert aten.add.Tensor not in ops and aten.mm.default not in ops


def test_tracer_and_traced_node_find_the_node_computing_a_traced_tensor():
    """Inside a make_fx trace, the graph node of a traced tensor (a placeholder, an op's result);
    outside one no tracer, and a tensor the trace does not track has no node."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seen, constant = {}, torch.ones(1)

    def f(x):
        by = _compat.tracer()
        y = x.detach().sin()
        seen["x"], seen["y"], seen["other"] = (_compat.traced_node(t, by) for t in (x, y, constant))
        return y

    assert _compat.tracer() is None
    graph = make_fx(f, tracing_mode="fake")(torch.randn(3))
    nodes = {n.name: n for n in graph.graph.nodes}
    assert seen["x"] is nodes["x_1"] and seen["x"].op == "placeholder"
    assert seen["y"] is nodes["sin"] and seen["y"].args[0].target == aten.detach.default
    assert seen["other"] is None


def _described(graph: torch.fx.Graph) -> list[tuple]:
    """Each node of ``graph`` as fx holds it: name, op, target, the names it reads, its metadata,
    its users' names, and what ``find_nodes`` finds of its kind."""
    names = lambda a: torch.fx.node.map_arg(a, lambda n: n.name)  # noqa: E731
    return [
        (
            n.name,
            n.op,
            n.target,
            names(n.args),
            names(n.kwargs),
            type(n.kwargs),
            n.type,
            dict(n.meta),
            [u.name for u in n.users],
            [m.name for m in graph.find_nodes(op=n.op, target=n.target)],
        )
        for n in graph.nodes
    ]


def test_copy_nodes_copies_nodes_as_graphs_node_copy_does():
    """Every node of a traced graph (placeholders, ops with keyword arguments and lists of nodes,
    ``getitem``, the output) copied twice into a graph that already holds nodes of those names,
    by ``copy_nodes`` and by fx's ``node_copy``: the same graphs (names made unique alike, the
    same arguments, metadata, users and lookups, the same code); arguments holding a symbolic
    number are found."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, y):
        a, b = torch.split(x * 2, 2)
        return torch.cat([a, b, y], dim=0).sum(dim=1, keepdim=True), torch.full((2,), 3.0)

    traced = make_fx(f, tracing_mode="fake")(torch.randn(4, 3), torch.randn(1, 3))
    graphs = [torch.fx.Graph(), torch.fx.Graph()]
    nodes = [n for n in traced.graph.nodes if n.op != "output"]

    def node_copies(graph, env):
        for node in nodes:
            env[node] = graph.node_copy(node, env.__getitem__)

    for graph, copy in zip(graphs, [lambda g, env: _compat.copy_nodes(g, nodes, env), node_copies]):
        for _ in range(2):
            env: dict = {}
            copy(graph, env)
            assert list(env) == nodes
        graph.output(env[nodes[0]])
    assert _described(graphs[0]) == _described(graphs[1])
    assert len(graphs[0].nodes) == len(graphs[1].nodes) == 2 * (len(traced.graph.nodes) - 1) + 1
    assert graphs[0].python_code("self").src == graphs[1].python_code("self").src
    assert not any(_compat.holds_symbolic(n) for n in traced.graph.nodes)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    graph = torch.fx.Graph()
    with pytest.warns(UserWarning, match="Raw SymInt"):
        view = graph.call_function(
            aten.view.default, (graph.placeholder("x"), [ShapeEnv().create_unbacked_symint(), 3])
        )
    assert _compat.holds_symbolic(view)


def test_metadata_reads_skip_the_traces_torch_function_mode_and_read_the_same():
    """Inside a make_fx trace a tensor's metadata read within ``metadata_reads`` is what it is
    read without (the trace's torch-function mode does not see the read)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.overrides import TorchFunctionMode

    seen = []

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    def f(x):
        t = x.t()
        with Counting():
            plain = (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
            calls = len(seen)
            with _compat.metadata_reads():
                fast = (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
            assert len(seen) == calls > 0
        assert fast == plain == (torch.Size([3, 4]), (1, 3), torch.float32, torch.device("cpu"), False)
        return t

    make_fx(f, tracing_mode="fake")(torch.randn(4, 3))


def test_module_calls_through_hands_a_traces_module_calls_to_a_function():
    """Inside, each module call the make_fx trace records goes through the function (which runs
    the module's forward as it would have run); after, calls are traced as before."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    lin, seen = torch.nn.Linear(3, 3), []

    def twice(module, forward, args, kwargs):
        seen.append(module)
        return forward(*args, **kwargs) * 2

    def f(x):
        with _compat.module_calls_through(_compat.tracer(), twice):
            inside = lin(x)
        return inside + lin(x)

    x = torch.randn(2, 3)
    graph = make_fx(f)(x)
    assert seen == [lin]
    torch.testing.assert_close(graph(x), 3 * lin(x))


def test_trace_aside_traces_beside_a_running_trace_which_records_none_of_it():
    """A function traced on the running trace's fake tensors gives its own graph (the ops and
    numbers of the function); the running trace's graph holds only its own ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    aside = {}

    def f(x):
        aside["graph"] = _compat.trace_aside(lambda a: a.cos() * 2, [x], {})
        return x.sin()

    outer = make_fx(f, tracing_mode="fake")(torch.randn(3))
    assert [n.target for n in outer.graph.nodes if n.op == "call_function"] == [aten.sin.default]
    assert [n.target for n in aside["graph"].graph.nodes if n.op == "call_function"] == [
        aten.cos.default,
        aten.mul.Tensor,
    ]
    y = torch.randn(3)
    torch.testing.assert_close(aside["graph"](y), y.cos() * 2)


def test_untraced_like_and_track_as_make_a_fake_the_trace_reads_as_a_node():
    """A fake like a traced one (shape, strides, dtype) that the trace does not know, until
    ``track_as`` makes the trace read it as a node's value: ops on it then read that node, whose
    value stays the one the trace recorded for it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = {}

    def f(x):
        by = _compat.tracer()
        y = x.sin()
        node = _compat.traced_node(y, by)
        recorded = node.meta["val"]
        u = _compat.untraced_like(y)
        seen["untracked"], seen["meta"] = _compat.traced_node(u, by), (u.shape, u.stride(), u.dtype, u.requires_grad)
        _compat.track_as(u, node, by)
        seen["node"], seen["kept"] = _compat.traced_node(u, by) is node, node.meta["val"] is recorded
        return u * 3

    graph = make_fx(f, tracing_mode="fake")(torch.randn(2, 3))
    assert seen["untracked"] is None and seen["meta"] == (torch.Size([2, 3]), (3, 1), torch.float32, False)
    assert seen["node"] and seen["kept"]
    x = torch.randn(2, 3)
    torch.testing.assert_close(graph(x), x.sin() * 3)
    with pytest.raises(TypeError, match="expected a fake tensor, got Tensor"):
        _compat.untraced_like(torch.ones(1))


def test_untraced_like_makes_the_fake_tensor_fake_tensors_constructor_makes():
    """The fake ``untraced_like`` makes is the one ``FakeTensor(mode, meta, device)`` makes (the
    same attributes: mode, device, no constant, empty memos; the same metadata), of a storage of
    its own, and ops on it run in its mode."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        t = torch.empty(4, 6).t()
    u = _compat.untraced_like(t, requires_grad=True)
    oracle = FakeTensor(mode, torch.empty_strided((6, 4), (1, 6), device="meta"), torch.device("cpu"))
    assert type(u) is FakeTensor and vars(u) == vars(oracle) and u.fake_mode is mode
    assert (u.shape, u.stride(), u.dtype, u.requires_grad) == (torch.Size([6, 4]), (1, 6), torch.float32, True)
    assert u.untyped_storage()._cdata != t.untyped_storage()._cdata
    with mode:
        y = (u * 2).sum(0)
    assert type(y) is FakeTensor and y.shape == (4,) and y.fake_mode is mode


def test_distinct_gives_a_fake_met_again_as_a_new_one_like_it():
    """``distinct`` keeps each fake the first time it is met and gives a new one like it (shape,
    strides, dtype, mode; a storage of its own) each later time, so a trace takes them as so many
    inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        t, other = torch.empty(4, 6).t(), torch.empty(3)
    first, again, kept, third = _compat.distinct([t, t, other, t])
    assert first is t and kept is other
    for u in (again, third):
        assert u is not t and u.fake_mode is mode
        assert (u.shape, u.stride(), u.dtype) == (t.shape, t.stride(), t.dtype)
        assert u.untyped_storage()._cdata != t.untyped_storage()._cdata
    assert again is not third


def test_recorded_meta_is_what_a_trace_under_a_nodes_metadata_records():
    """``recorded_meta`` of a node is the metadata fx records on the nodes a trace makes while it
    runs that node under preserved metadata (as ``torch.fx.Interpreter`` runs it): its stack trace
    and module stack among them."""
    import torch.fx.traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    class Scaled(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    model = torch.nn.Sequential(Scaled())
    gm = torch.fx.symbolic_trace(model)
    for n in gm.graph.nodes:
        n.meta["stack_trace"] = f"File model.py, line {n.name}"
    with fx_traceback.preserve_node_meta():
        again = make_fx(torch.fx.Interpreter(gm).run)(torch.randn(3))
    ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    made = [n for n in again.graph.nodes if n.op == "call_function"]
    assert len(ops) == len(made) == 2
    for op, new in zip(ops, made):
        meta = _compat.recorded_meta(op)
        assert meta["stack_trace"] == f"File model.py, line {op.name}" and "nn_module_stack" in meta
        assert all(new.meta[k] == v for k, v in meta.items() if k != "from_node")
        assert [s.name for s in new.meta["from_node"]] == [s.name for s in meta["from_node"]] == [op.name]


def test_only_tracing_modes_is_false_under_another_dispatch_mode():
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    seen = []

    def f(x):
        seen.append(_compat.only_tracing_modes())
        with Passing():
            seen.append(_compat.only_tracing_modes())
        return x + 1

    make_fx(f, tracing_mode="fake")(torch.randn(2))
    assert seen == [True, False]


def test_real_writes_refused_stops_a_trace_writing_a_real_tensor_before_it_writes():
    """Under a fake trace, an in-place write into a real tensor that existed before it is refused
    (the given error, the tensor as it was); writes into the trace's own fake tensors go through,
    and the trace still counts as running under tracing modes only."""
    from torch.fx.experimental.proxy_tensor import make_fx

    real = torch.zeros(3)
    seen = []

    def writes_real(x):
        real.add_(1.0)
        return x

    def writes_own(x):
        seen.append(_compat.only_tracing_modes())
        y = x * 2
        y.add_(1.0)
        return y

    refuse = lambda op, name, t: ValueError(f"{op} {name} {tuple(t.shape)}")  # noqa: E731
    with _compat.real_writes_refused(refuse):
        with pytest.raises(ValueError, match=r"aten\.add_\.Tensor self \(3,\)"):
            make_fx(writes_real, tracing_mode="fake")(torch.randn(3))
        gm = make_fx(writes_own, tracing_mode="fake")(torch.randn(3))
    assert torch.equal(real, torch.zeros(3))
    assert seen == [True]
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), x * 2 + 1)


def test_real_writes_refused_answers_a_fake_tensors_device_as_the_fake_tensor_does():
    """Under a fake trace, the device autograd asks of a fake tensor from C++ (its engine, of each
    gradient; a custom Function, of its inputs and outputs) is answered by the mode itself, as the
    fake tensor answers it (the meta device inside a fake kernel), not passed down through the
    modes below it; the trace's gradients are torch's."""
    from torch._subclasses.fake_tensor import FakeTensorMode, in_kernel_invocation_manager
    from torch.fx.experimental.proxy_tensor import make_fx

    device = torch.ops.prim.device.default
    below = []

    class Below(_compat.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            below.append(func)
            return func(*args, **(kwargs or {}))

    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(2, 3)
    with Below(), _compat.real_writes_refused(lambda op, name, t: ValueError(op)):
        assert device(fake) == torch.device("cpu")
        with in_kernel_invocation_manager(mode):
            assert device(fake) == torch.device("meta")
        gm = make_fx(lambda x: torch.autograd.grad((x.sin() * x).sum(), x)[0], tracing_mode="fake")(
            torch.randn(3, requires_grad=True)
        )
    assert device not in below
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), x.cos() * x + x.sin())


def test_written_values_are_what_an_op_writes_into_by_its_schema():
    """Each value an op writes into (``Tensor(a!)``: ``self`` of an in-place op, ``out``, each of a
    foreach op's list), once, with its argument's name; of the asked type (fx nodes too)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, y = torch.zeros(2), torch.ones(2)
    aten = torch.ops.aten
    assert _compat.written_values(aten.add_.Tensor, (x, y), {}) == [("self", x)]
    assert _compat.written_values(aten.add.out, (y, y), {"out": x}) == [("out", x)]
    assert _compat.written_values(aten.add.Tensor, (x, y), {}) == []
    assert _compat.written_values(aten._foreach_add_.List, ([x, y, x], [y, y, y]), {}) == [("self", x), ("self", y)]
    c10d = torch.ops.c10d  # (their schemas mark no writes: the first argument of one named in place)
    assert _compat.written_values(c10d.allreduce_.default, ([x, y], None, None, None), {}) == [
        ("tensors", x),
        ("tensors", y),
    ]
    assert _compat.written_values(c10d.allgather_.default, ([[x, y]], [y], None), {}) == [
        ("output_tensors", x),
        ("output_tensors", y),
    ]
    assert _compat.written_values(c10d.send.default, ([x], None, 1, 0), {}) == []
    gm = make_fx(lambda a, b: a.add_(b), tracing_mode="fake")(x, y)
    add = next(n for n in gm.graph.nodes if n.op == "call_function")
    a = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert _compat.written_values(add.target, add.args, add.kwargs, kind=torch.fx.Node) == [("self", a)]
    assert _compat.written_values(add.target, add.args, add.kwargs) == []  # (no tensors among nodes)


def test_global_module_hooks_and_saved_tensor_hooks_say_when_such_hooks_are_in_force():
    assert not _compat.global_module_hooks() and not _compat.saved_tensor_hooks()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        assert _compat.global_module_hooks()
    finally:
        handle.remove()
    assert not _compat.global_module_hooks()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert _compat.saved_tensor_hooks()
    assert not _compat.saved_tensor_hooks()


def test_stack_trace_now_is_what_the_trace_records_on_a_node_made_there():
    """The frames a node made at that point would record (make_fx keeps ``forward`` frames: this
    file's module's), and ``None`` where the trace records no stack traces."""
    from torch.fx.experimental.proxy_tensor import make_fx

    seen = []

    class Sine(torch.nn.Module):
        def forward(self, x):
            seen.append(_compat.stack_trace_now(_compat.tracer()))
            return x.sin()

    graph = make_fx(Sine(), tracing_mode="fake", record_stack_traces=True)(torch.randn(2))
    (sin,) = [n for n in graph.graph.nodes if n.target == aten.sin.default]
    files = [line for line in sin.meta["stack_trace"].splitlines() if line.strip().startswith("File")]
    assert seen[0] is not None and "test_compat.py" in seen[0] and ", in forward" in seen[0]
    assert [line.split(", line")[0] for line in seen[0].splitlines() if line.strip().startswith("File")] == [
        line.split(", line")[0] for line in files
    ]
    make_fx(Sine(), tracing_mode="fake")(torch.randn(2))
    assert seen[1] is None


def test_dead_code_asked_when_unread_removes_what_fx_removes():
    """make_fx's own dead-code pass under ``dead_code_asked_when_unread`` gives fx's graph (the
    unread shape accessors of a symbolic trace removed, an unread op kept as make_fx keeps it),
    asking the side-effect predicate only of unread nodes; fx's pass is back afterwards."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, y):
        z = x.reshape(x.shape[0], -1) * 2
        _ = x.sum() * 3  # (unread, kept: make_fx's predicate keeps any tensor op)
        _ = y.size(0) + 1  # (an unread shape accessor: removed)
        return z.sin() + y[:, :1].sum()

    def trace():
        return make_fx(f, tracing_mode="symbolic")(torch.randn(4, 3), torch.randn(5, 6))

    described = lambda gm: [n.format_node() for n in gm.graph.nodes]  # noqa: E731
    original = torch.fx.Graph.eliminate_dead_code
    want = trace()
    with _compat.dead_code_asked_when_unread():
        got = trace()
        graph = make_fx(lambda a: (a.cos(), a.sin())[1] + 1, tracing_mode="fake")(torch.randn(3)).graph
        asked = []
        assert graph.eliminate_dead_code(lambda n: asked.append(n.name) or n.op != "call_function")
    assert torch.fx.Graph.eliminate_dead_code is original
    assert described(got) == described(want)
    assert sum(n.target is torch.ops.aten.sym_size.int for n in want.graph.nodes) == 1  # (x's, read; y's removed)
    assert any(n.target is torch.ops.aten.mul.Tensor and not n.users for n in want.graph.nodes)
    assert asked == ["output", "cos"]  # (last first; not the placeholder, sin nor add, which are read)
    assert [n.name for n in graph.nodes] == ["a_1", "sin", "add", "output"]


def test_quick_node_values_records_what_make_fx_records():
    """make_fx under ``quick_node_values`` records on every node the metadata it records without it:
    the same ``tensor_meta`` (shape, dtype, strides, memory format: contiguous, channels-last,
    transposed, 0-d, integer, requiring grad) and a ``val`` of the same kind, layout and state, of
    the trace's fake mode; fx's own verbs are back afterwards."""
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, i):
        y = torch.nn.functional.conv2d(x.contiguous(memory_format=torch.channels_last), w)
        return y.transpose(1, 3).sum(0), (i * 2).sum(), y.mean(), x.detach()

    inputs = (torch.randn(2, 3, 5, 5, requires_grad=True), torch.randn(4, 3, 3, 3), torch.ones(3, dtype=torch.int64))
    originals = (proxy_tensor.fast_detach, proxy_tensor._extract_tensor_metadata)

    def recorded():
        gm = make_fx(f, tracing_mode="fake")(*inputs)
        mode = next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"].fake_mode
        out = []
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor):
                assert val.fake_mode is mode
                state = sorted(k for k in vars(val) if k != "fake_mode")
                layout = (type(val), val.shape, val.stride(), val.dtype, val.device, val.requires_grad, state)
                out.append((n.name, layout, n.meta.get("tensor_meta")))
        return out

    want = recorded()
    with _compat.quick_node_values():
        assert (proxy_tensor.fast_detach, proxy_tensor._extract_tensor_metadata) != originals
        got = recorded()
    assert (proxy_tensor.fast_detach, proxy_tensor._extract_tensor_metadata) == originals
    assert got == want
    formats = {m.memory_format for _, _, m in want}
    assert {torch.contiguous_format, torch.channels_last} <= formats and len(want) > 8


def test_placeholders_at_once_makes_what_make_fx_makes(monkeypatch):
    """make_fx under ``placeholders_at_once`` makes the graph it makes without it: the same nodes
    (names, targets, arguments), each with the same metadata (``val``'s kind, layout, state and
    mode, ``tensor_meta``, no stack trace on a placeholder), the ops reading the placeholders,
    whether traced with stack traces, through varargs, or as fx's own way where the fast path
    does not apply (symbolic sizes; a default argument); fx's verbs are back afterwards."""
    from torch.fx import _symbolic_trace
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.proxy_tensor import make_fx

    def described(gm):
        out = []
        for n in gm.graph.nodes:
            val, meta = n.meta.get("val"), dict(n.meta)
            if isinstance(val, torch.Tensor):
                state = sorted(k for k in vars(val) if k != "fake_mode")
                layout = (type(val), val.shape, val.stride(), val.storage_offset(), val.dtype, val.requires_grad, state)
                meta["val"] = (layout, val.fake_mode is gm.mode)
            out.append(
                (n.format_node(), sorted(meta), meta.get("val"), meta.get("tensor_meta"), meta.get("stack_trace"))
            )
        return out

    def traced(fn, inputs, mode="fake"):
        gm = make_fx(fn, tracing_mode=mode, record_stack_traces=True)(*inputs)
        gm.mode = next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"].fake_mode
        return described(gm)

    def scaled(x, w, s=None):
        return x @ w * (2.0 if s is None else s)

    inputs = [torch.randn(3, 4), torch.randn(5, 4, requires_grad=True).t(), torch.ones(2, dtype=torch.int64)]
    cases = [
        (lambda *xs: (xs[0] @ xs[1], xs[2].sum(), xs[0].detach()), inputs, "fake"),
        (lambda x, w, i: x @ w + i.sum(), inputs, "fake"),
        (lambda *xs: xs[0].reshape(-1) * xs[1].sum(), inputs[:2], "symbolic"),
        (scaled, [*inputs[:2], torch.tensor(3.0)], "fake"),
    ]
    want = [traced(*case) for case in cases]
    general, track = _symbolic_trace.Tracer.create_args_for_root, proxy_tensor.track_tensor_tree
    calls = {"general": 0, "track": []}

    def counted_general(*args):
        calls["general"] += 1
        return general(*args)

    def counted_track(inner_res, *args, **kwargs):
        calls["track"].append(type(inner_res) is list)
        return track(inner_res, *args, **kwargs)

    monkeypatch.setattr(_symbolic_trace.Tracer, "create_args_for_root", counted_general)
    monkeypatch.setattr(proxy_tensor, "track_tensor_tree", counted_track)
    got = []
    with _compat.placeholders_at_once():
        for case in cases:
            calls["general"], calls["track"] = 0, []
            got.append((traced(*case), calls["general"], any(calls["track"])))
    assert _symbolic_trace.Tracer.create_args_for_root is counted_general
    assert proxy_tensor.track_tensor_tree is counted_track
    assert [g for g, _, _ in got] == want
    # (fx's placeholder verb and input tracking asked only where the fast path does not apply)
    assert [(general_calls, tracked) for _, general_calls, tracked in got] == [
        (0, False),
        (0, False),
        (0, True),
        (1, False),
    ]
    assert [n[0] for n in want[0] if "placeholder" in n[0]] == [
        "%arg0_1 : [num_users=2] = placeholder[target=arg0_1]",
        "%arg1_1 : [num_users=1] = placeholder[target=arg1_1]",
        "%arg2_1 : [num_users=1] = placeholder[target=arg2_1]",
    ]


def test_placeholders_at_once_nested_keeps_the_outer_use_until_it_ends():
    """A use inside another (a trace within a trace) puts back the outer one's verb when it ends,
    not fx's: the outer trace still takes the fast path, and fx's own is back after both."""
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.proxy_tensor import make_fx

    tracer = proxy_tensor.PythonKeyTracer
    with _compat.placeholders_at_once():
        outer = vars(tracer)["create_args_for_root"]
        with _compat.placeholders_at_once():
            assert vars(tracer)["create_args_for_root"] is not outer
        assert vars(tracer)["create_args_for_root"] is outer
        gm = make_fx(lambda x, w: x @ w, tracing_mode="fake")(torch.randn(2, 3), torch.randn(3, 4))
    assert "create_args_for_root" not in vars(tracer)
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["x_1", "w_1"]
