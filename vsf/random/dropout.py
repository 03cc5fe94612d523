"""Dropout with a mask drawn from a key: the same elements dropped on every layout.

:func:`dropout` is ``vsf.nn.dropout``; :func:`keep_mask` is its mask, which
:class:`vsf.random.keyed` also gives torch's own dropout ops, so ``F.dropout`` under ``keyed`` and
``vsf.nn.dropout`` on the same key drop the same elements.

Example::

    >>> y = vsf.random.dropout.dropout(vsf.random.key(0), torch.ones(4, 4), 0.5)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from vsf.random import samplers
from vsf.sharding.named import sharding_of

__all__ = ["dropout", "keep_mask"]


def keep_mask(key: torch.Tensor, x: torch.Tensor, rate: float) -> torch.Tensor:
    """``True`` where dropout at ``rate`` keeps an element of ``x`` (probability ``1 - rate``), laid
    out like ``x`` (a DTensor's sharding eagerly; inside :func:`vsf.jit` the planner's layout of ``x``).

    Example::

        >>> keep = keep_mask(key, x, 0.1)
    """
    k = key if isinstance(x, DTensor) else key.to(x.device)
    return samplers.sample(
        k,
        tuple(x.shape),
        1,
        samplers.bernoulli_transform(1.0 - rate),
        torch.bool,
        sharding_of(x),
        "vsf.nn.dropout",
        like=x,
    )


def dropout(key: torch.Tensor, x: torch.Tensor, rate: float, deterministic: bool = False) -> torch.Tensor:
    """Zero each element of ``x`` with probability ``rate`` and scale the rest by ``1 / (1 - rate)``
    (``torch.nn.functional.dropout``'s and flax's ``Dropout``'s meaning), the mask drawn from ``key``.

    The mask is a pure function of (key, index), so every layout of ``x`` (a DTensor's own
    sharding eagerly, the planner's inside :func:`vsf.jit`) drops the same elements.
    ``deterministic=True`` (evaluation) returns ``x``. Example::

        >>> h = vsf.nn.dropout(vsf.random.fold_in(key, layer), h, 0.1)
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"vsf.nn.dropout needs 0 <= rate <= 1, got {rate}")
    if deterministic or rate == 0.0:
        return x
    if rate == 1.0:
        return torch.zeros_like(x)
    return x * keep_mask(key, x, rate) * (1.0 / (1.0 - rate))
