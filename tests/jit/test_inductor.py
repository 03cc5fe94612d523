"""``vsf.jit(backend="inductor")``: each rank's planned program compiled by Inductor. On 2 real
gloo processes (tier 3), and on one GPU with NCCL (tier 4, ``cuda``), a GPT step equals the same step unsharded; under ``vsf.simulate`` and in
checking mode the program runs eagerly after one warning; a program Inductor cannot compile runs
as traced after a warning naming the reason. Inductor compiles are slow on CPU (about a minute of
CPU each for the tiny GPT, less from PyTorch's cache): the FSDP AdamW GPT step (gathers,
reduce-scatters and the donated in-place update, compiled) by default; the Megatron step, the
differentiated block, the zoo's models and the pipeline's stages under ``sweep``."""

import logging
import warnings

import pytest
import torch

import vsf
from toy_models import GPT, GPTConfig, chain_program
from vsf import P, optim
from vsf.jit.runner import inductor_program


@pytest.fixture
def inductor(world, request):
    return world("jit_inductor.py", request.node.get_closest_marker("world").args[1], nproc=2)


def _equals_one_device(ranks, steps=3):
    for r in ranks:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["want_losses"]), rtol=1e-4, atol=0)
        assert r["max_param_err"] < 1e-4
        assert r["plan_count"] == 1
        assert (
            r["buffers_reused"] == [r["leaves"]] * steps
        )  # donation: every new leaf written over the leaf it replaces


@pytest.mark.world("jit_inductor.py", "fsdp_adamw", nproc=2)
@pytest.mark.multiprocess
def test_compiled_fsdp_adamw_step_equals_one_device(inductor):
    _equals_one_device(inductor)
    for r in inductor:
        assert r["compiled_by_inductor"] == [True]
        assert r["wrapper"] == ["python"]  # the C++ wrapper has no shim for the gathers
        assert r["warnings"] == []
        # Adam's update is Inductor's own kernels (fused with the param's), not the eager fused
        # op called once per leaf (vsf::adam_step_ -> aten::_fused_adam_)
        assert r["adam_ops"] == []


@pytest.mark.world("jit_inductor.py", "dp_adamw", nproc=2)
@pytest.mark.multiprocess
def test_compiled_dp_step_with_the_gradients_in_several_buckets_equals_one_device(inductor):
    _equals_one_device(inductor)
    for r in inductor:
        assert r["compiled_by_inductor"] == [True] and r["warnings"] == []
        assert r["wrapper"] == ["cpp"]  # all-reduces only: Inductor's kernels called from C++
        # the token count and the gradients' buckets: 15.6 KB in buckets of 4 KiB, at least three
        (count,) = r["all_reduces"]
        assert count >= 4
        assert r["adam_ops"] == []
        # the first all-reduce is the token count (the labels', the global mean's denominator):
        # issued before the forward's first matmul, waited for where the loss divides by it, so
        # it runs under the whole forward (as many matmuls as the one-device forward's)
        assert r["first_all_reduce"] == [{"before": 0, "under": r["forward_matmuls"]}]
        assert r["forward_matmuls"] > 0


@pytest.mark.world("jit_inductor.py", "fallback", nproc=2)
@pytest.mark.multiprocess
def test_a_program_inductor_cannot_compile_runs_eagerly_with_the_reason(inductor):
    _equals_one_device(inductor)
    for r in inductor:
        assert r["compiled_by_inductor"] == [False] and r["wrapper"] == [None]
        (message,) = r["warnings"]
        assert (
            "NotImplementedError: no lowering for aten.frobnicate" in message and "runs as backend='eager'" in message
        )
        assert "more lines" not in message


@pytest.mark.sweep
@pytest.mark.world("jit_inductor.py", "tp_sgd", nproc=2)
@pytest.mark.multiprocess
def test_compiled_megatron_sgd_step_equals_one_device(inductor):
    _equals_one_device(inductor)
    for r in inductor:
        assert r["compiled_by_inductor"] == [True] and r["warnings"] == []


