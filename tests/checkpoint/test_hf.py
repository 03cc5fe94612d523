"""Hugging Face checkpoints read straight into shards and written back, models built on the meta
device, and models built inside ``vsf.simulate``: a tiny Llama (random weights, built in code)
saved by ``save_pretrained`` in a temporary directory is the oracle, on simulated ranks and on 4
real gloo processes (tier 3, ``tests/workers/data_world.py``)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import vsf
from vsf import P

CONFIG = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
RULES = [
    (r".*(q|k|v|gate|up)_proj\.weight", P("tp", "fsdp")),
    (r".*(o|down)_proj\.weight", P("fsdp", "tp")),
    (r".*embed_tokens\.weight", P("fsdp")),
    (r".*", P()),
]


def _llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The model and its save_pretrained directories: one file, and sharded into several."""
    model, root = _llama(), tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="8KB")
    return model, root


def _target(model: torch.nn.Module, mesh: vsf.Mesh, dtype: torch.dtype | None = None) -> dict:
    shapes = vsf.tree.from_module(model)
    specs = vsf.sharding.match(shapes, RULES)
    return vsf.tree.map(
        lambda t, s: vsf.ShapeDtypeStruct(t.shape, dtype or t.dtype, vsf.NamedSharding(mesh, s)), shapes, specs
    )


def _on_meta(config: transformers.PretrainedConfig) -> transformers.LlamaForCausalLM:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("layout", ["one", "sharded"])
def test_load_reads_a_hugging_face_directory_into_the_target_s_shards(sim, saved, layout):
    model, root = saved
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    target = _target(_on_meta(model.config), mesh)
    params = vsf.checkpoint.load(root / layout, target)
    own = vsf.tree.from_module(model)
    assert sorted(params) == sorted(own)
    got = vsf.device_get(params)
    assert all(torch.equal(got[k], own[k]) for k in own)
    assert vsf.typeof(params["model.layers.0.self_attn.q_proj.weight"]) == "f32[16@tp,16@fsdp]"
    assert vsf.typeof(params["model.embed_tokens.weight"]) == "f32[32@fsdp,16]"
    whole = vsf.checkpoint.load(root / layout)  # no target: every tensor whole, by name
    assert all(torch.equal(whole[k], own[k]) for k in own) and not isinstance(
        whole["lm_head.weight"], torch.distributed.tensor.DTensor
    )


def test_the_target_s_dtype_is_what_comes_back_and_mistakes_are_named(sim, saved):
    model, root = saved
    sim(2)
    mesh = vsf.make_mesh((2, 1), ("fsdp", "tp"))
    target = _target(_on_meta(model.config), mesh, torch.bfloat16)
    got = vsf.device_get(vsf.checkpoint.load(root / "sharded", target))
    assert all(torch.equal(got[k], v.bfloat16()) for k, v in vsf.tree.from_module(model).items())
    target["model.norm.weights"] = target.pop("model.norm.weight")
    with pytest.raises(
        ValueError,
        match=r"the target has a leaf at model.norm.weights that the checkpoint .* lacks \(it holds 12 tensors; similar names: model.norm.weight",
    ):
        vsf.checkpoint.load(root / "one", target)
    with pytest.raises(
        ValueError,
        match=r"lm_head.weight: the checkpoint .* holds shape \(32, 16\) \(F32\), but the target asks for \(16, 32\)",
    ):
        vsf.checkpoint.load(root / "one", {"lm_head.weight": vsf.ShapeDtypeStruct((16, 32), torch.float32)})


@pytest.mark.parametrize("shard_bytes", [2**30, 3000])
def test_save_hf_writes_what_from_pretrained_reads_bit_for_bit(sim, saved, tmp_path, shard_bytes):
    model, root = saved
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("fsdp", "tp"))
    params = vsf.checkpoint.load(root / "one", _target(model, mesh))
    vsf.checkpoint.save_hf(tmp_path / "export", params, config=model.config, max_shard_bytes=shard_bytes)
    files = sorted(p.name for p in (tmp_path / "export").glob("*.safetensors"))
    assert (files == ["model.safetensors"]) == (shard_bytes == 2**30)
    if len(files) > 1:
        index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == files
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(FileExistsError):
        vsf.checkpoint.save_hf(tmp_path / "export", params)


# -- models built on the meta device -------------------------------------------------------------


