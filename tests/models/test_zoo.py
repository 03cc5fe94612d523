"""The conformance zoo: models no one here wrote (Hugging Face ``transformers`` families from tiny
random configs, default attention and ``use_cache``), each trained a few steps through
``vsf.jit`` (``value_and_grad`` + ``adamw`` + ``apply_updates``) on simulated ranks in every layout,
and two of them on 4 real gloo processes (dp x tp), against the same model trained by plain
PyTorch (``torch.optim.AdamW``) on one device."""

from __future__ import annotations

import functools

import pytest
import torch
import zoo

import vsf
from vsf import P, optim

pytestmark = pytest.mark.models

# layout: (mesh shape, axis names, params' layout, batch spec)
LAYOUTS = {
    "dp": ((2,), ("dp",), "replicated", P("dp")),
    "fsdp": ((2,), ("fsdp",), "fsdp", P("fsdp")),
    "tp": ((2,), ("tp",), "tp", P()),
    "dp_tp": ((2, 2), ("dp", "tp"), "tp", P("dp")),
    "5d": ((1, 1, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"), "fsdp_tp", P(("dp", "fsdp"))),
}
CORE = ["gpt2", "llama", "bert", "t5", "mixtral"]
EXTRA = ["mistral", "qwen2", "gemma", "phi", "gpt_neox"]  # other families, on two layouts
CASES = [(f, l) for f in CORE for l in LAYOUTS] + [(f, l) for f in EXTRA for l in ("dp", "dp_tp")]


@functools.cache
def _families() -> dict[str, zoo.Family]:
    return zoo.families()


@functools.cache
def _oracle(name: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    return zoo.torch_run(_families()[name])


def _specs(params: dict[str, torch.Tensor], kind: str, family: zoo.Family) -> dict[str, P]:
    if kind == "replicated":
        return {k: P() for k in params}
    if kind == "fsdp":
        return {k: P("fsdp") if v.shape[0] % 2 == 0 else P() for k, v in params.items()}
    tp = vsf.sharding.match(params, list(family.tp_rules))
    return tp if kind == "tp" else {k: _with_fsdp(tp[k], params[k].shape) for k in params}


def _with_fsdp(spec: P, shape: torch.Size) -> P:
    """``spec`` with ``fsdp`` on the first dim that it leaves whole and that divides."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    free = next((d for d, e in enumerate(entries) if e is None and shape[d] % 2 == 0), None)
    if free is not None:
        entries[free] = "fsdp"
    return P(*entries)


@pytest.mark.parametrize("name, layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_trains_like_torch_on_one_device(sim, name, layout):
    family = _families()[name]
    want_losses, want_params = _oracle(name)
    model, batches = zoo.built(family)
    params = vsf.tree.from_module(model)
    tx = zoo.adamw()
    shape, axes, kind, batch_spec = LAYOUTS[layout]
    sim(int(torch.tensor(shape).prod()))
    mesh = vsf.make_mesh(shape, axes)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, _specs(params, kind, family)))
    s = optim.init_sharded(tx, p)
    step = vsf.jit(zoo.train_step(model, tx))
    losses = []
    for batch in batches:
        p, s, loss = step(p, s, vsf.device_put(batch, vsf.NamedSharding(mesh, batch_spec)))
        losses.append(vsf.device_get(loss))
    assert step.plan_count == 1
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-4, atol=0)
    got = vsf.device_get(p)
    assert got.keys() == want_params.keys()
    for k, want in want_params.items():
        torch.testing.assert_close(got[k], want, rtol=zoo.PARAMS_RTOL, atol=zoo.PARAMS_ATOL, msg=lambda m: f"{name} {layout} {k}: {m}")


REAL = ["llama", "bert"]   # rotary tables; position and token-type buffers, padding masks


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", REAL)
@pytest.mark.world("zoo_jit.py", "llama")
@pytest.mark.world("zoo_jit.py", "bert")
def test_trains_like_torch_on_one_device_on_real_processes(world, name):
    """The traced local program a real run executes (tests/workers/zoo_jit.py: dp x tp on 4 gloo
    processes, Megatron rules) with each model's buffers and constants in it: a model whose code
    reads a buffer (Llama's rotary frequencies) could not be traced before."""
    for r in world("zoo_jit.py", name):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["want_losses"]), rtol=1e-4, atol=0)
        assert r["plan_count"] == 1
        assert r["not_close"] == [], r["max_param_err"]
