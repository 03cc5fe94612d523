"""The zoo beyond ``transformers``: models of other libraries no one here wrote (x-transformers'
decoder language model, diffusers' DiT and UNet, mamba.py's Mamba, torch's own ``nn.TransformerEncoder``
and linears reparametrized by ``torch.nn.utils.parametrize``: weight norm, nViT's unit rows),
built from tiny configs in code
(random weights, no hub), each trained a few steps through ``vsf.jit`` on dp x Megatron TP (the
UNet on DP; the first step in checking mode, ``step.check``, which must find no op whose sharded
result differs from one device's) and, in the sweep (``sweep`` marker), on its other layouts, against the same model trained by
plain PyTorch (``torch.optim.AdamW``) on one device, params compared after the steps (the zoo's
train step, oracle and tolerances: :mod:`zoo`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import zoo

from vsf import P

IMAGE, CHANNELS, PATCH, CLASSES = 8, 4, 2, 10


def _x_transformers() -> torch.nn.Module:
    """x-transformers' decoder-only language model (its defaults: absolute positions, pre-norm
    LayerNorm, its own einsum attention, GELU feed-forward) with its own autoregressive loss
    (``AutoregressiveWrapper``: each position predicts the next token)."""
    from x_transformers import AutoregressiveWrapper, Decoder, TransformerWrapper

    return AutoregressiveWrapper(
        TransformerWrapper(
            num_tokens=zoo.VOCAB,
            max_seq_len=2 * zoo.SEQ,
            attn_layers=Decoder(
                dim=zoo.HIDDEN, depth=zoo.LAYERS, heads=zoo.HEADS, attn_dim_head=zoo.HIDDEN // zoo.HEADS
            ),
        )
    )


def _tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"x": torch.randint(0, zoo.VOCAB, (zoo.BATCH, zoo.SEQ + 1), generator=g)}


def _own_loss(run: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return run(**batch)


def _dit() -> torch.nn.Module:
    """diffusers' class-conditional DiT (adaLN-zero blocks, patch embedding with a fixed 2D
    sin-cos position buffer). Its class-label dropout draws from torch's generator in training,
    which vsf refuses unkeyed: it is off (``dropout_prob = 0``)."""
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(
        num_attention_heads=zoo.HEADS,
        attention_head_dim=zoo.HIDDEN // zoo.HEADS,
        in_channels=CHANNELS,
        num_layers=zoo.LAYERS,
        sample_size=IMAGE,
        patch_size=PATCH,
        num_embeds_ada_norm=CLASSES,
    )
    for block in model.transformer_blocks:
        block.norm1.emb.class_embedder.dropout_prob = 0.0
    return model


def _noisy_images(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "images": torch.randn(zoo.BATCH, CHANNELS, IMAGE, IMAGE, generator=g),
        "timesteps": torch.randint(0, 1000, (zoo.BATCH,), generator=g),
        "labels": torch.randint(0, CLASSES, (zoo.BATCH,), generator=g),
        "noise": torch.randn(zoo.BATCH, CHANNELS, IMAGE, IMAGE, generator=g),
    }


def _denoising_loss(run: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The noise-prediction loss: the model's prediction against the noise."""
    out = run(batch["images"], timestep=batch["timesteps"], class_labels=batch["labels"]).sample
    return F.mse_loss(out, batch["noise"])


def _unet() -> torch.nn.Module:
    """diffusers' UNet2DModel (DDPM's denoiser): residual blocks of convolutions, GroupNorm and
    time embeddings, self-attention at the lower resolution, down- and upsampling (nearest). Group
    norm on a batch shard called the local op with the global batch size until it ran through
    DTensor's dispatcher (``Expected X.numel() == N * C * HxW``)."""
    from diffusers import UNet2DModel

    return UNet2DModel(
        sample_size=IMAGE,
        in_channels=CHANNELS,
        out_channels=CHANNELS,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        attention_head_dim=8,
    )


