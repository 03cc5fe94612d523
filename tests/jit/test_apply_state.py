"""``vsf.tree.apply`` under ``vsf.jit`` and eagerly: activation checkpointing recomputes with the
params being trained, a module's own weight never becomes a constant of a traced step, state
written in forward comes back with ``mutable=True`` (and is an error without it), and BatchNorm on
batch shards reduces its statistics' partial sums instead of gathering the batch.

The oracle is the same module trained by plain PyTorch on one device (``torch.optim.AdamW``),
without checkpointing, its own buffers updated by its own forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import vsf
from vsf import P, optim

STEPS, LR, EPS, WD = 3, 1e-2, 1e-5, 0.01


def _adamw() -> optim.GradientTransformation:
    return optim.adamw(LR, eps=EPS, weight_decay=WD)


def _torch_trained(model: torch.nn.Module, loss_fn, batches) -> torch.nn.Module:
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    for batch in batches:
        opt.zero_grad()
        loss_fn(model, *batch).backward()
        opt.step()
    return model


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].to(want[k].dtype), want[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


# -- activation checkpointing ---------------------------------------------------------------------


class Checkpointed(torch.nn.Module):
    """Blocks of an MLP, each run through ``torch.utils.checkpoint`` when ``remat`` is on."""

    def __init__(self, dim: int = 16, layers: int = 3, reentrant: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
            for _ in range(layers)
        )
        self.head = torch.nn.Linear(dim, 1)
        self.remat, self.reentrant = True, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=self.reentrant) if self.remat else block(x))
        return self.head(x).square().mean()


MEGATRON = [
    (r".*\.0\.weight", P("tp", None)),
    (r".*\.0\.bias", P("tp")),
    (r".*\.2\.weight", P(None, "tp")),
    (r".*", P()),
]


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g),) for _ in range(n)]


def _train(model: torch.nn.Module, params, mesh, batch_spec, batches, loss=lambda out: out):
    tx = _adamw()

    @vsf.jit
    def step(params, opt_state, x):
        value, grads = vsf.value_and_grad(lambda p: loss(vsf.tree.apply(model, p, x)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state, value

    state = optim.init_sharded(tx, params)
    for (x,) in batches:
        params, state, _ = step(params, state, vsf.device_put(x, vsf.NamedSharding(mesh, batch_spec)))
    return vsf.device_get(params)


def _train_with_buffers(model: torch.nn.Module, mesh, spec, batch_spec, batches):
    """:func:`_train` with the module's buffers carried as state (``apply(..., mutable=True)``, each
    step's updated ones passed to the next), each param laid out as ``spec(key)``: the params and
    buffers after the steps."""
    params, buffers = vsf.tree.from_module(model), vsf.tree.from_module(model, params=False, buffers=True)
    tx = _adamw()

    @vsf.jit
    def step(params, buffers, opt_state, x):
        def loss_fn(params):
            return vsf.tree.apply(model, {**params, **buffers}, x, mutable=True)

        (_, updated), grads = vsf.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), {**buffers, **updated}, opt_state

    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {k: spec(k) for k in params}))
    b = vsf.device_put(buffers, vsf.NamedSharding(mesh, P()))
    o = optim.init_sharded(tx, p)
    for (x,) in batches:
        p, b, o = step(p, b, o, vsf.device_put(x, vsf.NamedSharding(mesh, batch_spec)))
    return vsf.device_get(p), vsf.device_get(b)


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_checkpointed_blocks_train_like_one_device_without_checkpointing(sim, layout):
    """The recompute in the backward reads the params being trained (on the old code, the module's
    own weights: the first step was right, every later gradient wrong)."""
    torch.manual_seed(0)
    model = Checkpointed()
    plain = copy.deepcopy(model)
    plain.remat = False
    want = _torch_trained(plain, lambda m, x: m(x), _batches())
    params = vsf.tree.from_module(model)
    shape, axes = ((2,), ("dp",)) if layout == "dp" else ((2, 2), ("dp", "tp"))
    sim(len(axes) * 2)
    mesh = vsf.make_mesh(shape, axes)
    specs = {k: P() for k in params} if layout == "dp" else vsf.sharding.match(params, MEGATRON)
    got = _train(model, vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs)), mesh, P("dp"), _batches())
    _assert_close(got, dict(want.named_parameters()))


def test_a_module_weight_read_from_the_module_is_refused(sim):
    """A weight the traced step reads from the module instead of its arguments would be a constant
    of the plan: torch.func.functional_call's recompute under checkpointing, or a direct read."""
    model = Checkpointed()
    params = vsf.tree.from_module(model)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    p = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    x = vsf.device_put(torch.randn(4, 16), vsf.NamedSharding(mesh, P("dp")))
    recompute = vsf.jit(lambda p, x: vsf.grad(lambda p: torch.func.functional_call(model, p, (x,)))(p))
    with pytest.raises(
        vsf.TraceError, match=r"reads a module's parameter \(float32\[32, 16\]\) from the module itself"
    ):
        recompute(p, x)
    direct = vsf.jit(lambda p, x: vsf.grad(lambda p: vsf.tree.apply(model, p, x) + model.head.weight.sum())(p))
    with pytest.raises(vsf.TraceError, match=r"reads a module's parameter \(float32\[1, 16\]\)"):
        direct(p, x)


