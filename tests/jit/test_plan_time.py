"""Planning time without loss of plan: the shortcuts the planner takes give exactly the answers
of the long way round.

* DTensor's decision for an op with per-mesh-dim rules (or a whole-op strategy that expands such
  rules itself: ``gather``), asked on the mesh dims some input is not replicated on
  (:func:`vsf._compat.dtensor_decision`), against the question asked of the whole mesh (DTensor
  expanding its rules over every mesh dim): equal on every layout tried.
* A step's optimizer tail functionalized alone (:mod:`vsf.jit.functionalize`) against the whole
  graph traced again: the same graph and plan; and in-place writes that reach another value
  through a view, which make it trace the whole graph, give eager's numbers.
* A model's repeated blocks traced once and stamped out (:mod:`vsf.jit.stamp`) against every
  block traced (``vsf.config.stamp_blocks = False``): the same graph and plan; blocks that differ
  (shapes, a tied weight, a hook, keyed random draws) are not stamped from one trace.
* The ops the planner has no strategy for decomposed where they are (:mod:`vsf.jit.decompose`)
  against the whole graph traced again through their decompositions: the same graph and plan.
"""

from __future__ import annotations

import collections
import math
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from vsf import _compat
from plan_checks import assert_same_plans, assert_same_stack_traces

aten = torch.ops.aten
R = Replicate()


def _layouts(n_inputs: int, ndim: int, choices: list, count: int) -> list[tuple[tuple, ...]]:
    """``count`` layouts of ``n_inputs`` inputs over a mesh of ``ndim`` dims: on some mesh dims
    (at least one) every input replicated, on the others each input one of ``choices``."""
    rng = random.Random(0)
    out = []
    for _ in range(count):
        replicated = set(rng.sample(range(ndim), rng.randint(1, ndim)))
        out.append(
            tuple(tuple(R if k in replicated else rng.choice(choices) for k in range(ndim)) for _ in range(n_inputs))
        )
    return out


CASES = [
    # op, its arguments (a shape: a tensor of it; an int as it is), placements each input may take on a mesh dim
    (aten.bmm.default, [(8, 4, 6), (8, 6, 4)], [R, Shard(0), Shard(1), Shard(2), Partial()]),
    (aten.mm.default, [(8, 6), (6, 4)], [R, Shard(0), Shard(1), Partial()]),
    (aten.add.Tensor, [(8, 6), (6,)], [R, Shard(0), Shard(1), Partial()]),
    (aten.mul.Tensor, [(4, 8, 6), (4, 8, 6)], [R, Shard(0), Shard(2), Partial()]),
    # a whole-op strategy that expands per-mesh-dim rules itself (a loss's: its targets' logits)
    (aten.gather.default, [(8, 6), 1, (8, 1)], [R, Shard(0), Shard(1), Partial()]),
    (aten.gather.default, [(8, 6), 0, (4, 6)], [R, Shard(0), Shard(1), Partial()]),
]


@pytest.mark.parametrize("op, arguments, choices", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_decision_on_split_dims_is_the_whole_mesh_decision(monkeypatch, op, arguments, choices):
    mesh = _compat._abstract_grid((2, 2, 2))
    meshes = []  # the meshes dtensor_decision asks DTensor on
    whole = _compat._full_decision
    monkeypatch.setattr(_compat, "_full_decision", lambda op, a, k, m: meshes.append(m) or whole(op, a, k, m))
    integral = op is aten.gather.default  # (its index: the last tensor)
    values = [
        torch.empty(a, device="meta", dtype=torch.long if integral and k else torch.float32)
        for k, a in enumerate(a for a in arguments if isinstance(a, tuple))
    ]
    fast_ones = 0
    for layouts in _layouts(len(values), 3, choices, 24):
        placed = iter([_compat.Placed(v, p) for v, p in zip(values, layouts)])
        args = tuple(next(placed) if isinstance(a, tuple) else a for a in arguments)

        def ask(fn):
            try:
                return fn(op, args, {}, mesh)
            except Exception as e:  # noqa: BLE001 - a refusal must be the same refusal
                return type(e)

        full = ask(whole)
        meshes.clear()
        assert ask(_compat.dtensor_decision) == full, layouts
        fast_ones += mesh not in meshes
    assert fast_ones > 5  # the shortcut was taken, not only the long way


def _gpt_plan(layers: int, shape: tuple[int, ...], optimizer: bool = False):
    """The plan of an SGD step (``optimizer``: vsf's AdamW, in foreach and in-place ops) of a
    ``layers``-layer GPT (separate qkv/proj/fc1/fc2 linears, tp on the weights Megatron's way,
    batch over dp x fsdp) on a planning-only 5D mesh of ``shape``."""
    step, args = _gpt_step(layers, shape, optimizer)
    return step.lower(*args)


def _gpt_step(layers: int, shape: tuple[int, ...], optimizer: bool = False):
    """:func:`_gpt_plan`'s jitted step and its arguments."""
    from toy_models import GPT, GPTConfig

    import vsf
    from vsf import P

    cfg = GPTConfig(vocab=64, seq=16, dim=32, heads=4, layers=layers)
    with torch.device("meta"):
        model = GPT(cfg)
    mesh = vsf.make_mesh(shape, ("pp", "dp", "fsdp", "cp", "tp"))
    rules = [(r".*(qkv|fc1)\.(weight|bias)", P("tp")), (r".*(proj|fc2)\.weight", P(None, "tp")), (r".*", P())]
    params = {k: torch.empty(v.shape) for k, v in vsf.tree.from_module(model).items()}
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    idx = vsf.device_put(torch.zeros(16, cfg.seq, dtype=torch.long), vsf.NamedSharding(mesh, P(("dp", "fsdp"))))

    def loss_fn(p, idx, tgt):
        return vsf.tree.apply(model, p, idx, tgt)

    def step(p, idx, tgt):
        loss, g = vsf.value_and_grad(loss_fn)(p, idx, tgt)
        return vsf.tree.map(lambda a, b: a - 0.01 * b, p, g), loss

    if not optimizer:
        return vsf.jit(step), (p, idx, idx)
    tx = vsf.optim.adamw(1e-3, weight_decay=0.1)

    def adamw_step(p, s, idx, tgt):
        loss, g = vsf.value_and_grad(loss_fn)(p, idx, tgt)
        u, s = tx.update(g, s, p)
        return vsf.optim.apply_updates(p, u), s, loss

    return vsf.jit(adamw_step), (p, tx.init(p), idx, idx)


@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 2), (2, 2, 2, 2, 2)])
def test_blocks_decided_once_plan_as_decided_one_by_one(sim, monkeypatch, shape):
    """The solver decides once per op context and reuses the decision for the repeated blocks'
    ops, solves an axis's problem once where the second sweep poses it again, and replicates
    without solving an axis nothing is sharded over (``AxisSolver.reuse``); planned with every op costed anew and every sweep solved, the AdamW
    step of a 4-layer GPT has the same plan: every op's placements, every redistribution, the
    bytes and collectives."""
    from vsf.jit import solver

    sim(math.prod(shape), compute=False)
    asked, solved = [], []
    choose, solve = solver.AxisSolver._choose, solver.AxisSolver.solve
    monkeypatch.setattr(
        solver.AxisSolver, "_choose", lambda self, k, greedy: asked.append(k) or choose(self, k, greedy)
    )
    monkeypatch.setattr(solver.AxisSolver, "solve", lambda self: solved.append(self.axis) or solve(self))
    reused = _gpt_plan(4, shape, optimizer=True)
    decided, sweeps = len(asked), list(solved)
    monkeypatch.setattr(solver.AxisSolver, "reuse", False)
    asked.clear()
    solved.clear()
    one_by_one = _gpt_plan(4, shape, optimizer=True)
    assert decided < len(asked) / 2  # blocks were decided once, not op by op
    axes = ["pp", "dp", "fsdp", "cp", "tp"]
    axes = [a for a, n in zip(axes, shape) if n > 1]
    assert solved == axes * 2  # the long way: two sweeps, every axis solved in each
    named = ["dp", "fsdp", "tp"]  # (pp and cp: nothing is sharded over them, replicated without solving)
    assert sweeps == named + named[:-1]  # tp's second problem is its first: not solved again
    assert_same_plans(reused, one_by_one)


