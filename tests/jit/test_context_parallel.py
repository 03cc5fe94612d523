"""Context parallelism inside vsf.jit: with the tokens' sequence dim sharded over ``cp``, attention
runs on sequence shards (keys and values gathered over ``cp``, queries and the output left split)
and the result's sequence dim stays on ``cp``. Oracle: the same step run unsharded on one device
(fp32); the plan is read from ``step.lower(...)``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from context_parallel_checks import (
    SDPA,
    assert_attention_on_a_ring,
    assert_attention_on_sequence_shards,
    assert_equal_to_one_device,
    attention_plans,
    on_axis,
    reference,
)
from torch.distributed.tensor import Replicate, Shard

import vsf
from vsf import P
from vsf.sharding.named import BalancedPlacement

MESHES = {
    "cp2": ((2,), ("cp",), P(None, "cp")),
    "cp4": ((4,), ("cp",), P(None, "cp")),
    "cp2_tp2": ((2, 2), ("cp", "tp"), P(None, "cp")),
    "dp2_cp2": ((2, 2), ("dp", "cp"), P("dp", "cp")),
}
MEGATRON = [(r"(q|k|v)\.weight", P("tp")), (r"proj\.weight", P(None, "tp")), (r".*", P())]


class SDPABlock(nn.Module):
    """A GPT-like attention block on SDPA, with ``kv_heads`` key/value heads (grouped-query when fewer than ``heads``)."""

    def __init__(self, dim: int = 32, heads: int = 4, kv_heads: int = 4, causal: bool = True) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.causal = heads, kv_heads, dim // heads, causal
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.kv_heads != self.heads)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def _block_case(causal: bool, kv_heads: int, seq: int = 16, batch: int = 4):
    module = SDPABlock(kv_heads=kv_heads, causal=causal)
    params = vsf.tree.from_module(module)
    x, y = torch.randn(batch, seq, 32), torch.randn(batch, seq, 32)

    def loss_fn(p, x, y):
        return ((vsf.tree.apply(module, p, x) - y) ** 2).mean()

    return params, (x, y), loss_fn


def _step(loss_fn):
    def step(params, *batch):
        return vsf.value_and_grad(loss_fn)(params, *batch)

    return step


def _run(sim, layout, params, batch, loss_fn, rules=None):
    """The step jitted on ``layout`` (batch laid out by its spec, params by ``rules``): gathered results and the plan."""
    shape, names, batch_spec = MESHES[layout]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    rules = rules if "tp" in names else [(r".*", P())]
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, vsf.sharding.match(params, rules)))
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, batch_spec))
    jitted = vsf.jit(_step(loss_fn))
    plan = jitted.lower(p, *b).plan
    return vsf.device_get(jitted(p, *b)), plan


def _attention_loss(q, k, v, causal):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return (out * torch.linspace(-1, 1, out.shape[-1])).sum()


def _qkv_case(causal: bool, kv_heads: int, seq: int = 16, heads: int = 4):
    q = torch.randn(4, heads, seq, 8)
    k, v = torch.randn(2, 4, kv_heads, seq, 8).unbind(0)
    return {"q": q, "k": k, "v": v}, (), lambda p: _attention_loss(p["q"], p["k"], p["v"], causal)


QKV_SPECS = {
    "cp2": P(None, None, "cp"),
    "cp4": P(None, None, "cp"),
    "cp2_tp2": P(None, "tp", "cp"),
    "dp2_cp2": P("dp", None, "cp"),
}


def _run_qkv(sim, layout, params, loss_fn):
    """The attention step jitted with q, k and v laid out as ``QKV_SPECS[layout]``."""
    shape, names, _ = MESHES[layout]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    p = vsf.device_put(params, vsf.NamedSharding(mesh, QKV_SPECS[layout]))
    jitted = vsf.jit(_step(loss_fn))
    plan = jitted.lower(p).plan
    return vsf.device_get(jitted(p)), plan


CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])


@CAUSAL
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_attention_on_sequence_shards_equals_one_device(sim, layout, kv_heads, causal):
    params, batch, loss_fn = _qkv_case(causal=causal, kv_heads=kv_heads)
    want = reference(loss_fn, params, batch)
    got, _ = _run_qkv(sim, layout, params, loss_fn)
    assert_equal_to_one_device(got, want)


@CAUSAL
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_grouped_query_attention_gathers_only_keys_and_values_over_cp(sim, layout, causal):
    """With 2 key/value heads for 8 query heads, gathering k and v (and reduce-scattering their
    gradients) sends less than gathering q too. (With as many key/value heads, attention alone
    with nothing else in the step is cheaper in bytes fully gathered, with no gradient to reduce:
    the cost model counts bytes, not the work each rank repeats; in a block it splits, below.)"""
    params, batch, loss_fn = _qkv_case(causal=causal, kv_heads=2, heads=8)
    _, plan = _run_qkv(sim, layout, params, loss_fn)
    assert_attention_on_sequence_shards(plan)


@CAUSAL
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", ["cp2", "cp4", "cp2_tp2"])
def test_an_attention_block_keeps_its_tokens_split_on_cp(sim, layout, kv_heads, causal):
    """A GPT-like block (projections, heads, SDPA) on four sequences, each split on cp: only keys
    and values are gathered (the projections' rows, the sequences merged, keep each sequence's
    split as a strided shard)."""
    params, batch, loss_fn = _block_case(causal=causal, kv_heads=kv_heads, batch=4)
    want = reference(loss_fn, params, batch)
    got, plan = _run(sim, layout, params, batch, loss_fn, MEGATRON)
    assert_equal_to_one_device(got, want)
    assert_attention_on_sequence_shards(plan)


@pytest.mark.parametrize("seq", [10, 6], ids=["uneven", "an-empty-shard"])
def test_causal_attention_on_uneven_sequence_shards_is_gathered_and_equals_one_device(sim, seq):
    """10 positions over 4 ranks are 3, 3, 3, 1 (6: 2, 2, 2, 0): the split is not offered, q is gathered."""
    params, batch, loss_fn = _qkv_case(causal=True, kv_heads=2, heads=8, seq=seq)
    want = reference(loss_fn, params, batch)
    got, plan = _run_qkv(sim, "cp4", params, loss_fn)
    assert_equal_to_one_device(got, want)
    for p in attention_plans(plan)[SDPA]:
        assert on_axis(plan, p.ins[0]) != Shard(2), p.ins


@pytest.mark.parametrize("mode", ["all_gather", "ring"])
def test_causal_attention_with_more_keys_than_queries_equals_one_device(sim, monkeypatch, mode):
    """8 queries over 16 keys (the kernel's causal mask starts at the first key): the blocks are
    the queries', so vsf does not split it; the plan gathers and equals one device."""
    monkeypatch.setattr(vsf.config, "context_parallel", mode)
    q = torch.randn(2, 4, 8, 8)
    k, v = torch.randn(2, 2, 2, 16, 8).unbind(0)
    params, loss_fn = {"q": q, "k": k, "v": v}, lambda p: _attention_loss(p["q"], p["k"], p["v"], True)
    want = reference(loss_fn, params, ())
    got, plan = _run_qkv(sim, "cp2", params, loss_fn)
    assert_equal_to_one_device(got, want)
    for p in attention_plans(plan)[SDPA]:
        assert on_axis(plan, p.ins[0]) != Shard(2), p.ins


def test_dtensor_never_runs_causal_attention_on_query_shards(sim):
    """DTensor is told the query split only for full attention: eager DTensor SDPA on sequence
    shards, causal or not, equals one device (a causal kernel on a later shard would mask from
    that shard's first query)."""
    from torch.distributed.tensor import distribute_tensor

    q, k, v = torch.randn(3, 2, 4, 8, 8).unbind(0)
    sim(2)
    mesh = vsf.make_mesh((2,), ("cp",)).device_mesh
    placed = [distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v)]
    for causal in (False, True):
        got = F.scaled_dot_product_attention(*placed, is_causal=causal).full_tensor()
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(vsf.device_get(got), want, rtol=1e-5, atol=1e-6)