def test_a_module_built_inside_simulate_and_closed_over_is_refused_at_the_jit_call(sim):
    """Its params hold one value per simulated rank: read from the module (not the arguments) they
    ran rank by rank outside the traced graph, and the result failed later, at device_get. The same
    module built outside the simulation meets the rule on module weights above."""
    outside = Checkpointed()
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    inside = Checkpointed()
    x = vsf.device_put(torch.randn(4, 16), vsf.NamedSharding(mesh, P("dp")))
    with pytest.raises(
        vsf.TraceError,
        match=r"reads the module tensors inside\.blocks\.0\.0\.weight, .* built inside `vsf.simulate` "
        r".*Build the model outside `vsf.simulate`, or pass its params as arguments and run it with vsf.tree.apply",
    ):
        vsf.jit(lambda x: inside(x))(x)
    offset = vsf.tree.from_module(inside)["head.bias"]
    with pytest.raises(vsf.TraceError, match=r"reads a tensor built inside `vsf.simulate` from outside its arguments"):
        vsf.jit(lambda x: x + offset)(x)
    with pytest.raises(
        vsf.TraceError, match=r"reads a module's parameter \(float32\[32, 16\]\) from the module itself"
    ):
        vsf.jit(lambda x: outside(x))(x)


def test_a_module_built_inside_simulate_trains_through_explicit_params_like_one_device():
    """Its params, passed as arguments, give one device's loss and gradients: the oracle is the
    same params (read back with device_get) on a module built outside, differentiated by torch."""
    with vsf.simulate(2):
        mesh = vsf.make_mesh((2,), ("dp",))
        model = Checkpointed()
        params = vsf.device_put(vsf.tree.from_module(model), vsf.NamedSharding(mesh, P()))
        (x,) = _batches(1)[0]
        step = vsf.jit(lambda p, x: vsf.value_and_grad(lambda p: vsf.tree.apply(model, p, x))(p))
        loss, grads = vsf.device_get(step(params, vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))))
        plain = vsf.device_get(params)
    assert all(type(t) is torch.Tensor for t in (loss, *plain.values(), *grads.values()))
    oracle = Checkpointed()
    oracle.remat = False
    oracle.load_state_dict(plain)
    want = oracle(x)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    _assert_close(grads, {k: p.grad for k, p in oracle.named_parameters()})


def test_reentrant_checkpointing_is_refused_eagerly_and_under_jit(sim):
    model = Checkpointed(reentrant=True)
    params = vsf.tree.from_module(model)
    x = torch.randn(4, 16)
    message = r"Checkpointed checkpoints activations with torch.utils.checkpoint's use_reentrant=True \(at .*test_apply_state.py:\d+\).*use use_reentrant=False"
    _assert_refused_eagerly_and_under_jit(sim, model, params, x, message)