@pytest.mark.parametrize("shape, names, batch", [((2,), ("tp",), ()), ((2, 2), ("dp", "tp"), ("dp",))])
def test_moves_skipped_that_cannot_pay_plan_as_every_move_tried(sim, monkeypatch, shape, names, batch):
    """The partial-sum merges are tried only for the ops within reach of a value that costs
    something or of work run beyond its share (``AxisSolver._near_costs``), and a redistribution
    whose cascades failed is not tried again while nothing they read changed
    (``solver._Failed.again``): a 1-layer GPT with separate q/k/v projections under Megatron tp
    (at a 4 KiB start-up: on tp alone merging the block's input gradients pays, over dp x tp a
    cascade pays, which the next round's tries read) has the plan of every move tried: every op's
    placements, every redistribution, the bytes and collectives; and fewer moves were tried."""
    from toy_models import GPT, GPTConfig

    import vsf
    from vsf import P
    from vsf.jit import solver

    sim(math.prod(shape), compute=False)
    monkeypatch.setattr(vsf.config, "collective_latency_bytes", 4096.0)
    cfg = GPTConfig(vocab=512, seq=64, dim=128, heads=4, layers=1, fused_qkv=False)
    with torch.device("meta"):
        model = GPT(cfg)
    rules = [(r".*(attn\.(q|k|v)|fc1)\.(weight|bias)", P("tp")), (r".*(proj|fc2)\.weight", P(None, "tp")), (r".*", P())]
    mesh = vsf.make_mesh(shape, names)
    params = {k: torch.empty(v.shape) for k, v in vsf.tree.from_module(model).items()}
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    idx = vsf.device_put(torch.zeros(8, cfg.seq, dtype=torch.long), vsf.NamedSharding(mesh, P(*batch)))

    def step(p, idx, tgt):
        return vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, tgt))(p)

    tried, kept = [], []
    merge, attempt, cascade = solver.AxisSolver._merge_partials, solver.AxisSolver._try, solver.AxisSolver._cascade
    monkeypatch.setattr(solver.AxisSolver, "_merge_partials", lambda self, k: tried.append(k) or merge(self, k))
    monkeypatch.setattr(solver.AxisSolver, "_try", lambda self, moves: kept.append(attempt(self, moves)) or kept[-1])
    monkeypatch.setattr(
        solver.AxisSolver, "_cascade", lambda self, *a: tried.append(a) or kept.append(cascade(self, *a)) or kept[-1]
    )
    skipping = vsf.jit(step).lower(p, idx, idx)
    some, paid = len(tried), sum(map(bool, kept))
    monkeypatch.setattr(solver.AxisSolver, "_near_costs", lambda self, seeds: set(range(len(self.p.ops))))
    monkeypatch.setattr(solver._Failed, "again", lambda self, key: False)
    tried.clear()
    every = vsf.jit(step).lower(p, idx, idx)
    assert paid > 0  # (moves were kept: what they changed was tried afresh)
    assert some < len(tried)
    assert_same_plans(skipping, every)


def test_strategies_listed_once_per_list_are_each_ops_own(sim, monkeypatch):
    """A cascade round lists an op's strategies that read an input as it is and keep the op's work
    split (``AxisSolver._reading``), and those giving an output a placement (``_giving``), once per
    strategy list, inputs and placement (and whether every strategy keeps the work split): for
    every strategy list of a 2-layer GPT's AdamW step on tp, its op under a strategy that leaves
    an operand split and under one that leaves none, they are the strategies that do so one by one."""
    from vsf.jit import solver

    sim(8, compute=False)
    solvers = []
    solve = solver.AxisSolver.solve
    monkeypatch.setattr(solver.AxisSolver, "solve", lambda self: solvers.append(self) or solve(self))
    _gpt_plan(2, (1, 2, 2, 1, 2), optimizer=True)
    tp = [s for s in solvers if s.axis == "tp"][-1]
    lists = {id(options): c for c, options in enumerate(tp.strategies)}.values()
    modes = set()
    for c in lists:
        options = tp.strategies[c]
        for was in {tp.divided[c][j]: j for j in range(len(options))}.values():
            tp.choice[c] = was
            modes.add((tp.view[c], tp.divided[c][was]))
            for v in tp.ins[c]:
                here = tuple(i for i, u in enumerate(tp.ins[c]) if u == v)
                for lab in {st[0][here[0]] for st in options}:
                    one_by_one = [
                        j
                        for j in range(len(options))
                        if tp._keeps_split(c, j) and all(options[j][0][i] == lab for i in here)
                    ]
                    assert tp._reading(c, here, lab) == one_by_one
            for i in range(len(tp.outs[c])):
                for req in {st[1][i] for st in options}:
                    assert tp._giving(c, i, req) == [j for j, (_, outs) in enumerate(options) if outs[i] == req]
    assert (False, True) in modes and (False, False) in modes  # (both ways of keeping work split were met)


def test_an_axis_posed_other_bytes_is_solved_again(sim, monkeypatch):
    """An axis's problem is solved again unless every number the solver reads from the other
    axes is the one it solved with (``AxisSolver.poses_as``): posed again as it was, solving gives
    the same choices; with only the values' bytes on the axis changed (as another axis's choice
    changes them), it is a new problem, and its choices differ."""
    from vsf.jit import propagate, solver

    sim(8, compute=False)
    tables, problems = {}, []
    monkeypatch.setattr(propagate, "_drop_solvers", lambda problems: None)  # (the solvers read after planning)
    build, solve = solver.AxisTables.build, solver.AxisSolver.solve
    monkeypatch.setattr(
        solver.AxisTables,
        "build",
        classmethod(lambda cls, problem, axis, codes: tables.setdefault(axis, build(problem, axis, codes))),
    )
    monkeypatch.setattr(solver.AxisSolver, "solve", lambda self: problems.append(self.p) or solve(self))
    _gpt_plan(2, (1, 2, 2, 1, 2), optimizer=True)
    problem = problems[-1]
    done = problem.solved["tp"]
    again = solver.AxisSolver(problem, "tp", tables["tp"])
    assert again.poses_as(done)
    again.solve()
    assert again.choice == done.choice
    other = solver.AxisSolver(problem, "tp", tables["tp"])
    other.fb = [b / 4096 for b in other.fb]  # (start-ups outweigh bytes)
    assert not other.poses_as(done)
    other.solve()
    assert other.choice != done.choice


def test_an_axis_nothing_shards_is_replicated_and_changes_no_other_axis(monkeypatch):
    """pp and cp of size 2, over which no input, output or constraint shards anything, are
    replicated throughout without being solved, and the plan over dp, fsdp and tp is the plan on the
    mesh where pp and cp have size 1: every op's placements on those axes, every redistribution,
    the bytes and collectives."""
    from vsf.jit import solver

    solved = []
    solve = solver.AxisSolver.solve
    monkeypatch.setattr(solver.AxisSolver, "solve", lambda self: solved.append(self.axis) or solve(self))
    import vsf

    with vsf.simulate(32, compute=False):
        wide = _gpt_plan(1, (2, 2, 2, 2, 2), optimizer=True)
    assert {"pp", "cp"}.isdisjoint(solved) and {"dp", "fsdp", "tp"} <= set(solved)
    with vsf.simulate(8, compute=False):
        narrow = _gpt_plan(1, (1, 2, 2, 1, 2), optimizer=True)
    # (a plan's placements are over the mesh's dims of size > 1: pp, dp, fsdp, cp, tp against dp, fsdp, tp)
    named = lambda pls: tuple(None if p is None else (p[1], p[2], p[4]) for p in pls)  # noqa: E731
    idle = lambda pls: {p[k] for p in pls if p is not None for k in (0, 3)}  # noqa: E731
    wide_nodes, narrow_nodes = list(wide.plan.nodes.values()), list(narrow.plan.nodes.values())
    assert [(named(p.ins), named(p.outs)) for p in wide_nodes] == [(p.ins, p.outs) for p in narrow_nodes]
    assert set().union(*(idle(p.ins) | idle(p.outs) for p in wide_nodes)) == {R}
    assert [named([r.src, r.dst]) for r in wide.plan.redistributions] == [
        (r.src, r.dst) for r in narrow.plan.redistributions
    ]
    assert wide.cost().comm_bytes == narrow.cost().comm_bytes
    assert wide.cost().collectives == narrow.cost().collectives


