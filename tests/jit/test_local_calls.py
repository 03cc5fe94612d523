"""What an op called on a shard is given: the traced value's layout, and a shard's sizes.

The plan runs each op on local shards, which a collective, a redistribution or a slice may lay out
otherwise than the trace laid out the value (a row-major buffer, a materialised broadcast), and
some ops take sizes of their global tensors as arguments (group norm's N, C and HxW; an upsample
backward's input size). Each case here trains a few steps sharded and compares the params with
the same steps on one device (torch's own AdamW and autograd).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import vsf
from vsf import P, _compat, optim
from vsf.jit.lower import _traced_layout

B, H, T, D, WIDTH = 4, 4, 16, 8, 32
LR, STEPS = 1e-2, 3


class Attention(torch.nn.Module):
    """Self-attention through ``scaled_dot_product_attention`` with an explicit additive mask
    (SDPA's CPU flash kernel with a mask argument, as Hugging Face's Falcon calls it): ``mask``
    ``"causal"`` a [T, T] mask, ``"expanded"`` the same expanded to [B, 1, T, T] (a view with
    stride 0 over the batch), ``"padded"`` a per-row causal and padding mask [B, 1, T, T]."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * H * D, bias=False)  # (a key bias's gradient is zero but for rounding)
        self.out = torch.nn.Linear(H * D, WIDTH)
        self.mask = mask

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q, k, v = self.qkv(x).view(b, T, 3, H, D).permute(2, 0, 3, 1, 4)
        keep = torch.ones(T, T, dtype=torch.bool).tril()
        if self.mask == "expanded":
            keep = keep[None, None].expand(b, 1, T, T)
        elif self.mask == "padded":
            keep = keep & (torch.arange(T) < lengths[:, None])[:, None, None, :]
        bias = torch.where(keep, 0.0, torch.finfo(x.dtype).min)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, T, H * D))


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, WIDTH, generator=g)
    return x, torch.randn(B, T, WIDTH, generator=g), torch.randint(T // 2, T + 1, (B,), generator=g)


def _torch_run(model: torch.nn.Module, loss_fn, batch) -> dict[str, torch.Tensor]:
    """The oracle: ``model`` trained ``STEPS`` steps by plain PyTorch on one device."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _jit_run(sim, model: torch.nn.Module, loss_fn, batch, shape, axes, specs, batch_spec) -> dict[str, torch.Tensor]:
    """``model`` trained ``STEPS`` steps through ``vsf.jit`` (the first checked) on a mesh of ``shape``."""
    params = vsf.tree.from_module(model)
    tx = optim.adamw(LR)

    def step(p, s, batch):
        loss, grads = vsf.value_and_grad(lambda p: loss_fn(lambda *a: vsf.tree.apply(model, p, *a), batch))(p)
        updates, s = tx.update(grads, s, p)
        return optim.apply_updates(p, updates), s, loss

    sim(len(axes) and int(torch.tensor(shape).prod()))
    mesh = vsf.make_mesh(shape, axes)
    p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs(params)))
    s = optim.init_sharded(tx, p)
    b = vsf.device_put(batch, vsf.NamedSharding(mesh, batch_spec))
    jitted = vsf.jit(step)
    for i in range(STEPS):
        p, s, _ = (jitted.check if i == 0 else jitted)(p, s, b)
    return vsf.device_get(p)


def _assert_params_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _assert_trains_like_one_device(sim, model: torch.nn.Module, x: torch.Tensor, layout: str, split: str) -> None:
    """``model`` trained on images ``x`` split over dp, on ``layout`` ``"dp"`` or ``"dp_tp"`` (the
    params under ``split`` split over tp there), ends with torch's one-device params."""
    want = _torch_run(model, _image_loss, x)
    shape, axes = ((2,), ("dp",)) if layout == "dp" else ((2, 2), ("dp", "tp"))
    specs = lambda p: {k: P("tp") if k.startswith(split) and layout == "dp_tp" else P() for k in p}  # noqa: E731
    _assert_params_close(_jit_run(sim, model, _image_loss, x, shape, axes, specs, P("dp")), want)


def _attention_loss(run, batch) -> torch.Tensor:
    x, target, lengths = batch
    return F.mse_loss(run(x, lengths), target)


@pytest.mark.parametrize("mask", ["causal", "expanded", "padded"])
def test_masked_attention_on_batch_shards_trains_like_one_device(sim, mask):
    torch.manual_seed(0)
    model, batch = Attention(mask), _batch()
    want = _torch_run(model, _attention_loss, batch)
    got = _jit_run(sim, model, _attention_loss, batch, (2,), ("dp",), lambda p: {k: P() for k in p}, P("dp"))
    _assert_params_close(got, want)


def test_masked_attention_on_batch_and_head_shards_trains_like_one_device(sim):
    """dp x tp: the mask split with the batch, q, k, v also over their heads (Megatron's attention)."""
    torch.manual_seed(0)
    model, batch = Attention("expanded"), _batch()
    want = _torch_run(model, _attention_loss, batch)
    specs = lambda p: {"qkv.weight": P("tp", None), "out.weight": P(None, "tp"), "out.bias": P()}  # noqa: E731
    got = _jit_run(sim, model, _attention_loss, batch, (2, 2), ("dp", "tp"), specs, P("dp"))
    _assert_params_close(got, want)


class MultiQuery(torch.nn.Module):
    """Causal self-attention with one key and value head, expanded to the queries' heads as a view
    (torchtune's ``MultiHeadAttention`` with one KV head: ``unsqueeze(2).expand(...).flatten(1, 2)``,
    which keeps the broadcast's stride 0; Hugging Face's ``repeat_kv`` reshapes, which copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, H * D, bias=False)
        self.k = torch.nn.Linear(WIDTH, D, bias=False)
        self.v = torch.nn.Linear(WIDTH, D, bias=False)
        self.out = torch.nn.Linear(H * D, WIDTH)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.q(x).view(b, T, H, D).transpose(1, 2)
        k, v = (
            proj(x).view(b, T, 1, D).transpose(1, 2).unsqueeze(2).expand(b, 1, H, T, D).flatten(1, 2)
            for proj in (self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, T, H * D))


def test_one_key_head_expanded_as_a_view_over_head_shards_trains_like_one_device(sim):
    """dp x tp, the key and value projections split over tp as Megatron splits a column-parallel
    layer: their one head's dims split, gathered before the broadcast to the queries' heads, each
    rank's share of which is a broadcast again (stride 0, as traced). Such a shard was once stored
    with the broadcast dim innermost (the key's own dim at stride 2), which SDPA's CPU flash kernel
    reads wrongly: the step ran without an error and computed the wrong attention (torchtune's
    Gemma on tp)."""
    torch.manual_seed(0)
    model, batch = MultiQuery(), _batch()
    want = _torch_run(model, _attention_loss, batch)
    specs = lambda p: {k: P(None, "tp") if k == "out.weight" else P() if k == "out.bias" else P("tp", None) for k in p}  # noqa: E731
    got = _jit_run(sim, model, _attention_loss, batch, (2, 2), ("dp", "tp"), specs, P("dp"))
    _assert_params_close(got, want)


class PooledOverTokens(torch.nn.Module):
    """Tokens projected, then pooled over the sequence by ``AdaptiveAvgPool1d`` on the transposed
    ``[batch, channels, tokens]``, and classified: Swin's pooler. torch's decomposition of the pool
    restrides its mean's size-1 dims with ``as_strided`` (and its backward scatters the gradient
    with ``as_strided_scatter``), which DTensor has no rule for: a ``PlanError`` on every layout."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.pool, self.head = (
            torch.nn.Linear(WIDTH, 8),
            torch.nn.AdaptiveAvgPool1d(1),
            torch.nn.Linear(8, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.tanh(self.proj(x)).transpose(1, 2)).flatten(1))


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_a_pool_over_transposed_tokens_trains_like_one_device(sim, layout):
    """dp, and dp x tp with the projection's channels split over tp (the pool runs on channel
    shards): the ``as_strided`` ops that only reshape are planned as views."""
    torch.manual_seed(0)
    model, (x, _, _) = PooledOverTokens(), _batch()
    _assert_trains_like_one_device(sim, model, x, layout, "proj.")