GPT_MEGATRON = [(r".*(qkv|fc1)\.(weight|bias)", P("tp")), (r".*(proj|fc2)\.weight", P(None, "tp")), (r".*", P())]


def _gpt_case(sdpa: bool, batch: int):
    from toy_models import GPT, GPTConfig

    cfg = GPTConfig(vocab=32, seq=16, dim=16, heads=2, layers=2, tied=False, sdpa=sdpa)
    model = GPT(cfg)
    tokens = (torch.randint(0, cfg.vocab, (batch, cfg.seq)), torch.randint(0, cfg.vocab, (batch, cfg.seq)))
    return vsf.tree.from_module(model), tokens, lambda p, idx, tgt: vsf.tree.apply(model, p, idx, tgt)


@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "masked-softmax"])
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_the_toy_gpt_with_tokens_on_cp_equals_one_device(sim, layout, sdpa):
    """The repo's GPT (causal) on two sequences, its tokens ``P(None, "cp")`` (``P("dp", "cp")`` on
    dp x cp). With SDPA the attention runs on sequence shards (the masked softmax is checked for
    its numbers)."""
    params, tokens, loss_fn = _gpt_case(sdpa, 2)
    want = reference(loss_fn, params, tokens)
    got, plan = _run(sim, layout, params, tokens, loss_fn, GPT_MEGATRON)
    assert_equal_to_one_device(got, want)
    if sdpa:
        assert_attention_on_sequence_shards(plan)