def _assert_refused_eagerly_and_under_jit(sim, model: torch.nn.Module, params, x: torch.Tensor, message: str) -> None:
    """The gradient of ``model`` at ``params`` on ``x`` raises an ApplyError matching ``message``,
    eagerly and in a jitted step on a 2-rank ``dp`` mesh."""
    with pytest.raises(vsf.ApplyError, match=message):
        vsf.grad(lambda p: vsf.tree.apply(model, p, x))(params)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    step = vsf.jit(lambda p, x: vsf.grad(lambda p: vsf.tree.apply(model, p, x))(p))
    with pytest.raises(vsf.ApplyError, match=message):
        step(vsf.device_put(params, vsf.NamedSharding(mesh, P())), vsf.device_put(x, vsf.NamedSharding(mesh, P("dp"))))


# -- modules reached through plain objects --------------------------------------------------------


class _TiedHead:
    """A plain object (not a module) holding the module whose weight it reads: torchtune's
    ``TiedLinear``, the output layer of its Llama 3.2, Qwen2 and Gemma (the embedding's weight)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.module.weight)


class TiedByObject(torch.nn.Module):
    """An embedding whose weight the output layer reads again, through a ``_TiedHead`` or, with
    ``closure``, through a function closing over the embedding."""

    def __init__(self, closure: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)
        emb = self.emb
        self.head = (lambda x: F.linear(x, emb.weight)) if closure else _TiedHead(self.emb)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens)))).logsumexp(-1).mean()


def _tokens(n: int = STEPS) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 16, (8, 6), generator=g),) for _ in range(n)]


def test_a_module_a_plain_object_holds_computes_with_the_params_given_eagerly_and_under_jit(sim):
    """The output layer reads the params given, not the module's own weight: eagerly the gradient
    is torch's (the tied embedding's has the output layer's part, which it once lacked without an
    error), and under jit (dp x tp, the embedding split over its rows) three AdamW steps give
    torch's params (it was a TraceError)."""
    model = TiedByObject()
    params = vsf.tree.from_module(model)
    (tokens,) = _tokens(1)[0]
    model(tokens).backward()
    grads = vsf.grad(lambda p: vsf.tree.apply(model, p, tokens))(params)
    _assert_close(grads, {k: p.grad for k, p in model.named_parameters()})
    want = dict(_torch_trained(TiedByObject(), lambda m, x: m(x), _tokens()).named_parameters())
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    specs = {k: P("tp", None) if k == "emb.weight" else P() for k in params}
    got = _train(model, vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs)), mesh, P("dp"), _tokens())
    _assert_close(got, want)


class _Aliased(torch.nn.Module):
    """A buffer read through a plain attribute naming it (Hugging Face's rotary embeddings keep
    ``inv_freq`` as ``original_inv_freq`` too)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.scale_alias = self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale_alias


def test_an_attribute_naming_a_buffer_reads_the_buffer_given():
    model = _Aliased()
    state = {**vsf.tree.from_module(model), "scale": torch.arange(4.0)}
    oracle = copy.deepcopy(model)
    oracle.scale_alias = torch.arange(4.0)
    x = torch.randn(3, 4)
    torch.testing.assert_close(vsf.tree.apply(model, state, x), oracle(x), rtol=0, atol=0)
    assert torch.equal(model.scale_alias, torch.ones(4))  # the module's own untouched


def test_a_module_weight_reached_by_a_closure_is_refused_eagerly_and_under_jit(sim):
    """A function closing over the embedding reads its own weight, which the bound tree cannot
    swap: an ApplyError naming it, where the gradient would silently lack the output layer's part."""
    model = TiedByObject(closure=True)
    params = vsf.tree.from_module(model)
    (tokens,) = _tokens(1)[0]
    message = r"TiedByObject's forward read the module's own tensor 'emb.weight' \(float32\[16, 8\] on cpu, in linear, called below\)"
    _assert_refused_eagerly_and_under_jit(sim, model, params, tokens, message)


