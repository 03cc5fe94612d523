"""Tier 3 worker: GPT train steps under ``vsf.jit(backend="inductor")`` on real processes (each
rank's planned program compiled by Inductor), against the same steps run unsharded in this process.

argv: out_dir, case, device (``cpu``: gloo; ``cuda``: NCCL, one GPU per rank). Cases:

* ``fsdp_adamw``: params split over ``dp`` on dim 0 (FSDP), ``chain(clip, adamw)`` with donated
  params and state (Inductor compiles the Adam update as its math, writing the donated moments
  and params in place);
* ``dp_adamw``: params replicated, the batch over ``dp`` (DDP), AdamW, with buckets of 4 KiB
  (``vsf.config.bucket_bytes``, shrunk to the tiny model): the last layers' gradients are
  all-reduced under the rest of the backward, each bucket waited for where the optimizer reads it;
* ``tp_sgd``: Megatron TP over ``tp`` (column-parallel qkv/fc1, row-parallel proj/fc2), SGD;
* ``autograd``: a jitted Megatron MLP (a ``shard_map`` region) differentiated by torch autograd,
  its forward and backward programs compiled;
* ``fallback``: the SGD step of ``tp_sgd`` where Inductor fails (its compile replaced by one that
  raises): the program runs as ``backend="eager"`` after a warning that gives the reason.
"""

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vsf  # noqa: E402
from toy_models import GPT, GPTConfig  # noqa: E402
from vsf import P, optim  # noqa: E402

out, case = Path(sys.argv[1]), sys.argv[2]
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
MEGATRON = [
    (r".*(qkv|fc1)\.weight", P("tp")),
    (r".*fc1\.bias", P("tp")),
    (r".*(proj|fc2)\.weight", P(None, "tp")),
    (r".*", P()),
]


def runners(jitted):
    """The programs' runners of a jitted function's one plan."""
    (compiled,) = jitted._cache.values()
    return getattr(compiled, "_runners", None) or (compiled._runner,)


def report_of(jitted, caught):
    rs = runners(jitted)
    return {
        "backend": jitted.backend,
        "programs": len(rs),
        "compiled_by_inductor": [r.compiled_by_inductor for r in rs],
        "wrapper": [r.wrapper for r in rs],
        "plan_count": jitted.plan_count,
        "warnings": [str(w.message) for w in caught if "vsf.jit" in str(w.message)],
    }


