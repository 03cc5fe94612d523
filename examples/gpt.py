"""A small GPT (decoder-only transformer) as a plain PyTorch module, and the data it learns.

The model is bias-free (like most current LLMs), pre-LayerNorm, with learned positions and the
output layer tied to the token embedding. vsf never sees the module itself: it trains the
params pytree ``vsf.tree.from_module(model)`` and runs the module through
``vsf.tree.apply(model, params, ...)``.

The data is generated, never downloaded: each sequence repeats a random pattern of a few
tokens, so after the first period every next token can be copied from one period back (the
"induction" task small transformers learn first). The batch of step ``s`` is a pure function
of ``(seed, s)``, so a resumed run sees exactly the data an uninterrupted run would.

Example::

    >>> cfg = GPTConfig(vocab=64, seq=32, dim=64, heads=4, layers=2)
    >>> model = GPT(cfg)
    >>> idx, targets = batch_at(step=0, batch=8, cfg=cfg)
    >>> model(idx, targets)            # mean cross-entropy, about log(64) = 4.16 at init
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

__all__ = ["GPT", "GPTConfig", "batch_at", "floor_loss", "pipeline_stages"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model and of its task (``period``: the longest repeated pattern)."""

    vocab: int = 64
    seq: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 2
    period: int = 8

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} must be a multiple of heads {self.heads}")
        if not 2 <= self.period <= self.seq:
            raise ValueError(f"period must be in [2, seq={self.seq}], got {self.period}")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        y = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim, bias=False)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim, bias=False)
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """``GPT(cfg)(idx, targets)`` is the mean next-token cross-entropy of the batch."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.lnf = nn.LayerNorm(cfg.dim, bias=False)
        # GPT-2's init, from a generator of its own so the params depend only on (cfg, seed)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.ndim == 2:
                    residual = name.endswith(("proj.weight", "fc2.weight"))
                    p.normal_(0.0, 0.02 / math.sqrt(2 * cfg.layers) if residual else 0.02, generator=gen)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lnf(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t))


def batch_at(step: int, batch: int, cfg: GPTConfig, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(inputs, targets)`` of training step ``step``: ``batch`` sequences of ``cfg.seq`` tokens.

    Sequence ``i`` repeats a random pattern of ``2 .. cfg.period`` tokens; targets are the inputs
    shifted by one. A pure function of ``(step, batch, cfg, seed)``.
    """
    # Python's generator, not torch's: under vsf.simulate a torch draw would run once per
    # simulated rank and give each rank a different batch.
    rng = random.Random(seed * 1_000_003 + step)
    rows = []
    for _ in range(batch):
        pattern = [rng.randrange(cfg.vocab) for _ in range(rng.randint(2, cfg.period))]
        rows.append([pattern[i % len(pattern)] for i in range(cfg.seq + 1)])
    tokens = torch.tensor(rows)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def floor_loss(cfg: GPTConfig) -> float:
    """The loss of a perfect copier: a pattern's first period is unpredictable (``log vocab`` each
    token), every later token is certain. Averaged over the pattern lengths ``2 .. period``."""
    periods = range(2, cfg.period + 1)
    return sum((p - 1) / cfg.seq for p in periods) / len(periods) * math.log(cfg.vocab)


def pipeline_stages(model: GPT, stages: int) -> tuple[list[Any], Any, list[list[str]]]:
    """``model`` cut into ``stages`` pipeline stages of consecutive blocks: the stage functions
    ``f(params, x) -> y`` (the first takes the token ids, the last returns the logits), the loss
    of the logits, and each stage's key-path prefixes. ``wte.weight`` is used by the first stage
    (the embedding) and the last (the tied output layer): pass ``tied=("wte.weight",)``.

    Example::

        >>> fns, loss, prefixes = pipeline_stages(GPT(GPTConfig(layers=4)), 2)
        >>> prefixes
        [['wte.', 'wpe.', 'blocks.0.', 'blocks.1.'], ['blocks.2.', 'blocks.3.', 'lnf.', 'wte.']]
    """
    n = model.cfg.layers
    if not 1 <= stages <= n:
        raise ValueError(f"{stages} stages for {n} blocks: each stage needs at least one block")
    bounds = [n * s // stages for s in range(stages + 1)]

    def sub(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}

    def make(s: int) -> Any:
        def stage(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            if s == 0:
                t = x.shape[1]
                x = functional_call(model.wte, sub(params, "wte."), (x,)) + functional_call(
                    model.wpe, sub(params, "wpe."), (torch.arange(t, device=x.device),)
                )
            for i in range(bounds[s], bounds[s + 1]):
                x = functional_call(model.blocks[i], sub(params, f"blocks.{i}."), (x,))
            if s == stages - 1:
                x = functional_call(model.lnf, sub(params, "lnf."), (x,)) @ params["wte.weight"].t()
            return x

        stage.__name__ = stage.__qualname__ = f"gpt_stage{s}"
        return stage

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    prefixes = [[f"blocks.{i}." for i in range(bounds[s], bounds[s + 1])] for s in range(stages)]
    prefixes[0] = ["wte.", "wpe.", *prefixes[0]]
    prefixes[-1] = [*prefixes[-1], "lnf.", *(["wte."] if stages > 1 else [])]
    return [make(s) for s in range(stages)], loss, prefixes