@pytest.mark.parametrize("layout", sorted(MESHES))
def test_a_cross_entropy_over_tokens_on_cp_picks_each_ranks_rows_where_they_are(sim, layout):
    """``cross_entropy`` of logits ``[b, t@cp, V]`` viewed as rows ``[b*t, V]``: each rank's rows are
    its own tokens of every sequence (a strided shard over cp), and the log-probabilities of the
    targets are picked there (``gather`` on local rows, some targets ignored): over cp only the
    loss's sums move (no ``[b*t, V]`` gather, which would grow with the vocabulary). The loss and
    its gradient equal one device's, op by op (checking mode)."""
    batch, seq, vocab = 4, 8, 64
    logits, targets = torch.randn(batch, seq, vocab), torch.randint(0, vocab, (batch, seq))
    targets[0, :3] = -100

    def loss_fn(x, t):
        return F.cross_entropy(x.reshape(-1, vocab), t.reshape(-1))

    want_grad, want_loss = torch.func.grad_and_value(loss_fn)(logits, targets)
    shape, names, spec = MESHES[layout]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    x, t = vsf.device_put((logits, targets), vsf.NamedSharding(mesh, spec))
    step = vsf.jit(vsf.value_and_grad(loss_fn))
    loss, grad = step.check(x, t)
    torch.testing.assert_close(vsf.device_get(loss), want_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(vsf.device_get(grad), want_grad, rtol=1e-5, atol=1e-7)
    over_cp = [(c.kind, c.shape) for c in step.lower(x, t).cost().collectives if c.axis == "cp"]
    assert over_cp and all(c == ("all_reduce", ()) for c in over_cp), over_cp


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("balanced", marks=pytest.mark.world("jit_context_parallel.py", "balanced")),
        pytest.param(
            "contiguous", marks=[pytest.mark.world("jit_context_parallel.py", "contiguous"), pytest.mark.sweep]
        ),
    ],
)
def test_the_toy_gpt_on_cp4_real_processes_trains_like_one_device(world, layout):
    """Each process's blocks follow its own rank: 3 SGD steps on 4 gloo processes equal one device,
    keys and values gathered or passed around a ring, the tokens split balanced (each process then
    runs only the causal blocks it sees) or contiguous (the sweep: simulation covers its plans)."""
    placement = str((BalancedPlacement(2),) if layout == "balanced" else (Shard(2),))
    for r in world("jit_context_parallel.py", layout):
        for mode, arg in (("", "query"), ("ring_", "key")):
            torch.testing.assert_close(
                torch.tensor(r[f"{mode}losses"]), torch.tensor(r["want_losses"]), rtol=1e-5, atol=0
            )
            assert r[f"{mode}max_param_err"] < 1e-5
            assert r[f"{mode}{arg}_placements"] == [placement] * 2


