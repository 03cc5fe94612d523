"""A third-party model's repeated blocks traced once and stamped out (:mod:`vsf.jit.stamp`):
Hugging Face Llama's decoder layers (``use_cache=False``: with a cache, each layer writes its keys
and values into a ``DynamicCache`` it is passed, and is traced by itself) plan as every layer
traced, and the stamped step trains as plain PyTorch does on one device."""

from __future__ import annotations

import functools
import importlib
import math
import warnings

import pytest
import zoo
from plan_checks import assert_same_plans, assert_same_stack_traces

import vsf

pytestmark = pytest.mark.models

trace_module = importlib.import_module("vsf.jit.trace")
stamp_module = importlib.import_module("vsf.jit.stamp")


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_llama_layers_traced_once_plan_as_traced_one_by_one(sim, monkeypatch, checkpointed):
    """A 3-layer Llama's AdamW step: its layers stamped from one trace and their ops decided once
    per context (an axis posed the same problem again not solved again: ``AxisSolver.reuse``),
    the graph and plan of every layer traced, every op costed anew and every sweep solved, each op
    naming the same user lines; with Hugging Face's activation checkpointing too (inside each
    layer's forward: the trace of a layer recomputes it in its backward)."""
    solver = importlib.import_module("vsf.jit.solver")
    family = zoo.llama(3, use_cache=False, checkpointed=checkpointed)
    sim(math.prod(zoo.LAYOUTS["5d"][0]), compute=False)
    stamped, plan = zoo.lowered(family)
    assert stamped["LlamaDecoderLayer"] == (3,) and set(stamped) == {"LlamaDecoderLayer", "adam_step", "detach", "add"}
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    monkeypatch.setattr(solver.AxisSolver, "reuse", False)
    plain, one_by_one = zoo.lowered(family)
    assert plain == {}
    assert_same_plans(plan, one_by_one)
    assert_same_stack_traces(plan, one_by_one)


@pytest.mark.sweep
def test_llama_on_axes_nothing_shards_plans_as_every_axis_solved(sim, monkeypatch):
    """pp and cp of size 2, which nothing in the Llama's 5D layout shards anything over, are
    replicated without being solved; every axis solved (``AxisSolver.reuse`` off) gives the same
    plan: the solve too replicates this model on them."""
    solver = importlib.import_module("vsf.jit.solver")
    solved = []
    solve = solver.AxisSolver.solve
    monkeypatch.setattr(solver.AxisSolver, "solve", lambda self: solved.append(self.axis) or solve(self))
    family = zoo.llama(2, use_cache=False)
    shape = (2, 1, 2, 2, 2)
    sim(math.prod(shape), compute=False)
    _, skipped = zoo.lowered(family, shape=shape)
    assert {"pp", "cp"}.isdisjoint(solved)
    monkeypatch.setattr(solver.AxisSolver, "reuse", False)
    solved.clear()
    _, every_axis = zoo.lowered(family, shape=shape)
    assert {"pp", "cp"} <= set(solved)
    assert_same_plans(skipped, every_axis)


def test_stamped_llama_trains_as_one_device(sim, monkeypatch):
    """Three AdamW steps of a stamped 2-layer Llama on the 5D layout (its layers and each leaf's
    Adam update stamped): every loss and param as ``torch.optim.AdamW`` on one device gives them."""
    stampers = []

    class Seen(trace_module.Stamper):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            stampers.append(self)

    monkeypatch.setattr(trace_module, "Stamper", Seen)
    family = zoo.llama(2, use_cache=False)
    losses, params, _ = zoo.jit_train(family, "5d", sim)
    assert [s.stamped["LlamaDecoderLayer"] for s in stampers] == [[2]]
    assert [sum(s.stamped["adam_step"]) for s in stampers] == [len(vsf.tree.leaves(params))]  # every leaf's update
    assert [sum(s.stamped["detach"]) for s in stampers] == [len(vsf.tree.leaves(params))]  # every leaf, differentiated
    zoo.assert_like_oracle("stamped llama", losses, params, zoo.torch_run(family))


@pytest.mark.parametrize("use_cache", [True, False])
def test_layers_given_a_cache_are_traced_one_by_one_and_the_warning_says_how_to_stamp_them(sim, use_cache):
    """With transformers' default ``use_cache`` each Llama layer is passed a ``DynamicCache`` to
    write its keys into, which no shared trace can stand for: every layer is traced by itself, and
    the trace warns once, at the user's line, naming the block, the cache's type and the fix
    (``use_cache=False``), which stamps the layers and warns nothing."""
    family = zoo.llama(2, use_cache=use_cache)
    model, batches = zoo.built(family)
    sim(2, compute=False)
    mesh = vsf.make_mesh((2,), ("dp",))
    params = vsf.device_put(vsf.tree.from_module(model), vsf.NamedSharding(mesh, vsf.P()))
    batch = vsf.device_put(batches[0], vsf.NamedSharding(mesh, vsf.P("dp")))
    step = vsf.jit(
        lambda p, b: vsf.value_and_grad(lambda p: family.loss(functools.partial(vsf.tree.apply, model, p), b))(p)
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        stamped = step.trace(params, batch).stamped
    ours = [w for w in seen if "traced by itself" in str(w.message)]
    if use_cache:
        assert "LlamaDecoderLayer" not in stamped
        assert [str(w.message) for w in ours] == [stamp_module.unstamped_warning("LlamaDecoderLayer", "DynamicCache")]
        assert "use_cache=False" in str(ours[0].message) and ours[0].filename == __file__
    else:
        assert stamped["LlamaDecoderLayer"] == (2,) and ours == []


@pytest.mark.parametrize(
    "name, layout",
    [
        pytest.param(name, layout, marks=() if layout == "5d" and name in ("gpt2", "bert") else pytest.mark.sweep)
        for name in ("gpt2", "bert", "llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox")
        for layout in ("5d", "dp_tp", "fsdp")
    ],
)
def test_runs_of_four_layers_placed_once_plan_as_placed_op_by_op(sim, monkeypatch, name, layout):
    """Four layers of a transformers model (GPT-2's, BERT's; in the sweep also Llama's, Mistral's,
    Qwen2's, Gemma's, Phi's and GPT-NeoX's, and on dp x tp and FSDP too; without a cache, so that
    they are stamped): the runs of ops their copies made, placed once and copied to the runs that
    meet the same state (:mod:`vsf.jit.copies`), some were, and the plan is the one every op placed
    one by one gives."""
    monkeypatch.setattr(zoo, "LAYERS", 4)
    sim(math.prod(zoo.LAYOUTS[layout][0]), compute=False)
    family = zoo.uncached(zoo.families()[name])
    copied, plan, one_by_one = zoo.copied_and_one_by_one(monkeypatch, family, layout)
    assert copied > 0
    assert_same_plans(plan, one_by_one)
