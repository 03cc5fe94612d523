"""``vsf.remat`` with JAX's policies, and torch's own activation checkpointing, under ``vsf.jit``:
the plan recomputes in the backward what the policy does not save, its estimated peak falls, and
the params after three AdamW steps equal those of the same model trained by plain PyTorch on one
device without any recompute (the oracle)."""

from __future__ import annotations

import collections
import functools
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import vsf
from vsf import P, optim
from vsf.jit.remat import recomputed

STEPS, LR, EPS, WD = 3, 1e-2, 1e-5, 0.01
B, T, D, FF, LAYERS = 8, 32, 16, 32, 3
aten = torch.ops.aten


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"{i}.{k}": torch.randn(*shape, generator=g) / shape[0] ** 0.5
        for i in range(LAYERS)
        for k, shape in (("wq", (D, D)), ("w1", (D, FF)), ("w2", (FF, D)))
    }


def block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Attention without heads (two batched matmuls, one softmax) and an MLP, the attention's
    output and the MLP's hidden value named for the policies."""
    q = x @ p["wq"]
    s = torch.softmax(q @ x.transpose(1, 2) / D**0.5, dim=-1)
    a = vsf.checkpoint_name(s @ x, "attn")
    h = vsf.checkpoint_name(F.gelu(a @ p["w1"]), "hidden")
    return x + h @ p["w2"]


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, layer=block) -> torch.Tensor:
    """``layer`` for every block, or a list of one per block."""
    for i in range(LAYERS):
        x = (layer[i] if isinstance(layer, list) else layer)(
            {k.split(".")[1]: v for k, v in params.items() if k.startswith(f"{i}.")}, x
        )
    return x.square().mean()


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(B, T, D, generator=g) for _ in range(STEPS)]


def _oracle() -> dict[str, torch.Tensor]:
    """Plain PyTorch on one device, no remat: autograd and torch.optim.AdamW."""
    params = {k: v.clone().requires_grad_() for k, v in _params().items()}
    opt = torch.optim.AdamW(params.values(), lr=LR, eps=EPS, weight_decay=WD)
    for x in _batches():
        opt.zero_grad()
        loss_fn(params, x).backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


LAYOUTS = {  # mesh, params' specs, batch spec
    "dp": (((2,), ("dp",)), lambda k: P(), P("dp")),
    "fsdp": (((2,), ("fsdp",)), lambda k: P("fsdp"), P("fsdp")),
    "dp_tp": (
        ((2, 2), ("dp", "tp")),
        lambda k: P(None, "tp") if k.endswith("w1") else P("tp", None) if k.endswith("w2") else P(),
        P("dp"),
    ),
}


def _lowered(sim, layout: str, layer, **jit_kwargs):
    """``layer``'s model's step jitted on ``layout`` (ranks started by ``sim`` the first time),
    its inputs placed, and the step lowered for them."""
    (shape, axes), spec, batch_spec = LAYOUTS[layout]
    if not vsf.runtime.is_simulated():
        sim(2 * len(axes))
    mesh = vsf.make_mesh(shape, axes)
    tx = optim.adamw(LR, eps=EPS, weight_decay=WD)

    def step(params, opt_state, x):
        loss, grads = vsf.value_and_grad(lambda p: loss_fn(p, x, layer))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, loss

    jitted = vsf.jit(step, **jit_kwargs)
    params = vsf.device_put(_params(), {k: vsf.NamedSharding(mesh, spec(k)) for k in _params()})
    state = optim.init_sharded(tx, params)
    batches = [vsf.device_put(x, vsf.NamedSharding(mesh, batch_spec)) for x in _batches()]
    return jitted, params, state, batches, jitted.lower(params, state, batches[0])


def _lower(sim, layout: str, layer, **jit_kwargs):
    """The step of :func:`_lowered`, lowered and not run (a test that reads only its plan)."""
    return _lowered(sim, layout, layer, **jit_kwargs)[-1]