# -- ring attention (vsf.config.context_parallel = "ring") ------------------------------------------


@pytest.fixture
def ring(monkeypatch):
    monkeypatch.setattr(vsf.config, "context_parallel", "ring")


@CAUSAL
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_ring_attention_equals_one_device(sim, ring, layout, kv_heads, causal):
    params, batch, loss_fn = _qkv_case(causal=causal, kv_heads=kv_heads)
    want = reference(loss_fn, params, batch)
    got, plan = _run_qkv(sim, layout, params, loss_fn)
    assert_equal_to_one_device(got, want)
    assert_attention_on_a_ring(plan)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_attention_sends_cp_minus_one_blocks_of_keys_and_values(sim, ring, n):
    """Forward, each rank sends n - 1 blocks of k and of v; backward those again and n blocks of
    their gradients; over cp nothing else moves but the loss's reduction."""
    params, batch, loss_fn = _qkv_case(causal=True, kv_heads=2, seq=16)
    sim(n)
    mesh = vsf.make_mesh((n,), ("cp",))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P(None, None, "cp")))
    cost = vsf.jit(_step(loss_fn)).lower(p).cost()
    block = 4 * 2 * (16 // n) * 8 * 4  # [batch, kv heads, seq / n, head dim] fp32
    ring_sends = [c for c in cost.collectives if c.kind == "ppermute"]
    assert [c.bytes for c in ring_sends] == [block] * (2 * (n - 1) + 2 * (n - 1) + 2 * n)
    assert all(c.axis == "cp" for c in ring_sends)
    others = [c for c in cost.collectives if c.kind != "ppermute"]
    assert [(c.kind, c.shape) for c in others] == [("all_reduce", ())]


@pytest.mark.parametrize("mode", ["all_gather", "ring"])
@pytest.mark.parametrize("layout", ["cp2", "cp4"])
def test_the_toy_gpt_on_sequence_shards_passes_checking_mode(sim, monkeypatch, layout, mode):
    """Op by op, each result assembled from the ranks' shards equals the unsharded graph's (the
    causal blocks' merged output and log-sum-exp, and every gradient), and the step equals one device."""
    monkeypatch.setattr(vsf.config, "context_parallel", mode)
    params, tokens, loss_fn = _gpt_case(sdpa=True, batch=2)
    want = reference(loss_fn, params, tokens)
    shape, names, spec = MESHES[layout]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    b = vsf.device_put(tokens, vsf.NamedSharding(mesh, spec))
    jitted = vsf.jit(_step(loss_fn))
    assert_equal_to_one_device(vsf.device_get(jitted.check(p, *b)), want)
    (assert_attention_on_a_ring if mode == "ring" else assert_attention_on_sequence_shards)(jitted.lower(p, *b).plan)


# -- the balanced causal layout (vsf.balanced("cp"): rank i holds chunks i and 2n-1-i) -------------


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("chunks", [1, 2], ids=["contiguous", "balanced"])
def test_the_causal_pieces_of_each_step_are_the_chunk_pairs_positions_allow(n, chunks):
    """Oracle: a query chunk sees a key chunk where its positions come after (the diagonal chunk
    causally). Each rank's chunks, as the layout lays them out; every seen pair is computed once,
    no unseen pair is (a causal kernel on several chunks masks by their order in the block);
    balanced, every rank computes as much."""
    from vsf.jit.context_parallel import _Layout

    layout = _Layout(n, chunks, causal=True)
    order = [i for i in range(n)] if chunks == 1 else list(vsf.BalancedShard.chunk_order(n))
    held = [order[r * chunks : (r + 1) * chunks] for r in range(n)]
    work = []
    for me in range(n):
        pairs = {}
        for s in range(n):
            keys = held[(me - s) % n]
            for piece in layout.pieces(s, me):
                if not piece.seen:
                    continue
                for u, a in enumerate(held[me][piece.qs]):
                    for w, b in enumerate(keys[piece.ks]):
                        if piece.causal and u < w:  # a causal kernel's mask hides later local chunks
                            assert b > a, (me, s, a, b)
                            continue
                        assert (piece.causal and u == w) == (a == b), (me, s, a, b)
                        pairs[(a, b)] = pairs.get((a, b), 0) + 1
        assert pairs == {(a, b): 1 for a in held[me] for b in range(n * chunks) if b <= a}, me
        work.append(sum(1 if a == b else 2 for a, b in pairs))  # half-chunk units: a diagonal pair costs half
    assert len(set(work)) == 1 if chunks == 2 else work == sorted(work)


BALANCED = {"cp2": 2, "cp4": 4}


def _run_balanced(sim, n, params, loss_fn):
    sim(n)
    mesh = vsf.make_mesh((n,), ("cp",))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P(None, None, vsf.balanced("cp"))))
    jitted = vsf.jit(_step(loss_fn))
    return vsf.device_get(jitted(p)), jitted.lower(p).plan