class FourierSmoothing(torch.nn.Module):
    """Each channel convolved over the sequence with a learned decaying kernel by FFT, ``rfft``, a
    product with the kernel's transform conjugated and ``irfft`` (Mega's multi-headed EMA), then
    projected. ``conj`` of a complex tensor is a view that differs from it in its conjugate bit
    alone: read as an identity view and dropped, the step ran the correlation's mirror image,
    silently (Mega's loss 0.2 off one device's from its first step on every layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.decay = torch.nn.Parameter(torch.randn(WIDTH))
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = torch.arange(T, dtype=x.dtype).unsqueeze(-1)
        kernel = torch.sigmoid(self.decay) ** steps  # [tokens, channels]
        n = 2 * T
        spectrum = torch.fft.rfft(x, n=n, dim=1) * torch.fft.rfft(kernel, n=n, dim=0).conj()
        return self.proj(torch.fft.irfft(spectrum, n, dim=1)[:, :T])


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_a_convolution_by_fft_with_a_conjugated_kernel_trains_like_one_device(sim, layout):
    """dp, and dp x tp with the projection's outputs split over tp: the ``conj`` stays a conjugation."""
    torch.manual_seed(0)
    model, (x, target, _) = FourierSmoothing(), _batch()
    want = _torch_run(model, lambda m, b: F.mse_loss(m(b[0]), b[1]), (x, target))
    shape, axes = ((2,), ("dp",)) if layout == "dp" else ((2, 2), ("dp", "tp"))
    specs = lambda p: {k: P("tp") if k.startswith("proj.") and layout == "dp_tp" else P() for k in p}  # noqa: E731
    got = _jit_run(sim, model, lambda run, b: F.mse_loss(run(b[0]), b[1]), (x, target), shape, axes, specs, P("dp"))
    _assert_params_close(got, want)