class FrozenPositions(torch.nn.Module):
    """A sinusoidal position table held as a frozen parameter (``requires_grad=False``), as
    Whisper's encoder and Pegasus hold theirs, added to embedded tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8)
        table = torch.arange(6.0)[:, None] / 10.0 ** (torch.arange(8.0) / 8)
        self.positions = torch.nn.Parameter(table.sin(), requires_grad=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.out(self.emb(tokens) + self.positions)).square().mean()


def test_from_module_warns_of_frozen_params_and_splits_them_off():
    model = FrozenPositions()
    with pytest.warns(
        UserWarning, match=r"FrozenPositions holds 1 frozen parameter\(s\) \(requires_grad=False: 'positions'\)"
    ):
        everything = vsf.tree.from_module(model)
    trainable, frozen = vsf.tree.from_module(model, trainable=True), vsf.tree.from_module(model, trainable=False)
    assert sorted(frozen) == ["positions"] and sorted(trainable) == ["emb.weight", "out.bias", "out.weight"]
    assert everything.keys() == trainable.keys() | frozen.keys()


def test_frozen_params_passed_beside_the_trainable_ones_stay_as_torch_leaves_them(sim):
    """Three dp x tp AdamW steps differentiating the trainable params, the frozen table passed to
    ``apply`` beside them: torch's params, the table unchanged (all of ``from_module``'s params
    differentiated, the table trained: what the warning is about)."""
    model = FrozenPositions()
    batches = _tokens()
    want = dict(_torch_trained(model, lambda m, x: m(x), batches).named_parameters())
    params, frozen = vsf.tree.from_module(model, trainable=True), vsf.tree.from_module(model, trainable=False)
    tx = _adamw()

    @vsf.jit
    def step(params, frozen, opt_state, x):
        value, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(model, {**p, **frozen}, x))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), opt_state

    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {k: _rows_over_tp(k) for k in params}))
    f = vsf.device_put(frozen, vsf.NamedSharding(mesh, P()))
    o = optim.init_sharded(tx, p)
    for (x,) in batches:
        p, o = step(p, f, o, vsf.device_put(x, vsf.NamedSharding(mesh, P("dp"))))
    _assert_close({**vsf.device_get(p), **vsf.device_get(f)}, want)
    assert torch.equal(want["positions"], model.positions)


class _Cached(torch.nn.Module):
    """A block that fills a buffer with a table on a call longer than what it holds, its length a
    plain attribute: rotary-embedding-torch's ``cached_freqs`` and ``cached_freqs_seq_len``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(16, 8), persistent=False)
        self.cached = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-2]
        if self.cached < n:
            self.cache[:n] = torch.arange(n * 8.0).view(n, 8).sin()
            self.cached = n
        return torch.tanh(self.lin(x) + self.cache[:n])