def test_a_meta_model_s_buffers_are_recomputed_and_it_runs_like_the_model(sim, saved):
    model, root = saved
    empty = _on_meta(model.config)
    assert empty.model.rotary_emb.inv_freq.is_meta
    vsf.checkpoint.materialize_buffers(empty)
    for (name, got), (_, want) in zip(empty.named_buffers(), model.named_buffers()):
        assert torch.equal(got, want), name
    assert all(p.is_meta for p in empty.parameters())  # params stay where they were
    sim(2)
    mesh = vsf.make_mesh((1, 2), ("fsdp", "tp"))
    params = vsf.checkpoint.load(root / "one", _target(empty, mesh))
    ids = torch.randint(0, 32, (4, 8))
    logits = vsf.jit(lambda p, i: vsf.tree.apply(empty, p, i).logits)(
        params, vsf.device_put(ids, vsf.NamedSharding(mesh, P("fsdp")))
    )
    torch.testing.assert_close(vsf.device_get(logits), model(ids).logits.detach(), rtol=1e-5, atol=1e-6)


class Rotary(torch.nn.Module):
    """A plain module with a buffer computed at init and a reset_parameters that recomputes it."""

    def __init__(self, dim: int, base: float = 100.0) -> None:
        super().__init__()
        self.dim, self.base = dim, base
        self.register_buffer("inv_freq", self._freqs(), persistent=False)
        self.scale = torch.nn.Parameter(torch.ones(dim))

    def _freqs(self) -> torch.Tensor:
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(self._freqs())
        torch.nn.init.ones_(self.scale)


class Forgetful(Rotary):
    """Its reset_parameters leaves the buffer as it finds it."""

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.scale)


def test_plain_modules_recompute_through_reset_parameters_or_are_named():
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), Rotary(8))
    vsf.checkpoint.materialize_buffers(net)
    assert torch.equal(net[1].inv_freq, Rotary(8).inv_freq) and net[1].scale.is_meta
    with torch.device("meta"):
        bad = torch.nn.Sequential(torch.nn.Linear(4, 4), Forgetful(8))
    with pytest.raises(
        ValueError,
        match=r"cannot recompute the meta buffer 1.inv_freq of Forgetful \(Forgetful.reset_parameters\(\) left it unset\): "
        r"give Forgetful a reset_parameters\(\) that computes its buffers",
    ):
        vsf.checkpoint.materialize_buffers(bad)


# -- models built inside vsf.simulate ------------------------------------------------------------


@pytest.mark.parametrize("build", ["config", "from_pretrained"])
def test_a_model_built_inside_a_simulation_runs_like_one_built_outside(sim, saved, build):
    model, root = saved
    ids = torch.randint(0, 32, (4, 8))
    sim(2)
    inside = _llama() if build == "config" else transformers.LlamaForCausalLM.from_pretrained(root / "one")
    assert not any(vsf._compat.is_local_tensor(b) for b in inside.buffers())  # per-rank buffers failed with aten.equal
    mesh = vsf.make_mesh((2, 1), ("fsdp", "tp"))
    params = vsf.device_put(vsf.tree.from_module(inside), vsf.NamedSharding(mesh, P()))
    logits = vsf.jit(lambda p, i: vsf.tree.apply(inside, p, i).logits)(
        params, vsf.device_put(ids, vsf.NamedSharding(mesh, P("fsdp")))
    )
    torch.testing.assert_close(vsf.device_get(logits), model(ids).logits.detach(), rtol=1e-5, atol=1e-6)


# -- on 4 real gloo processes (tests/workers/data_world.py) -----------------------------------------


@pytest.fixture(scope="module")
def ranks(world):
    return world("data_world.py")


@pytest.mark.world("data_world.py")
@pytest.mark.multiprocess
def test_each_process_reads_its_slices_of_a_sharded_hf_checkpoint(ranks):
    for got in ranks:
        hf = got["hf"]
        assert len(hf["files"]) > 1 and all(hf["equal"].values()) and len(hf["equal"]) == 12
        assert hf["local_shapes_ok"] and hf["q_proj"] == "f32[16@tp,16@dp]"
        assert hf["logits_err"] < 1e-5


@pytest.mark.world("data_world.py")
@pytest.mark.multiprocess
def test_what_the_processes_export_loads_back_with_from_pretrained(ranks):
    for got in ranks:
        assert got["hf"]["export_files"] > 1 and got["hf"]["export_equal"]