def _train(sim, layout: str, layer, **jit_kwargs):
    """The params after three steps of ``layer``'s model on ``layout``, and the step lowered."""
    jitted, params, state, batches, lowered = _lowered(sim, layout, layer, **jit_kwargs)
    for x in batches:
        params, state, _ = jitted(params, state, x)
    return vsf.device_get(params), lowered


def _assert_close(got, want, atol=1e-6):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=atol, msg=lambda m: f"{k}: {m}")


def _recomputed_ops(lowered) -> collections.Counter:
    return collections.Counter(str(n.target).removeprefix("aten.") for n in recomputed(lowered.plan.graph))


# What each policy leaves to the backward, per block (read off the block by hand): the query
# matmul `mm`, the scores `bmm`, `_softmax`, the attention `bmm` (named "attn"), the MLP's `mm`
# and `gelu` (named "hidden"). The last matmul's result nothing reads in the backward, so no
# policy recomputes it; a saved value's own op is not recomputed.
WORK = ("mm.default", "bmm.default", "_softmax.default", "gelu.default")
POLICIES = {
    "nothing_saveable": (None, {"mm.default": 2, "bmm.default": 2, "_softmax.default": 1, "gelu.default": 1}),
    "everything_saveable": (vsf.remat_policies.everything_saveable, {}),
    "dots_saveable": (vsf.remat_policies.dots_saveable, {"_softmax.default": 1, "gelu.default": 1}),
    "dots_with_no_batch_dims_saveable": (
        vsf.remat_policies.dots_with_no_batch_dims_saveable,
        {"bmm.default": 2, "_softmax.default": 1, "gelu.default": 1},
    ),
    "save_only_these_names": (
        vsf.remat_policies.save_only_these_names("hidden"),
        {"mm.default": 2, "bmm.default": 2, "_softmax.default": 1},
    ),
    "save_any_names_but_these": (
        vsf.remat_policies.save_any_names_but_these("hidden"),
        {"mm.default": 2, "bmm.default": 1, "_softmax.default": 1, "gelu.default": 1},
    ),
}


# (everything_saveable, which recomputes nothing, runs in the sweep)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.sweep) if n == "everything_saveable" else n for n in POLICIES]
)
def test_each_policy_recomputes_what_it_does_not_save_and_trains_like_one_device(sim, name):
    policy, per_block = POLICIES[name]
    got, lowered = _train(sim, "dp", vsf.remat(block, policy=policy))
    _assert_close(got, _oracle())
    counted = collections.Counter({op: n for op, n in _recomputed_ops(lowered).items() if op in WORK})
    assert counted == collections.Counter({op: LAYERS * n for op, n in per_block.items()})


# (fsdp in the sweep: test_fsdp_gathers_a_weight_again_for_the_recompute checks its recompute's gather)
@pytest.mark.parametrize("layout", ["dp", pytest.param("fsdp", marks=pytest.mark.sweep), "dp_tp"])
def test_full_remat_lowers_the_peak_and_trains_like_one_device_without_it(sim, monkeypatch, layout):
    """The recompute runs the forward's ops on the same values: the params equal the plan's without
    remat bit for bit, and one device's within the tolerance both share (dp x tp sums in another
    order, 1.2e-6 off after Adam's steps, remat or not). dp x tp plans at a 4 KiB start-up charge:
    at the CPU default (64 KiB, where an activation between matmuls pays it whole and a bucketed
    weight a sixteenth) these blocks' activations, 8 KiB a rank, weigh less than the charge, and
    the graph with the recompute is planned otherwise than the one without (an MLP input
    all-reduced over tp before its matmul where the other gathers the matmul's weight: both
    within the tolerance, not equal bit for bit)."""
    if layout == "dp_tp":
        monkeypatch.setattr(vsf.config, "collective_latency_bytes", 4096.0)
    got, lowered = _train(sim, layout, vsf.remat(block), reshard_after_forward=layout == "fsdp")
    unrematted, plain = _train(sim, layout, block, reshard_after_forward=layout == "fsdp")
    _assert_close(got, _oracle(), atol=2e-6)
    assert all(torch.equal(got[k], unrematted[k]) for k in got)
    assert not recomputed(plain.plan.graph)
    assert lowered.cost().peak_bytes < plain.cost().peak_bytes
    text = lowered.as_text()
    assert (
        "(recomputed: %" in text
        and f"remat: {sum(_recomputed_ops(lowered).values())} ops recomputed in the backward" in text
    )