@pytest.mark.sweep
@pytest.mark.world("jit_inductor.py", "autograd", nproc=2)
@pytest.mark.multiprocess
def test_compiled_shard_map_block_under_torch_autograd_equals_one_device(inductor):
    for r in inductor:
        assert r["compiled_by_inductor"] == [True, True]  # its forward and backward programs
        assert r["max_param_err"] < 1e-5 and r["warnings"] == []


# the zoo (tests/models) on real processes, each rank's program compiled: Hugging Face's Llama
# (rotary tables, RMSNorm, SDPA) on FSDP, and diffusers' UNet (convolutions, GroupNorm, nearest
# upsampling, attention at the lower resolution) on DP; AdamW with params and state donated
ZOO = [("llama", "fsdp"), ("unet", "dp")]


@pytest.mark.sweep
@pytest.mark.multiprocess
@pytest.mark.parametrize("name, layout", ZOO, ids=[f"{n}-{layout}" for n, layout in ZOO])
@pytest.mark.world("zoo_jit.py", "llama", "fsdp", "inductor", nproc=2)
@pytest.mark.world("zoo_jit.py", "unet", "dp", "inductor", nproc=2)
def test_compiled_zoo_model_trains_like_torch_on_one_device(world, name, layout):
    for r in world("zoo_jit.py", name, layout, "inductor", nproc=2):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["want_losses"]), rtol=1e-4, atol=0)
        assert r["not_close"] == [], r[
            "max_param_err"
        ]  # the zoo's tolerances (rtol 1e-5, atol 1e-6) after 3 AdamW steps
        # no warning (none that a program ran eagerly) but the one that the zoo's Llama, which keeps
        # transformers' default use_cache=True, has its layers traced one by one
        assert r["plan_count"] == 1 and r["compiled_by_inductor"]
        assert [w for w in r["warnings"] if "use_cache=False" not in w] == []


@pytest.mark.sweep
@pytest.mark.world("pipeline_gpt.py", "1", "inductor", nproc=2)
@pytest.mark.multiprocess
def test_compiled_pipeline_stages_train_like_one_device(world):
    """pp = 2, 1F1B over torch's schedule: each stage's forward and backward program, the loss's
    and each stage's gradient reduction compiled by Inductor (8 compiles: the sweep; under
    ``vsf.simulate`` they run eagerly, tests/transforms/test_pipeline.py)."""
    for rank, r in enumerate(world("pipeline_gpt.py", "1", "inductor", nproc=2)):
        r = r["1f1b"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["want_losses"]), rtol=1e-4, atol=0)
        assert (
            r["max_param_err"] < 3e-5
        )  # AdamW moves a param whose gradient is ~0 by its rounding (tests/transforms/test_pipeline.py)
        assert r["compiled_by_inductor"] == [True] * (5 if rank else 3), r[
            "compiled_by_inductor"
        ]  # stage forward, backward, reduction; the loss's two
        assert r["warnings"] == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_fsdp_adamw_step_on_one_gpu_with_nccl(tmp_path_factory):
    # one process on one GPU, NCCL: Inductor generates Triton kernels for the program
    from multiproc import launch_once

    ranks = launch_once(tmp_path_factory, "jit_inductor.py", 1, "fsdp_adamw", "cuda")
    _equals_one_device(ranks)
    assert ranks[0]["compiled_by_inductor"] == [True] and ranks[0]["warnings"] == []
    assert ranks[0]["device"] == "cuda"


def _sgd_case():
    model = GPT(GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1))
    params = vsf.tree.from_module(model)
    batch = (torch.randint(0, 32, (8, 8)), torch.randint(0, 32, (8, 8)))
    tx = optim.sgd(0.1)

    def step(p, s, idx, tgt):
        loss, grads = vsf.value_and_grad(lambda q: vsf.tree.apply(model, q, idx, tgt))(p)
        updates, s = tx.update(grads, s, p)
        return optim.apply_updates(p, updates), s, loss

    return params, batch, tx, step


