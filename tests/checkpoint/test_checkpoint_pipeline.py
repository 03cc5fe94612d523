"""Checkpoints of a pipelined GPT (``vsf.pipeline``): each stage's leaves saved once, with their
global shapes, from the ranks of the stage holding them; loaded onto a plain mesh and back,
bit-exact; wrong targets named by key path.

Simulated tests run in this process; the real-process ones check what 4 gloo ranks (pp=2 x dp=2,
``workers/pipeline_ckpt.py``, launched once) reported. The oracle of every loaded value is the
value saved (``torch.equal`` after ``vsf.device_get``), and of every shape the one-device model's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import vsf
from vsf import P, optim

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, GPTConfig, batch_at, pipeline_stages  # noqa: E402

CFG = GPTConfig(vocab=16, seq=8, dim=16, heads=2, layers=2, period=4)
TX = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-3, weight_decay=0.1))


def _params():
    torch.manual_seed(0)
    return vsf.tree.from_module(GPT(CFG))


def _whole(state):
    return {vsf.tree.keystr(k): vsf.device_get(v) for k, v in vsf.tree.leaves_with_path(state)}


def _pipeline(model, mesh):
    fns, loss_fn, prefixes = pipeline_stages(model, 2)
    return vsf.pipeline.Pipeline(
        fns, loss_fn, prefixes, mesh=mesh, microbatches=2, schedule="1f1b", batch=P("dp"), tied=("wte.weight",)
    )


def test_simulated_pp2_checkpoint_loads_onto_one_mesh_and_back_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = GPT(CFG)
    params = vsf.tree.from_module(model)
    specs = {k: P("dp") for k in params}
    with vsf.simulate(4):
        pipe = _pipeline(model, vsf.make_mesh((2, 2), ("pp", "dp")))

        def init_pp():
            p, _ = pipe.place(params, specs)
            return {"params": p, "opt": optim.init_sharded(TX, p, zero_axes=("dp",))}

        state = init_pp()
        layout = pipe.layout(params, specs)
        loss, grads = pipe.value_and_grad(state["params"], *batch_at(0, 4, CFG), layout=layout)
        updates, state["opt"] = TX.update(grads, state["opt"], state["params"])
        state["params"] = optim.apply_updates(state["params"], updates)
        want = _whole(state)
        vsf.checkpoint.save(tmp_path / "pp2", state)

        flat = vsf.make_mesh((2, 2), ("dp", "tp"))

        def init_flat():
            p = vsf.device_put(params, vsf.NamedSharding.tree(flat, {k: P("tp") for k in params}))
            return {"params": p, "opt": optim.init_sharded(TX, p, zero_axes=("dp",))}

        one = vsf.checkpoint.load(tmp_path / "pp2", vsf.eval_shape(init_flat))
        got = _whole(one)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert {vsf.sharding.named.sharding_of(x).mesh.size for x in vsf.tree.leaves(one)} == {4}

        vsf.checkpoint.save(tmp_path / "flat", vsf.tree.map(lambda x: x + 1, one))
        back = vsf.checkpoint.load(tmp_path / "flat", vsf.eval_shape(init_pp))
        got = _whole(back)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k] + 1) for k in want)
        # each leaf back on its stage's ranks
        assert vsf.sharding.named.sharding_of(back["params"]["lnf.weight"]).mesh.devices == (2, 3)
        assert vsf.sharding.named.sharding_of(back["opt"][1].mu["wpe.weight"]).mesh.devices == (0, 1)


def test_simulated_none_in_a_target_everywhere_names_the_leaf(tmp_path):
    params = _params()
    vsf.checkpoint.save(tmp_path / "c", params)
    target = {k: (None if k == "lnf.weight" else vsf.ShapeDtypeStruct.like(v)) for k, v in params.items()}
    with pytest.raises(ValueError, match=r"None at lnf\.weight on every rank.*held by another rank"):
        vsf.checkpoint.load(tmp_path / "c", target)


@pytest.fixture(scope="module")
def ranks(world):
    return world("pipeline_ckpt.py")


@pytest.mark.world("pipeline_ckpt.py")
@pytest.mark.multiprocess
def test_each_leaf_is_saved_once_with_its_global_shape_on_its_stage(ranks):
    shapes = {k: list(v.shape) for k, v in _params().items()}
    saved = ranks[0]["saved"]
    held = set(ranks[0]["held"]) | set(ranks[2]["held"])
    assert set(saved) == held and len(saved) == 46  # 15 params, their 2 x 15 Adam moments, the step count
    assert {k[len("params.") :]: v[0] for k, v in saved.items() if k.startswith("params.")} == shapes
    # Adam's step count is held by every rank, on the first stage's mesh (vsf.optim.init_sharded)
    count = "['opt'][1].count"
    stage0, stage1 = set(ranks[0]["held"]), set(ranks[2]["held"]) - {count}
    assert all(saved[k][1] == [0, 1] for k in stage0) and all(saved[k][1] == [2, 3] for k in stage1)
    assert ranks[0]["held"] == ranks[1]["held"] and ranks[2]["held"] == ranks[3]["held"] and stage0 & stage1 == set()
    assert "params.lnf.weight" in stage1 and "params.wte.weight" in stage0 and "params.wte.weight" not in stage1


@pytest.mark.world("pipeline_ckpt.py")
@pytest.mark.multiprocess
def test_pp2_loads_onto_a_plain_mesh_bit_exact(ranks):
    for r in ranks:
        assert r["pp2_to_flat"] == [] and r["flat_meshes"] == ["{'dp': 4}"]


@pytest.mark.world("pipeline_ckpt.py")
@pytest.mark.multiprocess
def test_a_plain_mesh_checkpoint_loads_onto_the_stages_bit_exact(ranks):
    for r in ranks:
        assert r["flat_to_pp2"] == [] and r["flat_to_pp2_held"] == r["held"]
        assert len(r["flat_to_pp2_none_where"]) == 46 - len(r["held"])


@pytest.mark.world("pipeline_ckpt.py")
@pytest.mark.multiprocess
def test_one_step_from_the_loaded_checkpoint_is_the_live_runs_next_step(ranks):
    for r in ranks:
        assert r["resume_loss_equal"] and r["resume_mismatches"] == []


@pytest.mark.world("pipeline_ckpt.py")
@pytest.mark.multiprocess
def test_wrong_targets_name_the_key_path_on_every_rank(ranks):
    for rank, r in enumerate(ranks):
        assert (
            "params.lnf.weight: the checkpoint holds torch.float32 of shape (16,), but the target asks for torch.float32 of shape (17,)"
            in r["wrong_shape"]
        )
        assert rank >= 2 or r["wrong_shape"].startswith("rank 2's target does not fit the checkpoint")
        assert "the checkpoint has a leaf at params.blocks.1.fc2.weight that the target lacks" in r["missing_leaf"]
        assert "None at params.blocks.1.fc1.weight on every rank" in r["none_everywhere"]