def test_fsdp_gathers_a_weight_again_for_the_recompute(sim):
    """With FSDP's reshard after forward, the recomputed query matmul reads its weight gathered
    again in the backward (FSDP2 gathers before the recompute too): the gathered weight is not
    held from the forward; the plan text counts the collectives the recompute runs again."""
    lowered = _lower(sim, "fsdp", vsf.remat(block), reshard_after_forward=True)
    again = recomputed(lowered.plan.graph)
    regathers = [
        r
        for r in lowered.plan.redistributions
        if r.before in again and any(c.kind == "all_gather" for c in r.collectives)
    ]
    gathered = {r.value[0] for r in regathers}
    weights = {n for n in gathered if n.op == "placeholder" or all(a.op == "placeholder" for a in n.all_input_nodes)}
    assert weights, "no weight gathered again for the recompute"
    assert "collectives run again for them" in lowered.as_text()


def test_remat_eagerly_gives_the_gradients_without_it():
    params, x = _params(), _batches()[0]
    for name, (policy, _) in POLICIES.items():
        got = vsf.grad(lambda p: loss_fn(p, x, vsf.remat(block, policy=policy)))(params)
        want = vsf.grad(lambda p: loss_fn(p, x))(params)
        for k in want:
            torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{name} {k}: {m}")


def _torch_checkpointed(p, x):
    return checkpoint(block, p, x, use_reentrant=False)


def _torch_selective(p, x):
    """torchtitan's selective activation checkpointing: torch's own policy saving matmul results."""
    save = lambda ctx, op, *args, **kwargs: (
        CheckpointPolicy.MUST_SAVE if op in (aten.mm.default, aten.bmm.default) else CheckpointPolicy.PREFER_RECOMPUTE
    )  # noqa: E731
    return checkpoint(
        block, p, x, use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, save)
    )


@pytest.mark.parametrize(
    "layer, per_block",
    [
        (_torch_checkpointed, {"mm.default": 2, "bmm.default": 2, "_softmax.default": 1, "gelu.default": 1}),
        (_torch_selective, {"_softmax.default": 1, "gelu.default": 1}),
    ],
    ids=["full", "selective"],
)
def test_torch_checkpointing_recomputes_in_the_plan_and_trains_like_one_device(sim, layer, per_block):
    """torch.utils.checkpoint inside the traced step is honoured as vsf.remat is: the plan
    recomputes what torch's policy does not save (before, torch's selective policy saved
    everything once traced), and its estimated peak falls."""
    got, lowered = _train(sim, "dp", layer)
    _assert_close(got, _oracle())
    counted = collections.Counter({op: n for op, n in _recomputed_ops(lowered).items() if op in WORK})
    assert counted == collections.Counter({op: LAYERS * n for op, n in per_block.items()})
    plain = _lower(sim, "dp", block)
    assert lowered.cost().peak_bytes < plain.cost().peak_bytes


def _peaks_recomputing_the_first(sim) -> list[int]:
    """The estimated peak of the model with its first ``m`` blocks (and only those) written with
    ``vsf.remat``, for ``m`` from 0 to every block: the oracle of what a budget should choose."""
    return [
        _lower(sim, "dp", [vsf.remat(block)] * m + [block] * (LAYERS - m)).cost().peak_bytes for m in range(LAYERS + 1)
    ]


def _said(lowered, budget: int) -> re.Match:
    said = re.search(
        rf"memory_budget {budget:,} B: recomputes (no block|every block|blocks? 0(?:-(\d+))?) of {LAYERS} in the backward, \d+ ops "
        rf"\(estimated peak ~([\d,]+) B, (fits|does NOT fit the budget); ~([\d,]+) B with every block, ~([\d,]+) B with none",
        lowered.as_text(),
    )
    assert said is not None, lowered.as_text()
    return said


