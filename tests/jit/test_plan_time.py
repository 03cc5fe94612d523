"""Planning time without loss of plan: the shortcuts the planner takes give exactly the answers
of the long way round.

* DTensor's decision for an op with per-mesh-dim rules, asked on the mesh dims some input is not
  replicated on (:func:`vsf._compat.dtensor_decision`), against the question asked of the whole
  mesh (DTensor expanding its rules over every mesh dim): equal on every layout tried.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from vsf import _compat

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
    # op, input shapes, placements each input may take on a mesh dim
    (aten.bmm.default, [(8, 4, 6), (8, 6, 4)], [R, Shard(0), Shard(1), Shard(2), Partial()]),
    (aten.mm.default, [(8, 6), (6, 4)], [R, Shard(0), Shard(1), Partial()]),
    (aten.add.Tensor, [(8, 6), (6,)], [R, Shard(0), Shard(1), Partial()]),
    (aten.mul.Tensor, [(4, 8, 6), (4, 8, 6)], [R, Shard(0), Shard(2), Partial()]),
]


@pytest.mark.parametrize("op, shapes, choices", CASES, ids=[str(c[0]) for c in CASES])
def test_decision_on_split_dims_is_the_whole_mesh_decision(op, shapes, choices):
    mesh = _compat._abstract_grid((2, 2, 2))
    values = [torch.empty(s, device="meta") for s in shapes]
    fast_ones = 0
    for layouts in _layouts(len(values), 3, choices, 24):
        args = tuple(_compat.Placed(v, p) for v, p in zip(values, layouts))

        def ask(fn):
            try:
                return fn(op, args, {}, mesh)
            except Exception as e:  # noqa: BLE001 - a refusal must be the same refusal
                return type(e)

        full = ask(_compat._full_decision)
        assert ask(_compat.dtensor_decision) == full, layouts
        fast_ones += _compat._on_split_dims(op, args, {}, mesh) is not None
    assert fast_ones > 5  # the shortcut was taken, not only the long way


def _gpt_plan(layers: int, shape: tuple[int, ...]):
    """The plan of an SGD step of a ``layers``-layer GPT (separate qkv/proj/fc1/fc2 linears, tp on
    the weights Megatron's way, batch over dp x fsdp) on a planning-only 5D mesh of ``shape``."""
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

    return vsf.jit(step).lower(p, idx, idx)


@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 2), (2, 2, 2, 2, 2)])
def test_blocks_decided_once_plan_as_decided_one_by_one(sim, monkeypatch, shape):
    """The solver decides once per op context and reuses the decision for the repeated blocks'
    ops (``AxisSolver.reuse``); planned with every op costed anew, the plan is the same: every
    op's placements, every redistribution, and the bytes per axis."""
    from vsf.jit import solver

    sim(math.prod(shape), compute=False)
    asked = []
    choose = solver.AxisSolver._choose
    monkeypatch.setattr(
        solver.AxisSolver, "_choose", lambda self, k, greedy: asked.append(k) or choose(self, k, greedy)
    )
    reused = _gpt_plan(4, shape)
    decided = len(asked)
    monkeypatch.setattr(solver.AxisSolver, "reuse", False)
    asked.clear()
    one_by_one = _gpt_plan(4, shape)
    assert decided < len(asked) / 2  # blocks were decided once, not op by op
    a, b = reused.plan, one_by_one.plan
    assert [(p.ins, p.outs) for p in a.nodes.values()] == [(p.ins, p.outs) for p in b.nodes.values()]
    assert [(r.value[0].name, r.src, r.dst) for r in a.redistributions] == [
        (r.value[0].name, r.src, r.dst) for r in b.redistributions
    ]
    assert reused.cost().comm_bytes == one_by_one.cost().comm_bytes
    assert reused.cost().collectives == one_by_one.cost().collectives


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