class ConvGroupNorm(torch.nn.Module):
    """A convolution, group norm, upsampling (``mode``) and a 1x1 convolution: diffusers' UNet's pieces."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 8)
        self.up = torch.nn.Upsample(scale_factor=2, mode=mode)
        self.head = torch.nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.up(F.silu(self.norm(self.conv(x)))))


def _image_loss(run, batch) -> torch.Tensor:
    return run(batch).square().mean()


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_group_norm_and_upsampling_on_batch_shards_train_like_one_device(sim, mode):
    """Group norm's N and an upsample backward's input size are a shard's, not the traced global
    ones (the local group norm raised ``Expected X.numel() == N * C * HxW``)."""
    torch.manual_seed(0)
    model, x = ConvGroupNorm(mode), torch.randn(4, 3, 8, 8)
    want = _torch_run(model, _image_loss, x)
    got = _jit_run(sim, model, _image_loss, x, (2,), ("dp",), lambda p: {k: P() for k in p}, P("dp"))
    _assert_params_close(got, want)


def test_group_norm_with_channel_split_convolutions_trains_like_one_device(sim):
    """dp x tp: the first convolution's output channels split over tp, the batch over dp."""
    torch.manual_seed(0)
    model, x = ConvGroupNorm("nearest"), torch.randn(4, 3, 8, 8)
    _assert_trains_like_one_device(sim, model, x, "dp_tp", "conv.")