def _unet_loss(run: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The noise-prediction loss of an unconditional denoiser (the batch's labels unused)."""
    return F.mse_loss(run(batch["images"], timestep=batch["timesteps"]).sample, batch["noise"])


def _mamba() -> torch.nn.Module:
    """mamba.py's Mamba: selective state-space blocks (no attention), the scan over the sequence
    run in parallel (Blelloch's, an ``autograd.Function`` with in-place steps), between an
    embedding and an output layer as its ``LM`` puts them (``mambapy.lm`` itself imports the
    CUDA-only ``mamba_ssm``)."""
    from mambapy.mamba import Mamba, MambaConfig, RMSNorm

    return torch.nn.Sequential(
        torch.nn.Embedding(zoo.VOCAB, zoo.HIDDEN),
        Mamba(MambaConfig(d_model=zoo.HIDDEN, n_layers=zoo.LAYERS, d_state=8)),
        RMSNorm(zoo.HIDDEN),
        torch.nn.Linear(zoo.HIDDEN, zoo.VOCAB, bias=False),
    )


class _TorchEncoder(torch.nn.Module):
    """torch's own ``nn.TransformerEncoder`` (pre-norm layers, causal): ``nn.MultiheadAttention``
    with its q, k and v projections packed in one ``in_proj_weight`` (whose rows Megatron's
    column split cuts across q and k), between an embedding and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(zoo.VOCAB, zoo.HIDDEN)
        layer = torch.nn.TransformerEncoderLayer(
            zoo.HIDDEN, zoo.HEADS, zoo.FFN, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, zoo.LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(zoo.HIDDEN, zoo.VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.emb(tokens), mask=mask, is_causal=True))


class _UnitRows(torch.nn.Module):
    """vit-pytorch's nViT ``NormLinear`` as a parametrization: each row of the weight scaled to unit length."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return F.normalize(w, dim=-1)


class _Parametrized(torch.nn.Module):
    """Linears reparametrized through ``torch.nn.utils.parametrize`` (a module of a class made for
    it, which refuses to be copied the pickling way, ``copy.copy``): torch's own ``weight_norm``
    (a magnitude ``original0`` and a direction ``original1``, normed over each output's inputs,
    which a row-parallel split cuts) in residual MLP blocks, and a head of unit rows (nViT's)."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.utils import parametrize
        from torch.nn.utils.parametrizations import weight_norm

        self.emb = torch.nn.Embedding(zoo.VOCAB, zoo.HIDDEN)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                weight_norm(torch.nn.Linear(zoo.HIDDEN, zoo.FFN)),
                torch.nn.GELU(),
                weight_norm(torch.nn.Linear(zoo.FFN, zoo.HIDDEN)),
            )
            for _ in range(zoo.LAYERS)
        )
        self.head = torch.nn.Linear(zoo.HIDDEN, zoo.VOCAB, bias=False)
        parametrize.register_parametrization(self.head, "weight", _UnitRows())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = x + block(x)
        return 4 * self.head(x)


def _causal_tokens(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, zoo.VOCAB, (zoo.BATCH, zoo.SEQ), generator=g)}


def _next_token_loss(run: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return zoo.causal_lm_loss(run(batch["tokens"]), batch["tokens"])


FAMILIES = {
    f.name: f
    for f in [
        zoo.Family(
            "x_transformers",
            _x_transformers,
            _tokens,
            zoo.megatron(r"to_q|to_k|to_v|ff\.0\.0", r"to_out|ff\.2", r"net\.token_emb\.emb|net\.to_logits"),
            _own_loss,
        ),
        zoo.Family(
            "dit",
            _dit,
            _noisy_images,
            zoo.megatron(
                r"attn1\.to_q|attn1\.to_k|attn1\.to_v|ff\.net\.0\.proj",
                r"attn1\.to_out\.0|ff\.net\.2",
                r"pos_embed\.proj",
            ),
            _denoising_loss,
        ),
        zoo.Family(
            "mamba",
            _mamba,
            _causal_tokens,
            # the fused in_proj's x and z halves, the depthwise convolution's channels, the state
            # matrix A and skip D split over the inner width; x_proj and out_proj row-parallel
            zoo.megatron(
                r"in_proj|dt_proj",
                r"x_proj|out_proj",
                r"0|3",
                also=((r".*conv1d\.(weight|bias)", P("tp")), (r".*A_log", P("tp", None)), (r".*mixer\.D", P("tp"))),
            ),
            _next_token_loss,
        ),
        zoo.Family(
            "torch_nn",
            _TorchEncoder,
            _causal_tokens,
            zoo.megatron(r"in_proj|linear1", r"out_proj|linear2", r"emb|head"),
            _next_token_loss,
        ),
        zoo.Family(
            "parametrized",
            _Parametrized,
            _causal_tokens,
            zoo.megatron(
                "-",
                "-",
                "emb",
                also=(
                    (r"blocks\.\d+\.0\.parametrizations\.weight\.original[01]", P("tp", None)),
                    (r"blocks\.\d+\.0\.bias", P("tp")),
                    (r"blocks\.\d+\.2\.parametrizations\.weight\.original1", P(None, "tp")),
                    (r"head\.parametrizations\.weight\.original", P("tp", None)),
                ),
            ),
            _next_token_loss,
        ),
        # a convolutional net: data parallel only (no Megatron rules: the convolutions stay whole)
        zoo.Family("unet", _unet, _noisy_images, ((r".*", P()),), _unet_loss),
    ]
}
# each family's default layout (with one step in checking mode) runs by default; its others are the sweep
DEFAULT = {
    "x_transformers": "dp_tp",
    "dit": "dp_tp",
    "mamba": "dp_tp",
    "torch_nn": "dp_tp",
    "parametrized": "dp_tp",
    "unet": "dp",
}
LAYOUTS = {"unet": ("dp", "fsdp")}
CASES = [
    pytest.param(name, layout, marks=() if layout == DEFAULT[name] else pytest.mark.sweep, id=f"{name}-{layout}")
    for name in FAMILIES
    for layout in LAYOUTS.get(name, ("dp_tp", "dp", "fsdp"))
]


@functools.cache
def _oracle(name: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    return zoo.torch_run(FAMILIES[name])


@pytest.mark.parametrize("name, layout", CASES)
def test_trains_like_torch_on_one_device(sim, name, layout):
    want = _oracle(name)
    losses, params, step = zoo.jit_train(FAMILIES[name], layout, sim, check=layout == DEFAULT[name])
    assert step.plan_count == 1
    zoo.assert_like_oracle(f"{name} {layout}", losses, params, want)


def test_dit_blocks_share_a_trace_across_their_attention_processors(sim, monkeypatch):
    """Three blocks of diffusers' DiT: each block's ``Attention`` holds an ``AttnProcessor2_0`` of
    its own, which its forward reads; a stateless object of one class is keyed by that class, so
    the second and third blocks are stamped from one trace (the first reads its input with other
    strides: a trace of its own). The stamped step trains as PyTorch on one device, and plans the
    bytes and collectives of every block traced the plain way."""
    import vsf

    monkeypatch.setattr(zoo, "LAYERS", 3)
    family = FAMILIES["dit"]
    want = zoo.torch_run(family)
    losses, params, _ = zoo.jit_train(family, "dp_tp", sim)
    zoo.assert_like_oracle("dit, 3 blocks", losses, params, want)
    stamped, plan = zoo.lowered(family, "dp_tp")
    assert stamped["BasicTransformerBlock"] == (1, 2)
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    plain, traced = zoo.lowered(family, "dp_tp")
    assert "BasicTransformerBlock" not in plain
    assert (plan.cost().comm_bytes, plan.cost().collectives) == (traced.cost().comm_bytes, traced.cost().collectives)


def test_mamba_blocks_scanning_in_place_are_stamped_and_plan_as_traced_one_by_one(sim, monkeypatch):
    """mamba.py's residual blocks run their parallel scan in place, on tensors the block made
    itself: they are stamped from one trace (the writes functionalized with the step), and the
    step's graph and plan are those of every block traced the plain way. (That the stamped step
    trains as PyTorch does on one device: ``test_trains_like_torch_on_one_device[mamba-dp_tp]``.)"""
    import vsf
    from plan_checks import assert_same_plans

    sim(4, compute=False)
    stamped, plan = zoo.lowered(FAMILIES["mamba"], "dp_tp")
    assert stamped["ResidualBlock"] == (zoo.LAYERS,)
    monkeypatch.setattr(vsf.config, "stamp_blocks", False)
    plain, traced = zoo.lowered(FAMILIES["mamba"], "dp_tp")
    assert "ResidualBlock" not in plain
    assert_same_plans(plan, traced)


@pytest.mark.parametrize("name", ["x_transformers", "llama", pytest.param("mamba", marks=pytest.mark.sweep)])
def test_split_token_ids_are_held_where_gathering_them_would_move_the_activations(sim, monkeypatch, name):
    """x-transformers' decoder, transformers' Llama and (in the sweep) mamba.py's Mamba, with a
    vocabulary of 512 and batches of 4 sequences of 32 tokens, on 4 fsdp ranks with every weight
    split along a dim that is not its output's (the zoo's 5D rules, the tp axis of size 1): the
    token ids (1 KiB) are the cheapest value of the step to gather, the activations ([4, 32, 32]
    floats, 16 KiB each) dearer than most weights (4-8 KiB). The greedy pass gathered the ids for
    the embedding and the layers then moved activations, more than gathering each weight once and
    reducing each gradient to its shard sends (x-transformers: 442,314 B a rank against 359,244;
    Llama: 444,108 against 308,172; Mamba: 881,484 in 52 collectives against 297,804). The solver
    now also solves from the ids and labels held split and keeps the cheaper solution: the step
    sends no more than that FSDP plan (by hand: ``(n-1)/n`` of the params twice, and at most two
    scalar all-reduces for the mean loss), and trains like one device. (Planned at Llama 3 8B's
    sizes on 8 ranks, the step sent 21.6 GB a rank; from the held ids, 3.4 GB.)"""
    monkeypatch.setattr(zoo, "VOCAB", 512)
    monkeypatch.setattr(zoo, "SEQ", 32)
    family, shape, n = {**FAMILIES, "llama": zoo.uncached(zoo.families()["llama"])}[name], (1, 1, 4, 1, 1), 4
    fsdp = zoo.fsdp_bytes(zoo.built(family)[0].parameters(), n)
    losses, params, _ = zoo.jit_train(family, "5d", sim, shape=shape)
    zoo.assert_like_oracle(f"{name}, fsdp, 512 tokens", losses, params, zoo.torch_run(family))
    assert sum(zoo.lowered(family, "5d", shape)[1].cost().comm_bytes.values()) <= fsdp