def test_stack_traces_recorded_as_fx_records_them(sim, monkeypatch):
    """Tracing records each op's stack trace by walking the Python frames it keeps
    (:func:`vsf._compat.kept_frames_only`); fx's own capture of every frame gives the same text on
    every node of a GPT train step, forward and backward, and names the model's lines."""
    import contextlib

    from vsf.jit.graph import source_line

    sim(8, compute=False)
    fast = _gpt_plan(2, (1, 2, 2, 1, 2)).plan.graph
    monkeypatch.setattr(_compat, "kept_frames_only", contextlib.nullcontext)
    full = _gpt_plan(2, (1, 2, 2, 1, 2)).plan.graph
    traces = lambda gm: [(n.name, n.meta.get("stack_trace")) for n in gm.graph.nodes]  # noqa: E731
    assert traces(fast) == traces(full)
    assert sum("toy_models.py" in source_line(n) for n in fast.graph.nodes) > 50


def test_optimizer_update_traced_alone_plans_as_the_whole_graph_traced_again(sim, monkeypatch):
    """vsf's AdamW writes in foreach ops where it does not stamp its updates per leaf
    (``stamp_blocks`` off); only the ops that write, or read what is written (its update), are
    traced again (its foreach ops not split in the graph: ``_splits_in_place`` off), not the
    forward and backward before it, and the step's graph and plan are those of every op traced
    again."""
    import vsf
    from vsf.jit import functionalize

    sim(8, compute=False)
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    regions = []
    find = functionalize._written_region
    monkeypatch.setattr(functionalize, "_splits_in_place", lambda *a: False)
    monkeypatch.setattr(functionalize, "_written_region", lambda nodes: regions.append(find(nodes)) or regions[-1])
    alone = _gpt_plan(2, (1, 2, 2, 1, 2), optimizer=True)
    [region] = regions
    assert region and not any(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for n in region)
    monkeypatch.setattr(functionalize, "_written_region", lambda nodes: None)
    whole = _gpt_plan(2, (1, 2, 2, 1, 2), optimizer=True)
    assert not any(n.target in functionalize._FOREACH_DECOMPOSITIONS for n in alone.plan.graph.graph.nodes)
    assert_same_plans(alone, whole)


def _described(lowered) -> list[tuple]:
    """Each node of a lowered step's graph: its text (name, op, arguments), the shapes, strides,
    storage offsets and dtypes of its value, and its stack trace."""
    out = []
    for n in lowered.plan.graph.graph.nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        metas = [(tuple(v.shape), v.stride(), v.storage_offset(), v.dtype) for v in vals if isinstance(v, torch.Tensor)]
        out.append((n.format_node(), metas, n.stack_trace))
    return out


@pytest.mark.parametrize("mixed", [False, True])
def test_optimizer_foreach_split_in_the_graph_as_its_trace_records_it(sim, monkeypatch, mixed):
    """AdamW's ``apply_updates`` is one ``_foreach_add`` after the last in-place-free op: it is
    split into per-leaf adds in the graph itself, not traced again, and the graph (every node's
    name, op, arguments, value metadata and stack trace) and the plan are those the trace of the
    tail records (``mixed``: bf16 params among fp32 ones: a foreach op per dtype), where the
    adds are not stamped per leaf (``stamp_blocks`` off)."""
    import vsf
    from vsf.jit import functionalize

    sim(8, compute=False)
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    step, (p, s, idx, tgt) = _gpt_step(2, (1, 2, 2, 1, 2), optimizer=True)
    if mixed:
        p = {k: v.to(torch.bfloat16) if k.endswith("fc1.weight") else v for k, v in p.items()}
        s = vsf.optim.adamw(1e-3, weight_decay=0.1).init(p)
    took = []
    check = functionalize._splits_in_place
    monkeypatch.setattr(functionalize, "_splits_in_place", lambda *a: took.append(check(*a)) or took[-1])
    split = step.lower(p, s, idx, tgt)
    assert took == [True]
    monkeypatch.setattr(functionalize, "_splits_in_place", lambda *a: False)
    traced = vsf.jit(step.fun).lower(p, s, idx, tgt)
    assert _described(split) == _described(traced)
    assert sum(n.target is torch.ops.aten.add.Tensor for n in split.plan.graph.graph.nodes) >= len(p)
    assert_same_plans(split, traced)


def _fresh(a):  # writes to its own value
    y = a * 2
    s = y.sum()
    y.add_(1)
    return y * 3, s


def _written_view(a):  # writes through a view of its own value
    y = a * 2
    v = y.view(2, -1)
    s = y.sum()
    v.mul_(3)
    return y + 1, s


def _read_view(a):  # a view made before the write sees it
    y = a * 2
    c = y[1:]
    s = c.sum()
    y.add_(1)
    return c * 2, s


def _returned_written(a):  # the step returns the value it wrote
    y = a + 1
    z = y * 2
    y.mul_(z)
    return (y,)


def _signed_zeros(a):  # two writes alike but for their zero's sign: each traced as its own
    y, z = a.abs() + 1, a.abs() + 2
    y.mul_(0.0)
    z.mul_(-0.0)
    return 1 / y, 1 / z


def _foreach(a):
    ys = torch._foreach_mul([a, a + 1], 2.0)
    torch._foreach_add_(ys, 1.0)
    return ys


def _vector_times_matrix(a):  # torch's matmul of a vector squeezes its mm's result in place: every op
    import vsf

    return vsf.value_and_grad(lambda a: (a[:, 0] @ a).square().sum())(a)


@pytest.mark.parametrize(
    "fn, alone",
    [
        (_fresh, True),
        (_written_view, True),
        (_read_view, True),
        (_returned_written, True),
        (_signed_zeros, True),
        (_foreach, True),
        (_vector_times_matrix, False),
    ],
)
def test_in_place_writes_give_eager_numbers(sim, monkeypatch, fn, alone):
    """A step that writes in place to values it made gives eager torch's numbers, functionalized
    with only the ops that write, alias or read what is written traced again, and with every op
    traced again (where a write changes its value's shape, ``squeeze_``, which functionalization
    keeps as it is on its trace's input, the planner having no strategy for its decomposition:
    always so)."""
    import vsf
    from vsf import P
    from vsf.jit import functionalize

    sim(2)
    x = torch.arange(8.0).reshape(4, 2)
    mesh = vsf.make_mesh((2,), ("dp",))
    find, found, lowered = functionalize._written_region, [], []
    for way in (lambda nodes: found.append(find(nodes) is not None) or find(nodes), lambda nodes: None):
        monkeypatch.setattr(functionalize, "_written_region", way)
        jitted, arg = vsf.jit(fn), vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))
        for g, want in zip(jitted(arg), fn(x.clone()), strict=True):
            torch.testing.assert_close(vsf.device_get(g), want)
        lowered.append(jitted.lower(arg))
    assert found == [alone]
    assert_same_plans(*lowered)


def test_writes_traced_alone_across_stamped_blocks_give_eager_numbers(sim, monkeypatch):
    """A stamped block's copies of one node all hold the value its trace recorded
    (:mod:`vsf.jit.stamp`), so the ops that read a write between the blocks' forward and their
    backward (a loss written to in place), traced again alone, whose backward ops read each
    block's saved activations, are traced on a value of its own for each of them: the gradients
    are eager torch's, each block's its own."""
    import vsf
    from vsf import P
    from vsf.jit import functionalize

    torch.manual_seed(0)
    model = _Stack([_Block(8, 16) for _ in range(2)]).eval()

    def loss(p, x):
        out = vsf.tree.apply(model, p, x) * 1
        out.add_(1.0)
        return out

    params, x = vsf.tree.from_module(model), torch.randn(4, 8)
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    want = torch.autograd.grad(torch.func.functional_call(model, leaves, (x,)), list(leaves.values()))
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    args = (vsf.device_put(params, vsf.NamedSharding(mesh, P())), vsf.device_put(x, vsf.NamedSharding(mesh, P("dp"))))
    took = []
    find = functionalize._written_region
    monkeypatch.setattr(functionalize, "_written_region", lambda nodes: took.append(find(nodes)) or took[-1])
    jitted = vsf.jit(vsf.grad(loss))
    assert jitted.trace(*args).stamped["_Block"] == (2,)
    [region] = took  # (the writes alone, and the backward reading them)
    assert region and not any(n.target is torch.ops.aten.addmm.default for n in region)
    got = vsf.device_get(jitted(*args))
    for k, w in zip(leaves, want, strict=True):
        torch.testing.assert_close(got[k], w)