@pytest.mark.parametrize("checked", [False, True])
def test_simulated_program_runs_eagerly_after_one_warning(sim, checked):
    params, batch, tx, step = _sgd_case()
    want, s = params, tx.init(params)
    for _ in range(3):
        want, s, _ = step(want, s, *batch)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    rules = [(r".*(qkv|fc1)\.weight", P("tp")), (r".*(proj|fc2)\.weight", P(None, "tp")), (r".*", P())]
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    s, b = optim.init_sharded(tx, p), vsf.device_put(batch, vsf.NamedSharding(mesh, P("dp")))
    jitted = vsf.jit(step, donate_argnums=(0, 1), backend="inductor")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            p, s, _ = (jitted.check if checked else jitted)(p, s, *b)
    (message,) = [str(w.message) for w in caught if "vsf.jit" in str(w.message)]
    assert ("checking mode" if checked else "simulated ranks") in message and "runs as backend='eager'" in message
    got = vsf.device_get(p)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_inductor_program_calls_the_kernels_from_cpp_on_cpu_with_all_reduces_only(monkeypatch, caplog):
    """The C++ wrapper where it can call every collective on CPU; the Python wrapper for gathers,
    off the CPU, and after a C++ wrapper compile that failed, which the log names."""
    calls = []

    def compile_(gm, inputs, cpp_wrapper=False):
        calls.append(cpp_wrapper)
        if cpp_wrapper and gm is failing:
            raise NotImplementedError("arg type Any is not yet supported by custom_op_wrapper\n(more lines)")
        return gm.forward

    monkeypatch.setattr(vsf._compat, "inductor_compile", compile_)
    c10d, aten = torch.ops._c10d_functional, torch.ops.aten
    reduce, gather = (
        chain_program(aten.sin.default, c10d.all_reduce_.default, c10d.wait_tensor.default),
        chain_program(c10d.all_gather_into_tensor.default, c10d.wait_tensor.default),
    )
    failing = chain_program(aten.cos.default)
    cpu, meta = [torch.ones(2)], [torch.ones(2, device="meta")]
    with caplog.at_level(logging.INFO, logger="vsf.jit"):
        for gm, inputs, want_calls, want in (
            (reduce, cpu, [True], "cpp"),
            (gather, cpu, [False], "python"),
            (reduce, meta, [False], "python"),
            (failing, cpu, [True, False], "python"),
        ):
            calls.clear()
            compiled, wrapper = inductor_program(gm, inputs, "the step")
            assert (calls, wrapper, compiled) == (want_calls, want, gm.forward)
    (record,) = caplog.records
    assert record.getMessage() == (
        "Inductor's C++ wrapper could not compile the step (NotImplementedError: arg type Any is not yet "
        "supported by custom_op_wrapper); its kernels are called from Python"
    )


def test_a_compiled_program_is_read_back_from_pytorchs_cache(tmp_path, monkeypatch):
    """A program compiled before (by this process or, the cache being on disk, an earlier one) is
    read from PyTorch's FX graph cache, not compiled again: compiled on real inputs outside a
    trace, Inductor bypassed that cache ("No shape env"), and each new process compiled the
    benchmark's TP and FSDP steps again (12-18 s)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    gm = torch.fx.symbolic_trace(lambda x: (torch.exp(torch.sin(x)),))  # (a program returns a tuple)
    x = torch.randn(16)
    looked_up = []
    for _ in range(2):
        before = dict(counters["inductor"])
        compiled = vsf._compat.inductor_compile(gm, [x])
        looked_up.append(
            {k: n - before.get(k, 0) for k, n in counters["inductor"].items() if k.startswith("fxgraph_cache")}
        )
        (got,) = compiled(x)
        torch.testing.assert_close(got, x.sin().exp())
    assert [{k: n for k, n in d.items() if n} for d in looked_up] == [
        {"fxgraph_cache_miss": 1},
        {"fxgraph_cache_hit": 1},
    ]


def test_backend_is_checked():
    with pytest.raises(ValueError, match="backend must be one of .*'eager', 'inductor'.*got 'xla'"):
        vsf.jit(lambda x: x, backend="xla")
    assert vsf.jit(lambda x: x).backend == "eager"


def test_backend_is_part_of_the_cache_key(sim):
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    x = vsf.device_put(torch.ones(4), vsf.NamedSharding(mesh, P("dp")))
    keys = [vsf.jit(lambda x: x + 1, backend=b)._prepare((x,), {}).key for b in ("eager", "inductor")]
    assert keys[0] != keys[1] and keys[0][:-1] == keys[1][:-1]
