"""Neural-network helpers on keyed random numbers: :func:`dropout` and :mod:`vsf.nn.initializers`
(JAX's ``jax.nn.initializers`` home and names, torch's fan conventions).

Example::

    >>> y = vsf.nn.dropout(vsf.random.fold_in(key, step), x, 0.1)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from vsf.nn import initializers
from vsf.random import samplers
from vsf.sharding.named import sharding_of

__all__ = ["dropout", "initializers"]


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
    k = key if isinstance(x, DTensor) else key.to(x.device)
    keep = samplers.sample(k, tuple(x.shape), 1, samplers.bernoulli_transform(1.0 - rate), torch.bool, sharding_of(x), "vsf.nn.dropout", like=x)
    return x * keep * (1.0 / (1.0 - rate))