def test_planning_pauses_the_garbage_collector_and_restores_it(sim):
    """A call is traced and planned with Python's cyclic collector off (``vsf.runtime.collector_paused``),
    and the collector is as it was afterwards: on, off, or after a trace that raised."""
    import gc

    import vsf
    from vsf import P

    sim(2, compute=False)
    seen = []

    def step(a):
        seen.append(gc.isenabled())
        return a * 2

    def broken(a):
        seen.append(gc.isenabled())
        raise RuntimeError("step failed")

    x = vsf.device_put(torch.ones(4, 2), vsf.NamedSharding(vsf.make_mesh((2,), ("dp",)), P("dp")))
    assert gc.isenabled()
    vsf.jit(step).lower(x)
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="step failed"):
        vsf.jit(broken).lower(x)
    assert gc.isenabled()
    gc.disable()
    try:
        vsf.jit(lambda a: step(a) + 1).lower(x)
        assert not gc.isenabled()
    finally:
        gc.enable()
    assert seen == [False, False, False]


def test_planning_leaves_its_solvers_to_reference_counting(sim):
    """A plan's axis solvers and their problem (each solver refers to the problem that holds it) are
    freed when planning ends, not left for the cyclic collector's first pass after it (which walked
    them all): with the collector off, none is alive once ``lower`` returns, nor is one kept by the plan."""
    import gc

    from vsf.jit import solver

    def alive() -> list[str]:
        kinds = (solver.AxisSolver, solver.AxisTables, solver.Problem)
        return [type(o).__name__ for o in gc.get_objects() if type(o) in kinds]

    sim(8, compute=False)
    gc.collect()
    gc.disable()
    try:
        lowered = _gpt_plan(2, (1, 2, 2, 1, 2))
        assert alive() == []
    finally:
        gc.enable()
    assert lowered.as_text()


@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 2), (2, 2, 2, 2, 2)])
def test_blocks_traced_once_plan_as_traced_one_by_one(sim, monkeypatch, shape):
    """An AdamW step of a 4-layer GPT on a 5D mesh: its blocks stamped from one trace and each
    leaf's Adam update from one trace per kind of leaf, the graph (every op in order, reading the
    same values) and plan (placements, redistributions, bytes, collectives) are those of every
    block and update traced (apply_updates' foreach add split per leaf in the graph), and each op
    names the same user lines."""
    import vsf

    sim(math.prod(shape), compute=False)
    step, args = _gpt_step(4, shape, optimizer=True)
    traced = step.trace(*args).stamped
    assert traced["Block"] == (4,) and set(traced) == {"Block", "adam_step", "detach", "add"}
    assert sum(traced["add"]) == len(args[0]) > len(traced["add"])  # apply_updates' add of each leaf
    assert sum(traced["adam_step"]) == len(args[0]) > len(traced["adam_step"])  # every leaf's update, fewer traces
    assert sum(traced["detach"]) == len(args[0]) > len(traced["detach"])  # every leaf as value_and_grad takes it
    stamped = step.lower(*args)
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    step, args = _gpt_step(4, shape, optimizer=True)
    assert step.trace(*args).stamped == {}
    one_by_one = step.lower(*args)
    assert_same_plans(stamped, one_by_one)
    assert_same_stack_traces(stamped, one_by_one)
    assert _described(stamped) == _described(one_by_one)  # every node's name, arguments and value metadata too


class _Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.dropout(torch.tanh(self.fc1(x)), 0.1, self.training))


class _Stack(torch.nn.Module):
    def __init__(self, blocks: list[torch.nn.Module], checkpointed: bool = False) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(8, 8)  # (every block's input needs a gradient)
        self.blocks = torch.nn.ModuleList(blocks)
        self.checkpointed = checkpointed

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x.square().mean()


def _stamps(model, keyed: bool = False):
    """What one trace of an SGD step of ``model`` (a :class:`_Stack` on 8-wide inputs, batch over
    2 simulated ranks; ``keyed``: run under ``vsf.random.keyed``) stamped, and its plan."""
    import vsf
    from vsf import P

    def loss_fn(p, x, key):
        if not keyed:
            return vsf.tree.apply(model, p, x)
        with vsf.random.keyed(key):
            return vsf.tree.apply(model, p, x)

    def step(p, x, key):
        loss, g = vsf.value_and_grad(loss_fn)(p, x, key)
        return vsf.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

    mesh = vsf.make_mesh((2,), ("dp",))
    params = vsf.device_put(vsf.tree.from_module(model), vsf.NamedSharding(mesh, P()))
    x = vsf.device_put(torch.randn(4, 8), vsf.NamedSharding(mesh, P("dp")))
    key = vsf.device_put(vsf.random.key(0), vsf.NamedSharding(mesh, P()))
    jitted = vsf.jit(step)
    return jitted.trace(params, x, key).stamped, jitted.lower(params, x, key)


def test_blocks_that_differ_are_not_stamped_together(sim, monkeypatch):
    """Blocks share a trace only where nothing that shapes their graph differs: a block of another
    width gets a trace of its own, a block holding a weight another block holds (tied) is traced
    by itself, as is a block with a hook; none is stamped under ``vsf.random.keyed`` (each draw
    folds in its own count) or inside activation checkpointing (which recomputes what the block
    saves); the plans are those of every block traced. (Each param's detach, as ``value_and_grad``
    takes it before the loss runs, is stamped per kind of param.)"""
    import vsf

    torch.manual_seed(0)
    wide = _Stack([_Block(8, 16), _Block(8, 32), _Block(8, 16), _Block(8, 32)]).eval()
    tied = _Stack([_Block(8, 16) for _ in range(3)]).eval()
    tied.blocks[2].fc1.weight = tied.blocks[0].fc1.weight
    hooked = _Stack([_Block(8, 16) for _ in range(3)]).eval()
    hooked.blocks[1].register_forward_hook(lambda m, i, o: o)
    training = _Stack([_Block(8, 16) for _ in range(2)]).train()
    checkpointed = _Stack([_Block(8, 16) for _ in range(2)], checkpointed=True).eval()
    cases = [(wide, False, {"_Block": (2, 2)}), (tied, False, {"_Block": (2,)}), (hooked, False, {"_Block": (2,)})]
    cases += [(training, True, {}), (checkpointed, False, {})]
    sim(2)
    for model, keyed, want in cases:
        monkeypatch.setattr(vsf.config, "stamp_blocks", True)
        stamped, plan = _stamps(model, keyed)
        assert sum(stamped.pop("detach")) == len(vsf.tree.leaves(vsf.tree.from_module(model)))
        assert stamped == want
        monkeypatch.setattr(vsf.config, "stamp_blocks", False)
        assert_same_plans(plan, _stamps(model, keyed)[1])


def _assert_torchs_loss_and_gradients(model, x) -> None:
    """The jitted loss and gradients of ``model`` (a :class:`_Stack`) at ``x``, batch over 2
    simulated ranks, are plain PyTorch's."""
    import vsf

    model.zero_grad()
    model(x).backward()
    want = {k: v.grad.clone() for k, v in model.named_parameters()}
    mesh = vsf.make_mesh((2,), ("dp",))
    params = vsf.device_put(vsf.tree.from_module(model), vsf.NamedSharding(mesh, vsf.P()))
    step = vsf.jit(lambda p, x: vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, x))(p))
    loss, grads = step(params, vsf.device_put(x, vsf.NamedSharding(mesh, vsf.P("dp"))))
    torch.testing.assert_close(vsf.device_get(loss), model(x).detach())
    got = vsf.device_get(grads)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g)