class ConvAvgPool(torch.nn.Module):
    """A convolution, an average pool (padded, rounding up, not counting the padding: every
    argument the backward is given) and a 1x1 convolution: Funnel's and MaxViT's pools."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.pool = torch.nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.head = torch.nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(F.silu(self.conv(x))))


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
def test_average_pooling_trains_like_one_device(sim, layout):
    """The pool's backward (``avg_pool2d_backward``, for which DTensor has no rule: a ``PlanError``)
    split over the batch, and on dp x tp also over the channels the first convolution splits."""
    torch.manual_seed(0)
    model, x = ConvAvgPool(), torch.randn(4, 3, 9, 9)
    _assert_trains_like_one_device(sim, model, x, layout, "conv.")


class PoolsAndPads(torch.nn.Module):
    """Convolutions around the per-example ops whose backwards DTensor has no rule for (nor PyTorch a
    decomposition of), over 3 spatial dims (MONAI's DenseNet121 and ResNet max pools, BasicUNet's
    replication padding) or 2 (and 1): replication padding, a max pool (its backward takes the
    indices of the maxima), adaptive max and average pools to sizes other than 1."""

    def __init__(self, spatial: int) -> None:
        super().__init__()
        conv, nn = (torch.nn.Conv3d, torch.nn) if spatial == 3 else (torch.nn.Conv2d, torch.nn)
        self.spatial = spatial
        self.conv = conv(3, 8, 3)
        self.pad = nn.ReplicationPad3d(1) if spatial == 3 else nn.ReplicationPad2d((1, 2, 0, 1))
        self.pool = nn.MaxPool3d(3, stride=2, padding=1) if spatial == 3 else nn.AdaptiveMaxPool2d((3, 2))
        self.average = nn.AdaptiveAvgPool3d((2, 3, 2)) if spatial == 3 else nn.AdaptiveAvgPool2d((2, 3))
        self.head = conv(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(F.silu(self.conv(self.pad(x))))
        if self.spatial == 3:
            y = y + F.adaptive_max_pool3d(y, y.shape[2:])
        else:  # (replication padding of the last dim alone: [N, C*H, W])
            n, c, h, w = y.shape
            y = F.pad(y.reshape(n, c * h, w), (1, 1), mode="replicate")[..., 1:-1].reshape(n, c, h, w)
        return self.head(self.average(y))


@pytest.mark.parametrize("layout", ["dp", "dp_tp"])
@pytest.mark.parametrize("spatial", [2, 3])
def test_pools_and_pads_train_like_one_device(sim, spatial, layout):
    """Their backwards split over the batch, and on dp x tp also over the channels the first
    convolution splits (a PlanError on every layout before)."""
    torch.manual_seed(0)
    model, x = PoolsAndPads(spatial), torch.randn(4, 3, *([7] * spatial))
    _assert_trains_like_one_device(sim, model, x, layout, "conv.")


def test_a_shard_is_laid_out_as_the_traced_value():
    """A materialised broadcast is a broadcast again (stride 0, same values); a row-major shard of
    a value the trace stored transposed is stored transposed; a shard already laid out so is
    passed as it is (no copy)."""
    mask = torch.randn(1, 1, T, T)
    traced = mask.expand(B, 1, T, T)
    local = traced[:2].contiguous()
    out = _traced_layout(local, traced)
    assert out.stride(0) == 0 and torch.equal(out, local)

    traced = torch.randn(8, 6).t()  # stored [6, 8] column-major
    local = traced[:3].contiguous()  # a row-major shard of it
    out = _traced_layout(local, traced)
    assert out.stride() == (1, 3) and torch.equal(out, local)

    assert _traced_layout(out, traced) is out

    traced = torch.randn(B, 1, T, D).expand(B, H, T, D)  # one head broadcast to H (stride 0)
    local = traced[:, : H // 2]  # a shard of it, a broadcast too: passed as it is (its own storage and strides)
    out = _traced_layout(local, traced)
    assert out.stride() == local.stride() and out.data_ptr() == local.data_ptr()


def test_a_one_row_shard_is_strided_as_the_traced_order_in_a_program_traced_on_fake_tensors():
    """A shard of one image of a channels-last batch, as a view of a transposed value gives it on
    the CPU: batch stride 16 where the format's is 256, which CPU group norm refuses. The program a
    real run executes is traced on fake tensors, whose one-row stride there is the format's, so the
    layout step must restride it whatever the traced strides: the traced program runs group norm on
    the real shard and equals it on a plain copy."""
    traced = torch.empty(4, 16, 4, 4).to(memory_format=torch.channels_last)
    real = torch.randn(1, 16, 16).transpose(1, 2).view(1, 16, 4, 4)
    assert real.stride() == (16, 1, 64, 16)
    weight, bias = torch.randn(16), torch.randn(16)

    def norm(x):
        return torch.ops.aten.native_group_norm(_traced_layout(x, traced), weight, bias, 1, 16, 16, 4, 1e-5)[0]

    fake_like = torch.empty_strided((1, 16, 4, 4), (256, 1, 64, 16))
    program = _compat.trace_fake(norm, [fake_like])  # (as lower.compile_local traces a rank's program)
    torch.testing.assert_close(program(real), F.group_norm(real.contiguous(), 4, weight, bias))
