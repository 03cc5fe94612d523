"""Tier 3 worker: the estimated peak of a jitted train step (``Lowered.cost().peak_bytes`` less
the inputs, in use before the step) against the peak of heap bytes one step takes on this real
gloo process (``tests/heap.py``), for a 2-layer GPT with FSDP params (``P("dp")`` on dim 0,
gathered again in the backward), AdamW donated: without remat, and with every block wrapped in
torch's activation checkpointing; and whether each step's params after three steps are those of
plain PyTorch on one device without remat."""

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vsf  # noqa: E402
from heap import peak_heap_bytes  # noqa: E402
from toy_models import GPT, GPTConfig  # noqa: E402
from vsf import P, optim  # noqa: E402
from vsf.jit.cost import local_bytes  # noqa: E402
from vsf.jit.graph import placeholders_of  # noqa: E402
from vsf.jit.remat import recomputed  # noqa: E402

CFG = GPTConfig(
    vocab=512, seq=128, dim=128, heads=4, layers=2, fused_qkv=False, qkv_bias=False
)  # (a key bias gets an exactly-zero gradient: Adam steps it by noise)
LR, STEPS = 1e-3, 3


def model(remat: bool) -> GPT:
    torch.manual_seed(0)
    m = GPT(CFG)
    with (
        torch.no_grad()
    ):  # GPT-2's init: torch's N(0, 1) embedding makes most loss gradients subnormal, which Adam amplifies
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    if remat:
        for i, block in enumerate(m.blocks):
            m.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    return m


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG.vocab, (16, CFG.seq), generator=g)
    return idx, idx.roll(1, 1)


def run(remat: bool) -> dict:
    mesh = vsf.make_mesh((int(os.environ["WORLD_SIZE"]),), ("dp",))
    m = model(remat)
    params = vsf.tree.from_module(m)
    params = vsf.device_put(
        params, {k: vsf.NamedSharding(mesh, P("dp") if v.shape[0] % mesh.size == 0 else P()) for k, v in params.items()}
    )
    tx = optim.adamw(LR)
    state = optim.init_sharded(tx, params)
    idx, tgt = vsf.device_put(batch(), vsf.NamedSharding(mesh, P("dp")))

    @vsf.jit(donate_argnums=(0, 1), reshard_after_forward=True)
    def step(params, opt_state, idx, tgt):
        loss, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(m, p, idx, tgt))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    lowered = step.lower(params, state, idx, tgt)
    plan = lowered.plan
    inputs = sum(local_bytes(plan.mesh, ph.meta["val"], pl) for ph, pl in zip(placeholders_of(plan.graph), plan.inputs))
    held = {"p": params, "s": state}

    def one() -> None:
        held["p"], held["s"], loss = step(held["p"], held["s"], idx, tgt)
        vsf.device_get(loss)

    one()
    one()  # (the first call traces the program; the second runs it as every later call does)
    measured = peak_heap_bytes(one)
    return {
        "estimated": lowered.cost().peak_bytes - inputs,
        "measured": measured,
        "recomputed": len(recomputed(plan.graph)),
        "unlike_one_device": unlike(vsf.device_get(held["p"]), oracle(STEPS)),
    }


def oracle(steps: int) -> dict[str, torch.Tensor]:
    """The params after ``steps`` steps of plain PyTorch on one device, no remat: autograd and
    ``torch.optim.AdamW`` (whose defaults are ``optim.adamw``'s) on the whole batch."""
    m = model(remat=False)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        m(*batch()).backward()
        opt.step()
    return {k: v.detach() for k, v in m.named_parameters()}


def unlike(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> str | None:
    """Why ``got`` is not ``want`` within float tolerance (``None`` if it is): 3% of the learning
    rate, as the other AdamW comparisons (Adam divides a gradient's float noise by its own size:
    a near-zero gradient's element moves by up to 1.5e-5 here); a checkpointed block's params are
    named as the plain block's."""
    got = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in got.items()}
    try:
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=0.03 * LR, msg=lambda msg, k=k: f"{k}: {msg}")
    except AssertionError as e:
        return str(e)
    return None


if __name__ == "__main__":
    report = {"plain": run(False), "remat": run(True)}
    (Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))
