"""Schedules: functions of the step count (optax's schedules, same names and arguments).

A schedule maps the number of updates already done (``0`` for the first update; an int or a
0-d tensor) to a 0-d float64 tensor. They are built from tensor ops only, so a schedule inside a
traced step reads the count from the optimizer state without a host sync.

Example::

    >>> lr = vsf.optim.warmup_cosine_decay(0.0, 3e-4, warmup_steps=100, decay_steps=10_000)
    >>> float(lr(100))
    0.0003
    >>> tx = vsf.optim.adamw(lr)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["Schedule", "constant", "cosine_decay", "linear", "warmup_cosine_decay"]

Schedule = Callable[[int | torch.Tensor], torch.Tensor]


def _steps(count: int | torch.Tensor) -> torch.Tensor:
    return (
        count.to(torch.float64) if isinstance(count, torch.Tensor) else torch.tensor(float(count), dtype=torch.float64)
    )


def constant(value: float) -> Schedule:
    """``value`` at every step (optax's ``constant_schedule``).

    Example::

        >>> float(vsf.optim.constant(0.1)(7))
        0.1
    """
    return lambda count: torch.full_like(_steps(count), value)


def linear(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """From ``init_value`` to ``end_value`` linearly over ``transition_steps`` steps starting at
    ``transition_begin``, constant outside (optax's ``linear_schedule``; torch's ``LinearLR`` with
    ``start_factor = init/base``, ``end_factor = end/base``, ``total_iters = transition_steps``).

    Example::

        >>> float(vsf.optim.linear(1.0, 0.0, transition_steps=10)(5))
        0.5
    """
    if transition_steps <= 0:
        return constant(init_value)

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        done = (_steps(count) - transition_begin).clamp(0, transition_steps)
        return (init_value - end_value) * (1 - done / transition_steps) + end_value

    return schedule


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0) -> Schedule:
    """``init_value * ((1 - alpha) * c**exponent + alpha)`` with ``c = (1 + cos(pi * t / decay_steps)) / 2``,
    ``t`` capped at ``decay_steps`` (optax's ``cosine_decay_schedule``; torch's ``CosineAnnealingLR``
    with ``T_max = decay_steps``, ``eta_min = alpha * init_value`` when ``exponent == 1``).

    Example::

        >>> float(vsf.optim.cosine_decay(1.0, decay_steps=10)(5))
        0.5
    """
    if decay_steps <= 0:
        raise ValueError(f"cosine_decay needs decay_steps > 0, got {decay_steps}")

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        t = _steps(count).clamp(max=decay_steps)
        c = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * c**exponent + alpha)

    return schedule


def warmup_cosine_decay(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value`` over ``warmup_steps``, then cosine decay
    to ``end_value``; ``decay_steps`` counts the warmup too (optax's ``warmup_cosine_decay_schedule``).

    Example::

        >>> lr = vsf.optim.warmup_cosine_decay(0.0, 1.0, warmup_steps=10, decay_steps=110)
        >>> float(lr(10)), float(lr(60))
        (1.0, 0.5)
    """
    if not 0 <= warmup_steps < decay_steps:
        raise ValueError(
            f"warmup_cosine_decay needs 0 <= warmup_steps < decay_steps, got {warmup_steps} and {decay_steps}"
        )
    alpha = 0.0 if peak_value == 0 else end_value / peak_value
    warmup = linear(init_value, peak_value, warmup_steps)
    decay = cosine_decay(peak_value, decay_steps - warmup_steps, alpha=alpha, exponent=exponent)

    def schedule(count: int | torch.Tensor) -> torch.Tensor:
        t = _steps(count)
        return torch.where(t < warmup_steps, warmup(t), decay(t - warmup_steps))

    return schedule