def _assert_stamped_and_planned_as_traced(monkeypatch, cases) -> None:
    """For each ``(model, want)``: what one trace of its step stamped (each param's detach aside) is
    ``want``, and its plan is the one every block traced the plain way gives."""
    import vsf

    for model, want in cases:
        monkeypatch.setattr(vsf.config, "stamp_blocks", True)
        stamped, plan = _stamps(model)
        stamped.pop("detach")
        assert stamped == want
        monkeypatch.setattr(vsf.config, "stamp_blocks", False)
        assert_same_plans(plan, _stamps(model)[1])


class _Scale:
    """A helper object a block holds and calls, as diffusers' ``Attention`` holds its processor."""

    def __init__(self, factor: float | list[float]) -> None:
        self.factor = factor

    def __call__(self, x):
        return x * (self.factor[0] if isinstance(self.factor, list) else self.factor)


class _Helped(_Block):
    """A :class:`_Block` whose hidden activation goes through a helper of its own (``act``)."""

    def __init__(self, act) -> None:
        super().__init__(8, 16)
        self.act = act

    def forward(self, x):
        return x + self.fc2(self.act(torch.tanh(self.fc1(x))))


def test_blocks_holding_alike_helpers_share_a_trace_and_others_do_not(sim, monkeypatch):
    """A helper object each block holds (one per block) is keyed by its class and its state where
    it holds nothing but plain values: blocks holding helpers of one class and state share a trace
    (the first and third of 2.0, 3.0, 2.0), one of other state gets a trace of its own; a function
    (shared only by the blocks holding the very same one), a ``functools.partial`` or a helper
    holding a list (which may change) is keyed by its identity (its behaviour is not its class and plain state);
    the plans are those of every block traced."""
    import functools

    torch.manual_seed(0)
    alike = _Stack([_Helped(_Scale(2.0)) for _ in range(3)]).eval()
    unlike = _Stack([_Helped(_Scale(f)) for f in (2.0, 3.0, 2.0)]).eval()
    functions = _Stack([_Helped(f) for f in (torch.sin, torch.cos, torch.sin)]).eval()
    partials = _Stack([_Helped(functools.partial(torch.mul, other=f)) for f in (2.0, 3.0, 2.0)]).eval()
    holding = _Stack([_Helped(_Scale([2.0])) for _ in range(2)]).eval()
    cases = [(alike, {"_Helped": (3,)}), (unlike, {"_Helped": (2, 1)}), (functions, {"_Helped": (2, 1)})]
    cases += [(partials, {"_Helped": (1, 1, 1)}), (holding, {"_Helped": (1, 1)})]
    sim(2)
    _assert_stamped_and_planned_as_traced(monkeypatch, cases)


class _Scaling(_Block):
    """A :class:`_Block` that scales in place a tensor: its own hidden activation, or (``given``)
    the input it was called with."""

    def __init__(self, given: bool) -> None:
        super().__init__(8, 16)
        self.given = given

    def forward(self, x):
        if self.given:
            return self.fc2(torch.tanh(self.fc1(x.mul_(2.0))))
        h = torch.tanh(self.fc1(x)) * 1.0  # (a tensor no op saves for the backward)
        h[:, :4].mul_(2.0)  # (in place through a view of it)
        return x + self.fc2(h)


class _CalledFromTwoLines(_Stack):
    def forward(self, x):
        x = self.blocks[0](self.stem(x))
        x = self.blocks[1](x)
        return x.square().mean()


class _Scan(_Block):
    """A :class:`_Block` that runs a scan over its hidden units in place, into a tensor it made
    (as mamba.py's parallel scan does)."""

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        out = torch.zeros_like(h)
        out[:, 0] = h[:, 0]
        for t in range(1, 4):
            out[:, t].add_(out[:, t - 1] * 0.5 + h[:, t])
        return x + self.fc2(out)


@pytest.mark.parametrize("stack", [_Stack, "two lines"])
def test_blocks_scanning_in_place_are_functionalized_alone_and_give_torchs_gradients(sim, monkeypatch, stack):
    """Stamped blocks that each write in place into a tensor of their own: only their writes, the
    views of what they write and the ops reading those are functionalized, once for all the
    blocks' parts alike (each copy's ops then record its own stack trace: blocks called from two
    lines); the trace again of every op is the oracle (the same plan and stack traces), and the
    loss and gradients are plain PyTorch's."""
    from vsf.jit import functionalize

    torch.manual_seed(0)
    blocks = [_Scan(8, 16) for _ in range(3 if stack is _Stack else 2)]
    model = (_Stack(blocks) if stack is _Stack else _CalledFromTwoLines(blocks)).eval()
    x = torch.randn(4, 8)
    sim(2)
    find, regions, traced, parts = functionalize._written_region, [], [], []
    monkeypatch.setattr(functionalize, "_written_region", lambda nodes: regions.append(find(nodes)) or regions[-1])
    trace, split = functionalize._trace_part, functionalize._parts
    monkeypatch.setattr(functionalize, "_trace_part", lambda *a: traced.append(a[1]) or trace(*a))
    monkeypatch.setattr(functionalize, "_parts", lambda r: parts.append(split(r)) or parts[-1])
    stamped, alone = _stamps(model)
    region = regions[-1]
    assert stamped["_Scan"] == (len(blocks),)
    assert region and not any(n.target is torch.ops.aten.tanh.default for n in region)  # (read nothing written)
    # each block's parts (its forward's scan, its backward's) alike the other blocks', traced once
    assert len(parts[-1]) == len(blocks) * 2 and len(traced) == 2 * len(parts)
    monkeypatch.setattr(functionalize, "_written_region", lambda nodes: None)
    every = _stamps(model)[1]
    assert_same_plans(alone, every)
    assert_same_stack_traces(alone, every)
    monkeypatch.setattr(functionalize, "_written_region", find)
    _assert_torchs_loss_and_gradients(model, x)


class _Signed(_Block):
    """A :class:`_Block` called with a zero whose sign its output shows (``atan(1 / zero)``)."""

    def forward(self, x, zero):
        h = torch.tanh(self.fc1(x))
        return x + self.fc2(h + torch.atan(1 / torch.full_like(h, zero)))


class _SignedStack(_Stack):
    def forward(self, x):
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            x = block(x, -0.0 if i % 2 else 0.0)
        return x.square().mean()


def test_blocks_called_with_zeros_of_two_signs_are_stamped_apart_and_give_torchs_gradients(sim):
    """Blocks called with ``0.0`` and with ``-0.0`` (equal by ``==``, not in what they compute) get
    a trace each, and the step's loss and gradients are plain PyTorch's."""
    torch.manual_seed(0)
    model = _SignedStack([_Signed(8, 16) for _ in range(3)]).eval()
    sim(2)
    assert _stamps(model)[0]["_Signed"] == (2, 1)
    _assert_torchs_loss_and_gradients(model, torch.randn(4, 8))


class _Tallied(_Block):
    """A :class:`_Block` that adds its input to a tally the caller passes every block."""

    def forward(self, x, tally):
        tally.add_(x.detach())
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _TallyStack(_Stack):
    def forward(self, x):
        x = self.stem(x)
        tally = torch.zeros_like(x)
        for block in self.blocks:
            x = block(x, tally)
        return x.square().mean() + tally.mean()


def test_blocks_writing_their_own_tensors_in_place_are_stamped_and_into_their_inputs_are_not(sim, monkeypatch):
    """A block that writes in place into a tensor it made (through a view of it) is stamped; one
    that writes into a tensor it was given (which the caller holds: a tally every block adds to, or
    its input, which its trace beside the step could not even write: a leaf that requires grad
    there) is traced by itself; the plans are those of every block traced (the writes
    functionalized with the step)."""

    torch.manual_seed(0)
    own = _Stack([_Scaling(given=False) for _ in range(3)]).eval()
    given = _Stack([_Scaling(given=True) for _ in range(3)]).eval()
    tallied = _TallyStack([_Tallied(8, 16) for _ in range(3)]).eval()
    sim(2)
    _assert_stamped_and_planned_as_traced(monkeypatch, [(own, {"_Scaling": (3,)}), (given, {}), (tallied, {})])