class CachedBlocks(torch.nn.Module):
    """Blocks alike (stamped from one trace under ``vsf.jit``), each with its own :class:`_Cached` table."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_Cached() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_cache_a_block_fills_in_forward_is_a_buffer_write_under_jit_as_eagerly(sim):
    """The blocks' first trace (made aside, to stamp the others from) assigned the length of the
    cache it filled on its own inputs: the step then ran the block on a cache it took as filled,
    all zeros, and gave a wrong loss without an error. Now a block whose trace assigns an
    attribute is not stamped, and its buffer write is the ApplyError it is eagerly."""
    model = CachedBlocks()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    message = r"CachedBlocks's forward wrote its buffer 'blocks.0.cache', which state does not hold"
    _assert_refused_eagerly_and_under_jit(sim, model, vsf.tree.from_module(model), x, message)
    assert all(block.cached == 0 for block in model.blocks)  # (the module's own, as before)


def test_a_cache_a_block_fills_in_forward_carried_as_state_trains_like_one_device(sim):
    """The caches in ``state`` with ``mutable=True``: three dp x tp AdamW steps give torch's params
    and its caches."""
    model = CachedBlocks()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, 8, generator=g),) for _ in range(STEPS)]
    want = _torch_trained(model, lambda m, x: m(x), batches)
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    params, caches = _train_with_buffers(model, mesh, _rows_over_tp, P("dp"), batches)
    _assert_close(params, dict(want.named_parameters()))
    _assert_close(caches, dict(want.named_buffers()))


def _rows_over_tp(key: str) -> P:
    return P("tp") if key.endswith("weight") else P()


class ConvertsInForward(torch.nn.Module):
    """Experts that forward moves, each call, to the device they run on, as st-moe's do
    (``expert.to(device)``, all but the experts in use to ``"cpu"`` in its offloading), or with
    ``dtype`` converts to it (``expert.to(dtype)``)."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for expert in self.experts:
            expert.to(self.dtype or x.device)
        return sum(torch.tanh(expert(x)) for expert in self.experts).square().mean()


def test_a_module_moved_in_forward_where_it_is_computes_with_the_params_given_eagerly_and_under_jit(sim):
    """``expert.to(x.device)`` in forward leaves the bound tensors as they are: eagerly the gradient
    is torch's, and under jit (dp x tp, the experts' rows split) three AdamW steps give torch's
    params (it was a RuntimeError: "Couldn't swap Linear.weight", torch's module conversion
    swapping a traced tensor)."""
    model = ConvertsInForward()
    params = vsf.tree.from_module(model)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    model(x).backward()
    _assert_close(
        vsf.grad(lambda p: vsf.tree.apply(model, p, x))(params), {k: p.grad for k, p in model.named_parameters()}
    )
    batches = [(torch.randn(8, 8, generator=torch.Generator().manual_seed(i)),) for i in range(STEPS)]
    want = dict(_torch_trained(ConvertsInForward(), lambda m, x: m(x), batches).named_parameters())
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    specs = {k: _rows_over_tp(k) for k in params}
    got = _train(model, vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs)), mesh, P("dp"), batches)
    _assert_close(got, want)


def test_a_module_converted_in_forward_to_another_dtype_is_refused_eagerly_and_under_jit(sim):
    """A conversion that would change a bound tensor would compute with another tensor than the
    one given (and, under jit, fail in torch's own swap): an ApplyError naming it."""
    model = ConvertsInForward(dtype=torch.float64)
    message = (
        r"ConvertsInForward's forward converts 'experts.0.weight' \(float32\[8, 8\] on cpu -> float64\[8, 8\] on cpu, "
        r"by Module.to"
    )
    _assert_refused_eagerly_and_under_jit(sim, model, vsf.tree.from_module(model), torch.randn(4, 8), message)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the module's own untouched


# -- state written in forward ---------------------------------------------------------------------


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 5),
    )


def _images(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)]


def _cnn_step(model: torch.nn.Module, tx: optim.GradientTransformation):
    def step(params, stats, opt_state, x, y):
        def loss_fn(params, stats):
            out, updated = vsf.tree.apply(model, {**params, **stats}, x, mutable=True)
            return F.cross_entropy(out, y), {**stats, **updated}

        (loss, stats), grads = vsf.value_and_grad(loss_fn, has_aux=True)(params, stats)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optim.apply_updates(params, updates), stats, opt_state, loss

    return step


def _cnn_oracle() -> torch.nn.Module:
    return _torch_trained(_cnn(), lambda m, x, y: F.cross_entropy(m(x), y), _images())


