"""Initialisers with JAX's names and calling convention, on keyed, sharding-invariant samplers.

Each factory (``normal(0.02)``, ``kaiming_uniform(a=math.sqrt(5))`` ...) returns an initialiser
``init(key, shape, dtype=None, *, sharding=None)``; ``zeros`` and ``ones`` are initialisers
themselves (as in ``jax.nn.initializers``). They live under ``vsf.nn.initializers`` because
that is where JAX users look, and take ``sharding=`` like every :mod:`vsf.random` sampler, so
:func:`vsf.random.init_sharded` builds each parameter directly in its layout.

Fans follow torch's weight layout ``(out, in, *kernel)`` (``torch.nn.init``'s
``_calculate_fan_in_and_fan_out``), not JAX's ``(..., in, out)``: ``fan_in = shape[1] *
receptive``, ``fan_out = shape[0] * receptive``; ``xavier_*`` / ``kaiming_*`` take torch's
arguments and give torch's bounds and standard deviations (``glorot_*`` / ``he_*`` are JAX's
names for them).

Example::

    >>> w = vsf.nn.initializers.xavier_uniform()(vsf.random.key(0), (256, 128))
    >>> b = vsf.nn.initializers.zeros(vsf.random.key(0), (256,))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from vsf import _compat
from vsf.random import samplers
from vsf.random.bits import Transform
from vsf.random.samplers import Sharding
from vsf.sharding.named import resolve

__all__ = [
    "constant",
    "glorot_normal",
    "glorot_uniform",
    "he_normal",
    "he_uniform",
    "kaiming_normal",
    "kaiming_uniform",
    "lecun_normal",
    "normal",
    "ones",
    "truncated_normal",
    "uniform",
    "variance_scaling",
    "xavier_normal",
    "xavier_uniform",
    "zeros",
]

Initializer = Callable[..., torch.Tensor]


def constant(value: float) -> Initializer:
    """Every element ``value`` (the key is not used).

    Example::

        >>> ln_bias = vsf.nn.initializers.constant(0.0)(key, (768,))
    """

    def init(
        key: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None, *, sharding: Sharding = None
    ) -> torch.Tensor:
        dtype = dtype or torch.get_default_dtype()
        shape = tuple(shape)
        if sharding is None:
            return torch.full(shape, value, dtype=dtype)
        s = resolve(sharding, "vsf.nn.initializers.constant")
        s.check(shape)
        if _compat.fake_mode_active():
            return torch.full(shape, value, dtype=dtype)
        return samplers.build(
            shape, dtype, s, lambda r, device: torch.full(s.shard_shape(shape, r), value, dtype=dtype, device=device)
        )

    return init


zeros = constant(0.0)
ones = constant(1.0)


def normal(stddev: float = 1e-2) -> Initializer:
    """``stddev * N(0, 1)`` (JAX's ``normal``). Example::

    >>> w = vsf.nn.initializers.normal(0.02)(key, (768, 768))
    """

    def init(
        key: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None, *, sharding: Sharding = None
    ) -> torch.Tensor:
        dtype = samplers.float_dtype(dtype, "vsf.nn.initializers.normal")
        return _draw(key, shape, dtype, sharding, samplers.normal_transform(dtype), stddev)

    return init


def truncated_normal(stddev: float = 1e-2, lower: float = -2.0, upper: float = 2.0) -> Initializer:
    """``stddev * N(0, 1)`` truncated to ``[lower, upper]`` (in standard deviations; JAX's
    ``truncated_normal``; torch's ``trunc_normal_(std=s, a=lower*s, b=upper*s)``). Example::

        >>> w = vsf.nn.initializers.truncated_normal(0.02)(key, (768, 768))
    """

    def init(
        key: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None, *, sharding: Sharding = None
    ) -> torch.Tensor:
        dtype = samplers.float_dtype(dtype, "vsf.nn.initializers.truncated_normal")
        return _draw(key, shape, dtype, sharding, samplers.truncated_normal_transform(dtype, lower, upper), stddev)

    return init


def uniform(scale: float = 1e-2) -> Initializer:
    """Uniform on ``[0, scale)`` (JAX's ``uniform``). Example::

    >>> w = vsf.nn.initializers.uniform(0.1)(key, (16, 16))
    """

    def init(
        key: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None, *, sharding: Sharding = None
    ) -> torch.Tensor:
        return samplers.uniform(key, shape, dtype, 0.0, scale, sharding=sharding)

    return init


def _draw(
    key: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, sharding: Sharding, transform: Transform, factor: float
) -> torch.Tensor:
    """``factor`` times a sample, scaled per element (any layout, ragged ones too)."""
    where = "vsf.nn.initializers"
    return samplers.sample(
        key, shape, samplers.width(dtype), samplers.scaled(transform, factor, dtype), dtype, sharding, where
    )


def _fans(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) < 2:
        raise ValueError(
            f"fan-based initialisers need a weight of rank >= 2 (torch's (out, in, *kernel)), got shape {tuple(shape)}"
        )
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def variance_scaling(scale: float, mode: str, distribution: str) -> Initializer:
    """Samples of variance ``scale / n``, ``n`` the fan given by ``mode`` (``"fan_in"``,
    ``"fan_out"``, ``"fan_avg"``), from ``distribution`` (``"truncated_normal"`` on ``[-2, 2]``
    rescaled to that variance, ``"normal"``, ``"uniform"``): JAX's ``variance_scaling`` with torch's fans.

    Example::

        >>> init = vsf.nn.initializers.variance_scaling(2.0, "fan_in", "normal")   # he_normal
    """
    if mode not in ("fan_in", "fan_out", "fan_avg"):
        raise ValueError(f"variance_scaling mode must be 'fan_in', 'fan_out' or 'fan_avg', got {mode!r}")
    if distribution not in ("truncated_normal", "normal", "uniform"):
        raise ValueError(
            f"variance_scaling distribution must be 'truncated_normal', 'normal' or 'uniform', got {distribution!r}"
        )

    def init(
        key: torch.Tensor, shape: Sequence[int], dtype: torch.dtype | None = None, *, sharding: Sharding = None
    ) -> torch.Tensor:
        fan_in, fan_out = _fans(tuple(shape))
        n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[mode]
        variance = scale / max(n, 1)
        if distribution == "uniform":
            bound = math.sqrt(3.0 * variance)
            return samplers.uniform(key, shape, dtype, -bound, bound, sharding=sharding)
        dtype = samplers.float_dtype(dtype, "vsf.nn.initializers.variance_scaling")
        if distribution == "normal":
            return _draw(key, shape, dtype, sharding, samplers.normal_transform(dtype), math.sqrt(variance))
        # 0.8796... is the standard deviation of N(0, 1) truncated to [-2, 2]
        transform = samplers.truncated_normal_transform(dtype, -2.0, 2.0)
        return _draw(key, shape, dtype, sharding, transform, math.sqrt(variance) / 0.87962566103423978)

    return init


def xavier_uniform(gain: float = 1.0) -> Initializer:
    """torch's ``xavier_uniform_``: uniform on ``±gain * sqrt(6 / (fan_in + fan_out))``."""
    return variance_scaling(gain**2, "fan_avg", "uniform")


def xavier_normal(gain: float = 1.0) -> Initializer:
    """torch's ``xavier_normal_``: ``N(0, gain**2 * 2 / (fan_in + fan_out))``."""
    return variance_scaling(gain**2, "fan_avg", "normal")


def kaiming_uniform(a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Initializer:
    """torch's ``kaiming_uniform_``: uniform on ``±gain * sqrt(3 / fan)``;
    ``kaiming_uniform(a=math.sqrt(5))`` is ``nn.Linear``'s weight init."""
    return variance_scaling(torch.nn.init.calculate_gain(nonlinearity, a) ** 2, mode, "uniform")


def kaiming_normal(a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Initializer:
    """torch's ``kaiming_normal_``: ``N(0, gain**2 / fan)``."""
    return variance_scaling(torch.nn.init.calculate_gain(nonlinearity, a) ** 2, mode, "normal")


def lecun_normal() -> Initializer:
    """JAX's ``lecun_normal``: truncated normal of variance ``1 / fan_in``."""
    return variance_scaling(1.0, "fan_in", "truncated_normal")


glorot_uniform, glorot_normal = xavier_uniform, xavier_normal
he_uniform = lambda: kaiming_uniform(nonlinearity="relu")  # noqa: E731  (JAX's name: variance 2 / fan_in)
he_normal = lambda: kaiming_normal(nonlinearity="relu")  # noqa: E731