def _recomputed_blocks(lowered) -> int:
    """How many blocks the plan recomputes: its recomputed matmuls over the two of one block."""
    matmuls = _recomputed_ops(lowered)["mm.default"]
    assert matmuls % 2 == 0, matmuls
    return matmuls // 2


def test_memory_budget_recomputes_the_fewest_blocks_that_fit(sim):
    """Budget by budget, the plan recomputes the forward's first ``m`` blocks for the least ``m``
    whose peak (read off the same model with only those blocks written with ``vsf.remat``) fits:
    between the peaks with every block and with none, some but not all blocks; it fits, says
    so, and the first budget's step (which recomputes one block of three) trains like one device
    without remat (every block recomputed trains so in the test below)."""
    peaks = _peaks_recomputing_the_first(sim)
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[1] > peaks[-1], peaks
    budgets = sorted({(peaks[m] + peaks[m + 1]) // 2 for m in range(LAYERS)} | {peaks[1]}, reverse=True)
    for budget in budgets:
        chosen = next(m for m, peak in enumerate(peaks) if peak <= budget)
        if budget == budgets[0]:
            got, lowered = _train(sim, "dp", vsf.remat(block), memory_budget=budget)
            _assert_close(got, _oracle())
        else:
            lowered = _lower(sim, "dp", vsf.remat(block), memory_budget=budget)
        assert _recomputed_blocks(lowered) == chosen, (budget, peaks)
        assert lowered.cost().peak_bytes == peaks[chosen] <= budget
        said = _said(lowered, budget)
        assert said.group(1) == (
            "block 0" if chosen == 1 else f"blocks 0-{chosen - 1}" if 1 < chosen < LAYERS else "every block"
        )
        assert said.group(4) == "fits" and [int(said.group(i).replace(",", "")) for i in (3, 5, 6)] == [
            peaks[chosen],
            peaks[-1],
            peaks[0],
        ]


def test_memory_budget_above_the_peak_without_remat_recomputes_nothing(sim):
    without = _lower(sim, "dp", block)
    budget = without.cost().peak_bytes
    got, lowered = _train(sim, "dp", vsf.remat(block), memory_budget=budget)
    _assert_close(got, _oracle())
    assert not recomputed(lowered.plan.graph) and lowered.cost().peak_bytes == budget
    said = _said(lowered, budget)
    assert said.group(1) == "no block" and said.group(4) == "fits"


def test_memory_budget_below_the_peak_with_every_block_recomputes_all_and_says_it_does_not_fit(sim):
    full = _lower(sim, "dp", vsf.remat(block))
    budget = full.cost().peak_bytes - 1
    got, lowered = _train(sim, "dp", vsf.remat(block), memory_budget=budget)
    _assert_close(got, _oracle())
    assert _recomputed_blocks(lowered) == LAYERS and lowered.cost().peak_bytes == budget + 1
    said = _said(lowered, budget)
    assert said.group(1) == "every block" and said.group(4) == "does NOT fit the budget"


@pytest.mark.world("jit_memory.py", nproc=2)
def test_the_estimated_peak_is_the_measured_one_on_real_processes(world):
    """``Lowered.cost().peak_bytes`` (less the inputs, in use before the step) is within 10% of
    the peak of heap bytes one step takes on each of 2 gloo processes (a 2-layer GPT, FSDP,
    AdamW donated), without remat and with every block checkpointed; the checkpointed step
    recomputes, peaks lower, and its params after three steps are one device's without remat."""
    reports = world("jit_memory.py", nproc=2)
    for rank, r in enumerate(reports):
        for case in ("plain", "remat"):
            est, measured = r[case]["estimated"], r[case]["measured"]
            assert abs(est / measured - 1) <= 0.10, (
                f"rank {rank}, {case}: estimated {est:,} B, measured {measured:,} B ({est / measured:.3f}x)"
            )
        assert r["remat"]["recomputed"] > r["plain"]["recomputed"]
        assert r["remat"]["measured"] < r["plain"]["measured"]
        assert r["plain"]["unlike_one_device"] is None and r["remat"]["unlike_one_device"] is None, (
            r["plain"]["unlike_one_device"],
            r["remat"]["unlike_one_device"],
        )