def test_batchnorm_running_stats_come_back_with_mutable_eagerly():
    model, tx = _cnn(), _adamw()
    params, stats = vsf.tree.from_module(model), vsf.tree.from_module(model, params=False, buffers=True)
    before = copy.deepcopy(stats)
    step = _cnn_step(model, tx)
    p, s, o = params, stats, tx.init(params)
    for x, y in _images():
        p, s, o, _ = step(p, s, o, x, y)
    want = _cnn_oracle()
    _assert_close(p, dict(want.named_parameters()))
    _assert_close(s, dict(want.named_buffers()))
    _assert_close(stats, before)  # state is not written
    _assert_close(vsf.tree.from_module(model, params=False, buffers=True), before)  # nor the module's own


@pytest.mark.parametrize("n", [2, 4])
def test_batchnorm_cnn_on_batch_shards_equals_one_device_and_reduces_only_partial_sums(sim, n):
    """Params and running statistics (of the global batch) after 3 steps equal one device's; each
    rank convolves its own images (FLOPs: one device's / n) and the plan sends, by hand under the
    ring model (2 (n-1)/n of an all-reduced tensor's bytes): per BatchNorm of C channels, its
    forward's mean and variance sums and its backward's two sums (4 C, SyncBatchNorm's), every
    param's gradient once (DDP's), and the mean loss's sum and count: no activation."""
    model, tx = _cnn(), _adamw()
    params, stats = vsf.tree.from_module(model), vsf.tree.from_module(model, params=False, buffers=True)
    want = _cnn_oracle()  # plain PyTorch, before the simulated ranks start
    x, y = _images(1)[0]
    with FlopCounterMode(display=False) as one_device:
        F.cross_entropy(_cnn()(x), y).backward()
    sim(n)
    mesh = vsf.make_mesh((n,), ("dp",))
    rep = vsf.NamedSharding(mesh, P())
    p, s = vsf.device_put(params, rep), vsf.device_put(stats, rep)
    o = optim.init_sharded(tx, p)
    step = vsf.jit(_cnn_step(model, tx))
    for x, y in _images():
        batch = vsf.device_put((x, y), vsf.NamedSharding(mesh, P("dp")))
        p, s, o, _ = step(p, s, o, *batch)
    _assert_close(vsf.device_get(p), dict(want.named_parameters()))
    _assert_close(vsf.device_get(s), dict(want.named_buffers()))

    cost = step.lower(p, s, o, *batch).cost()
    channels = 8 + 4
    floats = 4 * channels + sum(v.numel() for v in params.values()) + 2
    assert cost.comm_bytes == {"dp": pytest.approx(2 * (n - 1) / n * 4 * floats)}
    assert {c.kind for c in cost.collectives} == {"all_reduce"}
    assert cost.flops * n == one_device.get_total_flops()


def test_a_buffer_write_without_mutable_is_an_error_naming_it(sim):
    """Eagerly and under jit alike; on the old code the module's own buffers were written from
    inside jitted calls (its num_batches_tracked read 4 after 3 steps)."""
    model = _cnn()
    params = vsf.tree.from_module(model)
    state = vsf.tree.from_module(model, buffers=True)
    x, _ = _images(1)[0]
    own = r"Sequential's forward wrote its buffer '1\.(running_mean|running_var|num_batches_tracked)', which state does not hold"
    given = r"Sequential's forward wrote the buffer '1\.(running_mean|running_var|num_batches_tracked)' of state: call vsf.tree.apply\(\.\.\., mutable=True\)"
    with pytest.raises(vsf.ApplyError, match=own):
        vsf.tree.apply(model, params, x)
    with pytest.raises(vsf.ApplyError, match=given):
        vsf.tree.apply(model, state, x)
    sim(2)
    mesh = vsf.make_mesh((2,), ("dp",))
    bx = vsf.device_put(x, vsf.NamedSharding(mesh, P("dp")))
    with pytest.raises(vsf.ApplyError, match=own):
        vsf.jit(lambda p, x: vsf.tree.apply(model, p, x).sum())(
            vsf.device_put(params, vsf.NamedSharding(mesh, P())), bx
        )
    with pytest.raises(vsf.ApplyError, match=given):
        vsf.jit(lambda p, x: vsf.tree.apply(model, p, x).sum())(vsf.device_put(state, vsf.NamedSharding(mesh, P())), bx)
    assert int(model[1].num_batches_tracked) == 0 and torch.equal(model[1].running_mean, torch.zeros(8))