@CAUSAL
@pytest.mark.parametrize("mode", ["all_gather", "ring"])
@pytest.mark.parametrize("layout", sorted(BALANCED))
def test_attention_on_balanced_sequence_shards_equals_one_device(sim, monkeypatch, layout, mode, causal):
    """q, k, v (GQA: 8 query heads, 2 key/value heads) laid out balanced over cp: the output and
    every gradient equal one device's SDPA, and the plan keeps the queries (and on a ring the keys)
    on the balanced chunks."""
    monkeypatch.setattr(vsf.config, "context_parallel", mode)
    params, batch, loss_fn = _qkv_case(causal=causal, kv_heads=2, heads=8)
    want = reference(loss_fn, params, batch)
    got, plan = _run_balanced(sim, BALANCED[layout], params, loss_fn)
    assert_equal_to_one_device(got, want)
    for p in attention_plans(plan)[SDPA]:
        assert isinstance(on_axis(plan, p.ins[0]), BalancedPlacement), p.ins
        assert isinstance(on_axis(plan, p.ins[1]), BalancedPlacement if mode == "ring" else Replicate), p.ins


def test_positions_made_in_the_step_follow_the_balanced_layout(sim):
    """``arange(t)`` inside the step (a model's learned positions) meets the tokens' balanced
    chunks: each rank gets its chunks' positions, and the result comes back in order."""
    x = torch.zeros(2, 16)
    sim(4)
    mesh = vsf.make_mesh((4,), ("cp",))
    xs = vsf.device_put(x, vsf.NamedSharding(mesh, P(None, vsf.balanced("cp"))))
    got = vsf.jit(lambda x: x + torch.arange(x.shape[1]))(xs)
    assert isinstance(got.placements[0], BalancedPlacement)
    torch.testing.assert_close(vsf.device_get(got), x + torch.arange(16), rtol=0, atol=0)


def _sgd_steps(model, params, tokens, steps, run):
    def step(p, idx, tgt):
        loss, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, idx, tgt))(p)
        return vsf.tree.map(lambda w, g: w - 0.1 * g, p, grads), loss

    losses = []
    for _ in range(steps):
        params, loss = run(step)(params, *tokens)
        losses.append(vsf.device_get(loss))
    return vsf.device_get(params), torch.stack(losses)


