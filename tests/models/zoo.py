"""Tiny Hugging Face ``transformers`` models built from configs in code (random weights, no hub),
their Megatron tensor-parallel rules, and the jitted train step the conformance zoo runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

VOCAB, SEQ, BATCH, HIDDEN = 96, 16, 4, 32


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: how to build it, how to make a batch for it, its TP rules."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]
    tp_rules: tuple[tuple[str, Any], ...]


def _causal_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids}


def _masked_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.where(torch.rand(BATCH, SEQ, generator=g) < 0.3, ids, -100)
    return {"input_ids": ids, "labels": labels}


def _seq2seq_batch(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "labels": torch.randint(0, VOCAB, (BATCH, SEQ // 2), generator=g),
    }