class Counter(torch.nn.Module):
    """Counts its calls in a buffer it reassigns (not in place), and writes a param in place on request."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, clip: bool = False) -> torch.Tensor:
        self.calls = self.calls + 1
        if clip:
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
        return self.lin(x)


def test_a_reassigned_buffer_comes_back_and_a_param_write_is_an_error():
    model = Counter()
    state = vsf.tree.from_module(model, buffers=True)
    x = torch.randn(3, 2)
    out, updated = vsf.tree.apply(model, state, x, mutable=True)
    torch.testing.assert_close(out, model.lin(x))
    assert (
        updated.keys() == {"calls"}
        and int(updated["calls"]) == 1
        and int(state["calls"]) == 0
        and int(model.calls) == 0
    )
    _, updated = vsf.tree.apply(model, {**state, **updated}, x, mutable=True)
    assert int(updated["calls"]) == 2
    with pytest.raises(vsf.ApplyError, match=r"Counter's forward wrote its parameter 'lin.weight'"):
        vsf.tree.apply(model, state, x, clip=True, mutable=True)


class RouterMoE(torch.nn.Module):
    """A mixture of experts routed as torchtitan's ``MoE`` (``torchtitan/models/common/moe.py``)
    routes in train mode: sigmoid scores of a gate, the top-k experts of the scores plus a
    load-balancing ``expert_bias`` buffer (for the choice only; the gates are the scores), and a
    ``tokens_per_expert`` buffer that forward accumulates in place under ``no_grad``; then a
    residual stream through the chosen experts' SwiGLU (each token gathers its experts' weights)."""

    def __init__(self, dim: int = 8, hidden: int = 16, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(dim, experts, bias=False)
        self.w1 = torch.nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w3 = torch.nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)
        self.head = torch.nn.Linear(dim, 1)
        self.register_buffer("expert_bias", torch.linspace(-0.1, 0.1, experts))
        self.register_buffer("tokens_per_expert", torch.zeros(experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(self.gate(x))
        _, ids = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)
        gates = scores.gather(-1, ids)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(torch.zeros_like(scores).scatter_(-1, ids, 1.0).sum((0, 1)))
        h = F.silu(torch.einsum("blkfd,bld->blkf", self.w1[ids], x)) * torch.einsum("blkfd,bld->blkf", self.w3[ids], x)
        x = x + torch.einsum("blk,blkdf,blkf->bld", gates, self.w2[ids], h)
        return self.head(x).square().mean()


MOE_LAYOUTS = {
    "dp": ((2,), ("dp",), lambda k: P(), P("dp")),
    "fsdp": ((2,), ("fsdp",), lambda k: P("fsdp"), P("fsdp")),
    "tp": (
        (2,),
        ("tp",),
        lambda k: P(None, "tp") if k in ("w1", "w3") else P(None, None, "tp") if k == "w2" else P(),
        P(),
    ),
}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_router_token_counts_written_in_forward_equal_one_device(sim, layout):
    """The router's token counts (of the global batch) and the params after 3 steps equal one
    device's, on DP, FSDP (params and batch split) and TP (the experts' hidden dim split)."""
    torch.manual_seed(0)
    model = RouterMoE()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, 8, generator=g),) for _ in range(STEPS)]
    want = _torch_trained(model, lambda m, x: m(x), batches)
    shape, axes, spec, batch_spec = MOE_LAYOUTS[layout]
    sim(2)
    params, counts = _train_with_buffers(model, vsf.make_mesh(shape, axes), spec, batch_spec, batches)
    _assert_close(params, dict(want.named_parameters()))
    _assert_close(counts, dict(want.named_buffers()))
    assert counts["tokens_per_expert"].sum() == STEPS * 4 * 6 * 2