@pytest.mark.parametrize("model_kind", ["toy-sdpa", "example"])
def test_a_gpt_on_dp_x_cp_balanced_trains_like_one_device(sim, model_kind):
    """Three SGD steps of a GPT with learned positions (``wpe(arange(t))``), two sequences on
    ``dp`` each balanced over ``cp``: the losses and params equal the one-device steps. The
    repo's toy GPT (SDPA) keeps its attention on the balanced chunks; examples/gpt.py (masked
    softmax, T x T scores) is checked for its numbers."""
    import sys
    from pathlib import Path

    from toy_models import GPT, GPTConfig

    if model_kind == "example":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
        import gpt

        model = gpt.GPT(gpt.GPTConfig(vocab=32, seq=16, dim=16, heads=2, layers=1))
    else:
        model = GPT(GPTConfig(vocab=32, seq=16, dim=16, heads=2, layers=1, tied=False, sdpa=True))
    params = vsf.tree.from_module(model)
    tokens = (torch.randint(0, 32, (2, 16)), torch.randint(0, 32, (2, 16)))
    want, want_losses = _sgd_steps(model, params, tokens, 3, lambda f: f)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "cp"))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    b = vsf.device_put(tokens, vsf.NamedSharding(mesh, P("dp", vsf.balanced("cp"))))
    jitted = {}
    got, losses = _sgd_steps(model, p, b, 3, lambda f: jitted.setdefault("step", vsf.jit(f)))
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    if model_kind == "toy-sdpa":
        plan = jitted["step"].lower(p, *b).plan
        for pl in attention_plans(plan)[SDPA]:
            assert isinstance(on_axis(plan, pl.ins[0]), BalancedPlacement), pl.ins


# -- the choice between gathered keys and a ring ("auto") ---------------------------------------------


@pytest.mark.parametrize("seq, chosen", [(16, "all_gather"), (64, "ring")])
def test_auto_rings_where_the_gathered_keys_and_values_exceed_the_budget(sim, monkeypatch, seq, chosen):
    """With a 16 KiB budget: 16 positions of keys and values (2 x 2 x 16 x 8 fp32, 8 KiB together)
    are gathered, 64 (32 KiB) go around a ring; "all_gather" and "ring" force either; each equals
    one device."""
    monkeypatch.setattr(vsf.config, "context_parallel_gather_bytes", 16 * 2**10)
    params, batch, loss_fn = _qkv_case(causal=True, kv_heads=2, heads=8, seq=seq)
    want = reference(loss_fn, params, batch)
    sim(2)
    p = vsf.device_put(params, vsf.NamedSharding(vsf.make_mesh((2,), ("cp",)), P(None, None, "cp")))
    for mode, expect in (("auto", chosen), ("all_gather", "all_gather"), ("ring", "ring")):
        monkeypatch.setattr(vsf.config, "context_parallel", mode)
        jitted = vsf.jit(_step(loss_fn))
        plan = jitted.lower(p).plan
        keys = {on_axis(plan, p.ins[1]) for p in attention_plans(plan)[SDPA]}
        assert keys == ({Shard(2)} if expect == "ring" else {Replicate()}), (mode, keys)
        if mode == "auto":
            assert_equal_to_one_device(vsf.device_get(jitted(p)), want)


def test_a_gpt_on_dp_x_cp_balanced_ring_passes_checking_mode(sim, monkeypatch):
    """Op by op, every value assembled from the balanced shards (those a view merges into the
    projections' rows too) equals the unsharded graph's, keys and values on a ring."""
    monkeypatch.setattr(vsf.config, "context_parallel", "ring")
    params, tokens, loss_fn = _gpt_case(sdpa=True, batch=2)
    want = reference(loss_fn, params, tokens)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "cp"))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    b = vsf.device_put(tokens, vsf.NamedSharding(mesh, P("dp", vsf.balanced("cp"))))
    jitted = vsf.jit(_step(loss_fn))
    assert_equal_to_one_device(vsf.device_get(jitted.check(p, *b)), want)
    plan = jitted.lower(p, *b).plan
    for pl in attention_plans(plan)[SDPA]:
        assert all(isinstance(on_axis(plan, x), BalancedPlacement) for x in pl.ins), pl.ins