def gpt_case(tx):
    """``adamw_gpt_case``'s 1-layer GPT, params and batch, its loss, and the train step over ``tx``."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=32, seq=8, dim=16, heads=2, layers=1, qkv_bias=False)
    model = GPT(cfg)
    params = vsf.tree.from_module(model)
    batch = (torch.randint(0, cfg.vocab, (8, cfg.seq)), torch.randint(0, cfg.vocab, (8, cfg.seq)))

    def loss_fn(params, idx, tgt):
        return vsf.tree.apply(model, params, idx, tgt)

    def train_step(params, opt_state, idx, tgt):
        loss, grads = vsf.value_and_grad(lambda p: loss_fn(p, idx, tgt))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    return params, batch, loss_fn, train_step


def train(case):
    """Three steps of ``case`` against three unsharded steps in this process."""
    tx = (
        optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(3e-3, weight_decay=0.1))
        if case == "fsdp_adamw"
        else optim.adamw(3e-3)
        if case == "dp_adamw"
        else optim.sgd(0.1)
    )
    params, batch, loss_fn, train_step = gpt_case(tx)
    want, state, want_losses = params, tx.init(params), []
    for _ in range(3):
        want, state, loss = train_step(want, state, *batch)
        want_losses.append(loss.item())
    if case == "fsdp_adamw":
        mesh = vsf.make_mesh((world,), ("dp",), device_type=device)
        specs = {k: P("dp") if v.shape[0] % world == 0 else P() for k, v in params.items()}
    elif case == "dp_adamw":
        mesh = vsf.make_mesh((world,), ("dp",), device_type=device)
        specs = {k: P() for k in params}
        vsf.config.bucket_bytes = 4 * 2**10
    else:
        mesh = vsf.make_mesh((1, world), ("dp", "tp"), device_type=device)
        specs = vsf.sharding.match(params, MEGATRON)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
    s = optim.init_sharded(tx, p)
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, P("dp")))
    step = vsf.jit(train_step, donate_argnums=(0, 1), backend="inductor")
    losses, reused = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            before = {x.to_local().data_ptr() for x in vsf.tree.leaves((p, s))}
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                p, s, loss = step(p, s, *b)
            reused.append(sum(x.to_local().data_ptr() in before for x in vsf.tree.leaves((p, s))))
            losses.append(vsf.device_get(loss).item())
    got = vsf.device_get(p)
    return {
        **report_of(step, caught),
        "losses": losses,
        "want_losses": want_losses,
        "max_param_err": max((got[k].cpu() - want[k]).abs().max().item() for k in want),
        "leaves": len(vsf.tree.leaves((p, s))),
        "device": vsf.tree.leaves(p)[0].to_local().device.type,
        "buffers_reused": reused,
        "all_reduces": [_count(r.local, "all_reduce") for r in runners(step)],
        "first_all_reduce": [_under_first_all_reduce(r.local) for r in runners(step)],
        "forward_matmuls": _matmuls(list(make_fx(loss_fn)(params, *batch).graph.nodes)),
        # the Adam ops the last step dispatched (the profiler's events): none where Inductor
        # compiled the update as its math, fused into its own kernels
        "adam_ops": sorted({e.key for e in prof.key_averages() if "adam" in e.key}),
    }


_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _matmuls(nodes):
    return sum(n.target in _MATMULS for n in nodes)


def _under_first_all_reduce(gm):
    """The matmuls the traced program ``gm`` runs before its first all-reduce is issued, and
    between that issue and the all-reduce's wait (``None`` without an all-reduce)."""
    nodes = list(gm.graph.nodes)
    issue = next((i for i, n in enumerate(nodes) if n.target is torch.ops._c10d_functional.all_reduce.default), None)
    if issue is None:
        return None
    wait = next(i for i, n in enumerate(nodes) if nodes[issue] in n.all_input_nodes)
    return {"before": _matmuls(nodes[:issue]), "under": _matmuls(nodes[issue:wait])}


def _count(gm, collective):
    """How many ``collective``\\ s the traced program ``gm`` issues."""
    return sum(n.target is getattr(torch.ops._c10d_functional, collective).default for n in gm.graph.nodes)


def autograd():
    """A jitted Megatron MLP (a ``shard_map`` region) in a torch training loop: two SGD steps of
    ``torch.optim``, against the same loop unsharded."""
    torch.manual_seed(1)
    x, w1, w2 = torch.randn(8, 4), torch.randn(4, 8) / 2, torch.randn(8, 4) / 2
    want = [w1.clone().requires_grad_(), w2.clone().requires_grad_()]
    opt = torch.optim.SGD(want, lr=0.1)
    for _ in range(2):
        (torch.relu(x @ want[0]) @ want[1]).square().mean().backward()
        opt.step()
        opt.zero_grad()
    mesh = vsf.make_mesh((world,), ("tp",), device_type=device)
    region = vsf.shard_map(
        lambda x, a, b: vsf.ops.psum(torch.relu(x @ a) @ b, "tp"),
        mesh=mesh,
        in_specs=(P(), P(None, "tp"), P("tp")),
        out_specs=P(),
    )
    block = vsf.jit(region, backend="inductor")
    w = [
        t.requires_grad_()
        for t in vsf.device_put((w1, w2), (vsf.NamedSharding(mesh, P(None, "tp")), vsf.NamedSharding(mesh, P("tp"))))
    ]
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, P()))
    opt = torch.optim.SGD(w, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            block(xs, *w).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return {
        **report_of(block, caught),
        "max_param_err": max((vsf.device_get(a).cpu() - b.detach()).abs().max().item() for a, b in zip(w, want)),
    }


def fallback():
    def refuse(gm, inputs, cpp_wrapper=False):
        raise NotImplementedError("no lowering for aten.frobnicate\n(more lines Inductor prints)")

    compile_, vsf._compat.inductor_compile = vsf._compat.inductor_compile, refuse
    try:
        return train("tp_sgd")
    finally:
        vsf._compat.inductor_compile = compile_  # the next sections of the launch compile


report = {"autograd": autograd, "fallback": fallback}.get(case, lambda: train(case))()
(out / f"rank{rank}.json").write_text(json.dumps(report))