class _Kept:
    """What a block may return beside its tensors: an object holding one (an intermediate)."""

    def __init__(self, t) -> None:
        self.t = t


class _Returning(_Block):
    def forward(self, x):
        h = self.fc1(x)
        return x + self.fc2(torch.tanh(h)), _Kept(h * 2)


class _ReturningStack(_Stack):
    def forward(self, x):
        x, aux = self.stem(x), 0
        for block in self.blocks:
            x, kept = block(x)
            aux = aux + kept.t.square().mean()
        return x.square().mean() + aux


def test_blocks_returning_an_object_are_traced_one_by_one_and_give_torchs_gradients(sim, monkeypatch):
    """A block that returns an object holding a tensor (not a tensor, not a plain value) is traced
    by itself: one trace's object, handed to every copy, would hold that trace's tensors (the step
    then failed on them). The plan is that of every block traced, and the step's loss and gradients
    are those of plain PyTorch."""
    import vsf

    torch.manual_seed(0)
    model = _ReturningStack([_Returning(8, 16) for _ in range(3)]).eval()
    x = torch.randn(4, 8)
    sim(2)
    _assert_stamped_and_planned_as_traced(monkeypatch, [(model, {})])
    monkeypatch.setattr(vsf.config, "stamp_blocks", True)
    _assert_torchs_loss_and_gradients(model, x)


def test_blocks_stamped_from_two_lines_name_each_its_own_line(sim, monkeypatch):
    """Two blocks of one kind called from two lines of the model: each copy of the shared trace
    (forward and backward) records the stack trace of its own call, as tracing each block does
    (the stamper works a copy's stack trace out once per call site, not once per trace)."""
    import vsf

    sim(2)
    model = _CalledFromTwoLines([_Block(8, 16) for _ in range(2)]).eval()
    stamped, plan = _stamps(model)
    assert stamped["_Block"] == (2,)
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    one_by_one = _stamps(model)[1]
    assert_same_stack_traces(plan, one_by_one)
    traces = [n.stack_trace or "" for n in plan.plan.graph.graph.nodes]
    assert any("self.blocks[0](self.stem(x))" in t for t in traces) and any("self.blocks[1](x)" in t for t in traces)


def test_a_gradient_penalty_traces_its_blocks_one_by_one_and_gives_torchs_second_derivative(sim):
    """Blocks inside nested ``vsf.grad`` transforms (a gradient penalty: the inner gradient's
    backward is differentiated again, which copied ops cannot record) are traced one by one, and
    the jitted step's gradient is torch's double backward on one device."""
    import vsf
    from vsf import P

    torch.manual_seed(0)
    model = _Stack([_Block(8, 16) for _ in range(3)]).eval()
    params = vsf.tree.from_module(model)
    x = torch.randn(4, 8)

    def penalty(p, x):
        g = vsf.grad(lambda q: vsf.tree.apply(model, q, x))(p)
        return sum((v**2).sum() for v in g.values())

    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    first = torch.autograd.grad(
        torch.func.functional_call(model, leaves, (x,)), list(leaves.values()), create_graph=True
    )
    want = torch.autograd.grad(sum((g**2).sum() for g in first), list(leaves.values()))
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    args = (vsf.device_put(params, vsf.NamedSharding(mesh, P())), vsf.device_put(x, vsf.NamedSharding(mesh, P("dp"))))
    jitted = vsf.jit(vsf.grad(penalty))
    assert set(jitted.trace(*args).stamped) == {"detach"}  # (the outer grad's leaves: each kind's detach traced once)
    got = vsf.device_get(jitted(*args))
    for k, w in zip(leaves, want):
        torch.testing.assert_close(got[k], w, rtol=1e-5, atol=1e-6)


def _scaled(x, y, c):
    if c is None:
        return x + y
    return x * (c[0] if isinstance(c, tuple) else c) + y


def test_updates_per_leaf_share_a_trace_only_where_nothing_they_read_differs(sim, monkeypatch):
    """``vsf.jit.trace.per_leaf`` (how vsf.optim runs Adam's update of each leaf) stamps a row from
    another row's trace only where everything its trace read is the same: the tensors' shapes,
    strides and dtypes and the Python numbers it bakes in; a row that differs in one of them
    alone (a number 3.0 for 2.0, float64, transposed strides, a ``None``, the number in a tuple) gets
    its own trace, and a row passing one tensor twice is traced as it is. The graph is that of every
    row traced, and the numbers are eager torch's."""
    import vsf
    from vsf import P
    from vsf.jit.trace import per_leaf

    def step(a, b):
        rows = [(a, b, 2.0), (a + 1, b, 2.0), (a, b, 3.0), (a.double(), b, 2.0), (a.t(), b, 2.0), (a, a, 2.0)]
        rows += [(a, b, None), (b, a, None), (a, b, (2.0,)), (b, a, (2.0,))]
        return per_leaf(_scaled, rows, "scaled")

    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    args = [vsf.device_put(x, vsf.NamedSharding(mesh, P("dp"))) for x in (a, b)]
    assert vsf.jit(step).trace(*args).stamped == {"scaled": (2, 1, 1, 1, 2, 2)}
    stamped = vsf.jit(step).lower(*args)
    for got, want in zip(vsf.device_get(vsf.jit(step)(*args)), step(a, b), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    assert vsf.jit(step).trace(*args).stamped == {}
    one_by_one = vsf.jit(step).lower(*args)
    assert _described(stamped) == _described(one_by_one)
    assert_same_plans(stamped, one_by_one)


def test_input_layouts_worked_out_once_per_layout_are_each_inputs_own(sim):
    """A step's inputs' shardings, worked out once per distinct layout (:func:`vsf.jit.call.layouts`),
    are each input's own (what ``sharding_of`` says of it alone), as :func:`vsf.jit.trace.step_input`
    reads them while the step is traced: leaves sharing placements but not rank, strided and
    partial leaves among plain ones; the outputs that return them keep them."""
    import vsf
    from vsf import P
    from vsf.jit.call import layouts
    from vsf.jit.trace import step_input
    from vsf.sharding.mesh import mesh_of
    from vsf.sharding.named import from_placements, sharding_of

    sim(4, compute=False)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    shapes_specs = [
        ((8, 4), P("dp", "tp")),
        ((8, 4), P("dp", "tp")),
        ((8,), P("dp")),
        ((8, 4), P("dp")),
        ((8, 4), P(("tp", "dp"))),
        ((8, 4), P(None, "tp", unreduced=("dp",))),
        ((8, 4), P(("dp", "tp"))),
    ]
    args = [vsf.device_put(torch.zeros(shape), vsf.NamedSharding(mesh, spec)) for shape, spec in shapes_specs]
    rows = [(mesh_of(a.device_mesh), tuple(a.placements), a.ndim) for a in args]
    got = layouts(rows)
    assert got == [from_placements(*row) for row in rows] == [sharding_of(a) for a in args]
    assert got[0] is got[1] and len({id(s) for s in got}) == len(args) - 1
    seen = []

    def step(*xs):
        seen.extend(step_input(x).sharding for x in xs)
        return xs

    lowered = vsf.jit(step).lower(*args)
    assert seen == [sharding_of(a) for a in args]
    assert lowered.plan.outputs == tuple(tuple(a.placements) for a in args)


def test_dead_code_eliminated_as_fx_eliminates_it():
    """:func:`vsf.jit.graph.eliminate_dead_code` removes what fx's ``eliminate_dead_code`` removes and
    nothing else: a chain of ops nothing reads (last first), not an op that writes in place nor a
    random draw nothing reads, nor any op read; and so in a graph module the graph reads."""
    import copy

    from torch.fx.experimental.proxy_tensor import make_fx

    from vsf.jit.graph import eliminate_dead_code

    def f(x, buf):
        dead = (x * 2).sin().sum()  # noqa: F841 - a dead chain
        torch.rand(3)  # a draw nothing reads: impure
        buf.add_(1)  # a write nothing reads: impure
        return x.cos() + 1

    gm = make_fx(f, tracing_mode="fake", _allow_non_fake_inputs=True)(torch.randn(3), torch.zeros(3))
    inner = make_fx(lambda y: ((y + 1) * 3, y.exp().sum())[0], tracing_mode="fake")(torch.randn(3))
    gm.add_submodule("inner", inner)
    output = next(iter(gm.graph.find_nodes(op="output")))
    with gm.graph.inserting_before(output):
        output.args = ((output.args[0], gm.graph.get_attr("inner")),)  # (the graph reads it)
    for g in (gm.graph, inner.graph):  # ops nothing reads, added after the trace's own elimination
        with g.inserting_before(next(iter(g.find_nodes(op="output")))):
            x = next(iter(g.find_nodes(op="placeholder")))
            g.call_function(aten.neg.default, (g.call_function(aten.mul.Tensor, (x, 2)),))
    want = copy.deepcopy(gm)
    assert want.graph.eliminate_dead_code()
    eliminate_dead_code(gm)
    described = lambda m: [(n.name, n.op, n.target, str(n.args)) for n in m.graph.nodes]  # noqa: E731
    assert described(gm) == described(want) and described(gm.inner) == described(want.inner)
    assert any(n.target == aten.add_.Tensor for n in gm.graph.nodes)
    assert not any(n.target in (aten.neg.default, aten.sin.default) for n in gm.graph.nodes)
    assert not any(n.target in (aten.neg.default, aten.exp.default) for n in gm.inner.graph.nodes)


def test_unplanned_ops_asked_once_per_op_are_those_asked_node_by_node():
    """:func:`vsf.jit.classify.unplanned_ops` asks an op's kind only of ops without DTensor rules:
    it names the ops that classifying every node names (ops without rules on the inputs, not on a
    constant alone, even where a constant's node comes first), and no other."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from vsf.jit import classify

    def f(x, y):
        c = torch.arange(6.0).reshape(2, 3)
        constant = torch.trace(c @ c.t())  # (no rules, but a constant: not asked to be decomposed)
        shifted = torch.zeros_like(x)
        shifted[:, 1:] = x[:, :-1]
        return (
            constant,
            torch.nn.functional.mse_loss(x, y),
            torch.trace(x @ y.t()),  # (no rules)
            torch.renorm(x, 2, 0, 1.0) + shifted,
            x.sin().sum(),
        )

    gm = make_fx(torch.func.functionalize(f), tracing_mode="fake")(torch.randn(2, 3), torch.randn(2, 3))
    constants = classify.constant_nodes(gm.graph)
    node_by_node = {
        n.target
        for n in classify.op_nodes(gm)
        if n.target in classify.UNTRUSTED_STRATEGIES
        or n.target in classify.BATCH_NORM_OPS
        or n.target in classify.VARIANCE_DECOMPOSITIONS
        or (
            _compat.op_schema(n.target) is not None
            and classify.classify(n, constants).kind == "none"
            and not classify._adopt_inplace_strategy(n.target)
        )
    }
    assert classify.unplanned_ops(gm) == node_by_node
    assert {aten.mse_loss.default, aten.trace.default, aten.renorm.default} <= node_by_node
    assert aten.sin.default not in node_by_node


def test_op_decided_once_per_layout_keeps_each_input_as_it_arrives(sim):
    """:func:`vsf.jit.combine.check_with_dtensor` decides an op once per signature, per-axis
    choices and arriving layouts (a model's repeated blocks ask the same): two multiplications of
    one signature, each axis choosing ``Shard(0)`` in and out for both, on values that arrive
    nested differently (a view of ``P(("tp", "dp"))``: dp's shard strided inside tp's; an input
    ``P(("dp", "tp"))``: plain) each run on their input as it arrives and give it so (an
    elementwise op moves nothing): a decision reused across the two layouts would move one."""
    import vsf
    from vsf import P

    sim(4, compute=False)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    a = vsf.device_put(torch.zeros(8, 2, 2), vsf.NamedSharding(mesh, P(("tp", "dp"))))
    y = vsf.device_put(torch.zeros(8, 4), vsf.NamedSharding(mesh, P(("dp", "tp"))))
    plan = vsf.jit(lambda a, y: (a.view(8, 4) * 2, y * 2)).lower(a, y).plan
    nested, plain = tuple(a.placements), tuple(y.placements)  # (the view merges unsplit dims: dim 0 as it was)
    assert nested != plain
    muls = [plan.nodes[n] for n in plan.graph.graph.nodes if n.target is aten.mul.Tensor]
    assert [(m.ins[0], m.outs[0]) for m in muls] == [(nested, nested), (plain, plain)]


def test_decisions_do_not_grow_with_depth(sim, monkeypatch):
    """Every leaf's AdamW update reads the step count and the scalars it is computed from, and
    each one reading them adds to how often they are wanted; the solver reads only whether a
    count is above 0 before and after an op's reads move, so the updates of one parameter kind
    meet one context (:meth:`AxisSolver._wanted`), and a deeper model asks the solver to decide
    nothing more: its added blocks and their updates are decided as the others were."""
    from vsf.jit import solver

    sim(8, compute=False)
    asked: list[int] = []
    choose = solver.AxisSolver._choose
    monkeypatch.setattr(
        solver.AxisSolver, "_choose", lambda self, k, greedy: asked.append(k) or choose(self, k, greedy)
    )
    decided = []
    for layers in (3, 5):
        asked.clear()
        _gpt_plan(layers, (1, 2, 2, 1, 2), optimizer=True)
        decided.append(len(asked))
    assert decided[0] == decided[1]


def test_op_facts_read_once_are_each_overloads_own():
    """:func:`vsf.jit.graph.per_op` works a fact out once per op overload, never per packet: ``aten.slice.Tensor``
    aliases its tensor and ``aten.slice.t`` (a list's slice) does not, asked in either order and again; a target
    that is no op (a Python function: no schema) is asked every time, and nothing of it is kept."""
    from vsf.jit.graph import per_op

    asked = []

    @per_op
    def aliases(op):
        asked.append(op)
        schema = _compat.op_schema(op)
        return bool(schema and schema.returns and schema.returns[0].alias_info is not None)

    ops = [aten.slice.t, aten.slice.Tensor, aten.slice.t, aten.slice.Tensor]
    assert [aliases(op) for op in ops] == [False, True, False, True]
    assert asked == [aten.slice.t, aten.slice.Tensor]

    def python_target(x):
        return x

    assert [aliases(python_target), aliases(python_target)] == [False, False]
    assert asked[2:] == [python_target, python_target]


def test_argument_signature_summarises_each_argument_by_kind():
    """:func:`vsf.jit.graph.signature` (the key of the per-op questions): a tensor argument by its shape,
    strides and dtype, a node of another value by its name, a plain value as it is, any other by its
    ``repr``, nested lists and tuples as tuples, keyword arguments sorted by name; hand-written here."""
    import enum

    from vsf.jit.graph import signature

    class Mode(enum.IntEnum):
        FAST = 1

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 6, device="meta").t()
    n = graph.placeholder("n")
    n.meta["val"] = 3
    args = (x, [2, (x, None)], n, 1.5, True, Mode.FAST, torch.float16, slice(1, 2))
    assert signature(args) == (
        ("T", (6, 4), (1, 6), torch.float32),
        (2, (("T", (6, 4), (1, 6), torch.float32), None)),
        ("N", "n"),
        1.5,
        True,
        Mode.FAST,
        torch.float16,
        "slice(1, 2, None)",
    )
    assert signature({"dtype": torch.bfloat16, "b": [x]}) == (
        ("b", (("T", (6, 4), (1, 6), torch.float32),)),
        ("dtype", torch.bfloat16),
    )
    assert signature({}) == ()


def test_moves_alike_but_from_other_layouts_keep_their_own_collectives(sim):
    """The check finds a move's collectives once per shape, strides, dtype and pair of layouts (repeated
    blocks move alike): of two values of one shape both replicated for the results, a matmul's
    partial sum is all-reduced and a split value gathered, and the step's results are eager's."""
    import vsf
    from vsf import P

    sim(2)
    mesh = vsf.make_mesh((2,), ("tp",))
    x = torch.arange(64.0).reshape(8, 8)
    a = vsf.device_put(x, vsf.NamedSharding(mesh, P(None, "tp")))
    b = vsf.device_put(x + 1, vsf.NamedSharding(mesh, P("tp")))
    c = vsf.device_put(x + 2, vsf.NamedSharding(mesh, P("tp")))
    step = vsf.jit(lambda a, b, c: (a @ b, c * 2), out_shardings=vsf.NamedSharding(mesh, P()))
    moves = {r.value[0].name: [c.kind for c in r.collectives] for r in step.lower(a, b, c).plan.redistributions}
    assert moves == {"mm": ["all_reduce"], "arg2_1": ["all_gather"]}
    out, doubled = step(a, b, c)
    torch.testing.assert_close(vsf.device_get(out), x @ (x + 1))
    torch.testing.assert_close(vsf.device_get(doubled), (x + 2) * 2)


def test_a_move_no_collective_makes_is_refused_after_a_possible_one_to_the_same_layout(sim, monkeypatch):
    """The check asks once per pair of layouts whether a move between them is possible: with a sum
    made impossible to reduce (``reachable`` says so), a matmul's partial sum replicated for the
    result is refused, though a split value was gathered to the same layout before it."""
    import vsf
    from vsf import P
    from vsf.errors import PlanError
    from vsf.jit import combine

    sim(2, compute=False)
    possible = combine.reachable
    monkeypatch.setattr(combine, "reachable", lambda src, dst: Partial() not in src and possible(src, dst))
    mesh = vsf.make_mesh((2,), ("tp",))
    a = vsf.device_put(torch.ones(8, 8), vsf.NamedSharding(mesh, P(None, "tp")))
    b = vsf.device_put(torch.ones(8, 8), vsf.NamedSharding(mesh, P("tp")))
    step = vsf.jit(lambda a, b, c: (c * 2, a @ b), out_shardings=vsf.NamedSharding(mesh, P()))
    with pytest.raises(PlanError, match=r"wants %mm as \(Replicate\(\),\) but it is \(Partial\(sum\),\)"):
        step.lower(a, b, b)


def _solved(monkeypatch, layers: int, shape: tuple[int, ...], runs: bool):
    """The plan of :func:`_gpt_plan`'s AdamW step, its axis solvers once solved, and how often a
    run was placed as an earlier one (``_copy_run``) and left as an earlier one's merges left it
    (``_leave``); ``runs``: False finds no run (every op placed one by one)."""
    from vsf.jit import solver

    solvers, copied = [], collections.Counter()
    with monkeypatch.context() as m:
        solve = solver.AxisSolver.solve
        m.setattr(solver.AxisSolver, "solve", lambda self: solve(self) or solvers.append(self))
        for name in ("_copy_run", "_leave"):
            was = getattr(solver.AxisSolver, name)
            m.setattr(
                solver.AxisSolver, name, lambda self, run, done, w=was, n=name: copied.update([n]) or w(self, run, done)
            )
        if not runs:
            m.setattr(solver, "runs_of", lambda *args: {})
        plan = _gpt_plan(layers, shape, optimizer=True)
    return plan, solvers, copied


@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 2), (2, 2, 2, 2, 2)])
def test_runs_placed_once_leave_each_solver_as_placing_op_by_op(sim, monkeypatch, shape):
    """A repeated block's runs of copied ops (:mod:`vsf.jit.copies`) meeting the state an earlier
    run of their shape met are placed as it was by the greedy pass, passed over by the repairs
    where it changed nothing, and left as its merges left it: each axis solver of a 6-layer GPT's
    AdamW step ends in the state placing every op one by one leaves (every op's strategy, every
    value's placement, its wants' number, and the reads counted of each placement, in their
    order), and the plan is the same."""
    sim(math.prod(shape), compute=False)
    plan, copied, counts = _solved(monkeypatch, 6, shape, runs=True)
    one_by_one_plan, one_by_one, none = _solved(monkeypatch, 6, shape, runs=False)
    assert counts["_copy_run"] > 0 and counts["_leave"] > 0 and any(s.tables.steady for s in copied)
    assert not none and not any(s.tables.steady for s in one_by_one)
    assert [s.axis for s in copied] == [s.axis for s in one_by_one]
    for a, b in zip(copied, one_by_one):
        assert a.choice == b.choice and a.label == b.label and a.wants == b.wants
        assert [list(counted.items()) for counted in a.need] == [list(counted.items()) for counted in b.need]
    assert_same_plans(plan, one_by_one_plan)


def test_leaf_updates_are_cut_into_runs_of_a_blocks_leaves(sim, monkeypatch):
    """Each leaf's AdamW update and its add to the param are copies of one op each
    (:meth:`vsf.jit.stamp.Stamper.apply`); the solver cuts such copies into runs where their
    sequence repeats (:mod:`vsf.jit.copies`): a 6-layer GPT's blocks have 12 leaves each (q/k/v,
    projection, two MLP linears, each a weight and a bias, and two norms' weights and biases),
    its updates run leaf by leaf in the order of their paths, so the blocks' updates make 6 runs
    of 12 ``adam_step`` and 6 runs of 12 ``add`` (the embeddings', the final norm's and the head's,
    one each, make none)."""
    from vsf.jit import solver

    sim(8, compute=False)
    problems = []
    index = solver.Problem.index
    monkeypatch.setattr(solver.Problem, "index", lambda self: index(self) or problems.append(self))
    _gpt_plan(6, (1, 2, 2, 1, 2), optimizer=True)
    problem = problems[0]
    targets = [{str(problem.ops[k].target) for k in range(run.start, run.stop)} for run in problem.runs.values()]
    lengths = [run.stop - run.start for run in problem.runs.values()]
    one_op = collections.Counter((t.pop(), n) for t, n in zip(targets, lengths) if len(t) == 1)
    assert one_op == {("vsf.adam_step.default", 12): 6, ("aten.add.Tensor", 12): 6}


class _Soft(_Block):
    """A :class:`_Block` with a softplus, whose backward (``softplus_backward``) has no strategy."""

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.softplus(self.fc1(x)))


class _SoftStack(_Stack):
    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return torch.nn.functional.mse_loss(x, torch.zeros_like(x))


def test_unplanned_ops_decomposed_where_they_are_plan_as_the_whole_graph_traced_again(sim, monkeypatch):
    """A step whose ops include some without a strategy (each stamped block's ``softplus_backward``,
    the loss's ``mse_loss`` and its backward): each replaced by the pieces of its decomposition,
    traced by itself, gives the graph, plan and stack traces that tracing the whole graph again
    through the decompositions gives; and the rest of the graph keeps its nodes, the stamped
    copies' marks included (the whole graph traced again dropped them: no run of a copy is left
    for the solver to place once, :mod:`vsf.jit.copies`)."""
    import importlib

    from torch.fx.experimental.proxy_tensor import make_fx

    import vsf
    from vsf.jit.copies import COPY

    trace_module = importlib.import_module("vsf.jit.trace")

    def whole_graph_again(gm, unplanned, known=None):
        fakes = _compat.distinct([n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")])
        table = dict(known or {})
        while found := {
            op: d for op in unplanned(gm) if op not in table and (d := _compat.decomposition(op)) is not None
        }:
            table.update(found)
            with torch.fx.traceback.preserve_node_meta():
                gm = make_fx(torch.fx.Interpreter(gm).run, decomposition_table=table, tracing_mode="fake")(*fakes)
        return gm

    torch.manual_seed(0)
    model = _SoftStack([_Soft(8, 16) for _ in range(3)]).eval()
    sim(2)
    stamped, plan = _stamps(model)
    assert stamped["_Soft"] == (3,)
    graph = plan.plan.graph.graph
    assert not any(n.target in (aten.softplus_backward.default, aten.mse_loss.default) for n in graph.nodes)
    marked = {n.meta[COPY] for n in graph.nodes if COPY in n.meta}
    assert len(marked) >= 6  # (each block's forward and backward copy)
    monkeypatch.setattr(trace_module, "decompose", whole_graph_again)
    again = _stamps(model)[1]
    assert not any(COPY in n.meta for n in again.plan.graph.graph.nodes)
    assert_same_plans(plan, again)
    assert_same_stack_traces(plan, again)
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    assert_same_plans(plan, _stamps(model)[1])
