"""Samplers: JAX's ``jax.random`` functions on keyed Philox bits, sharded or not.

Each takes a key first and, like JAX, a ``shape`` and ``dtype``; ``sharding`` (a
:class:`vsf.NamedSharding`, or a bare ``P`` under :func:`vsf.use_mesh`) returns a DTensor laid out
as it says, each rank computing only its own shard and nothing communicated; without it the
result is a plain tensor. The value of every element depends only on (key, global index, shape)
(:mod:`vsf.random.bits`), so any two layouts give the same numbers bit for bit.

Inside :func:`vsf.jit` a sampler is traced as elementwise integer ops over ``arange`` s, which
the planner shards like any elementwise op: the counters start from a zero tensor laid out as
``sharding`` (a ``with_sharding_constraint``), or for :func:`vsf.nn.dropout` shaped like its
input, so each rank computes only its own shard and nothing is communicated.

Floating samples are built from exact integer-to-float steps: a ``float32`` uniform has 24
random bits (the dtype's mantissa + 1, for ``float16``/``bfloat16`` too), a ``float64`` one 53.
``normal`` is ``sqrt(2) * erfinv(u)`` for ``u`` uniform on ``(-1, 1)`` (exact multiples of
``2**-24``), computed in ``float32`` (``float64`` for ``float64``) and cast. The integer
samplers and ``uniform``/``bernoulli`` are IEEE-exact on every device; ``normal`` and
``truncated_normal`` use ``torch.erfinv``, which is the same function at every position of a
tensor (so every layout agrees bit for bit) but whose last bit CPU and CUDA may compute
differently.

Example::

    >>> k = vsf.random.key(0)
    >>> full = vsf.random.normal(k, (8, 6))
    >>> with vsf.simulate(4):
    ...     mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    ...     w = vsf.random.normal(k, (8, 6), sharding=vsf.NamedSharding(mesh, P("dp", "tp")))
    ...     torch.equal(vsf.device_get(w), full)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from vsf import _compat, runtime
from vsf.ops import backend
from vsf.random import bits
from vsf.random.keys import check_key, key_words
from vsf.sharding.constraint import constrain
from vsf.sharding.named import NamedSharding, resolve
from vsf.sharding.put import device_put, from_local, local_device
from vsf.sharding.spec import PartitionSpec

__all__ = [
    "bernoulli",
    "bernoulli_transform",
    "build",
    "float_dtype",
    "normal",
    "normal_transform",
    "permutation",
    "randint",
    "sample",
    "scaled",
    "truncated_normal",
    "truncated_normal_transform",
    "uniform",
    "uniform_transform",
    "width",
]

Sharding = NamedSharding | PartitionSpec | None
_SQRT2 = math.sqrt(2.0)


def sample(
    key: torch.Tensor,
    shape: Sequence[int],
    width: int,
    transform: bits.Transform,
    dtype: torch.dtype,
    sharding: Sharding,
    where: str,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """``transform`` of each element's ``width`` Philox words over ``shape``, laid out as ``sharding``
    (the one entry point of every sampler). Inside a trace, ``like`` (a tensor of ``shape``, e.g.
    the input of a dropout) lends its layout to the sample's ops, so that each rank computes its
    own shard of them."""
    check_key(key, where)
    shape = _shape(shape, where)
    s = None if sharding is None else resolve(sharding, where)
    if s is not None:
        s.check(shape, where)
        if s.spec.unreduced:
            raise ValueError(
                f"{where}: a sample cannot be unreduced over {s.spec.unreduced} (its sharding is {s.spec!r})"
            )
    if _compat.fake_mode_active():
        return _traced(key, shape, width, transform, s, like)
    words = key_words(key, where)
    if s is None:
        return _replicated(_box(words, shape, None, width, transform, dtype, key.device))
    return _sharded(words, shape, s, width, transform, dtype)


def _shape(shape: Sequence[int], where: str) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    out = tuple(shape)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in out):
        raise ValueError(f"{where}: shape must be non-negative ints, got {shape!r}")
    return out


def _traced(
    key: torch.Tensor,
    shape: tuple[int, ...],
    width: int,
    transform: bits.Transform,
    s: NamedSharding | None,
    like: torch.Tensor | None,
) -> torch.Tensor:
    """The sample as elementwise ops over ``arange`` s. The counters start from a zero tensor laid
    out as ``s`` (or shaped like ``like``), so the planner computes every later op on shards
    instead of whole on every rank and slicing at the end."""
    flat = shape or (1,)
    row, col = bits.grid(flat, key.device)
    if like is not None:
        zero = torch.zeros_like(like, dtype=torch.int64).reshape(flat)
    else:
        zero = torch.zeros(flat, dtype=torch.int64, device=key.device)
        zero = zero if s is None else constrain(zero, s)
    out = bits.at(key, zero + row, col, flat[-1], width, transform).reshape(shape)
    return out if s is None else constrain(out, s)


def _box(
    words: tuple[int, int],
    shape: tuple[int, ...],
    box: Sequence[tuple[int, int]] | None,
    width: int,
    transform: bits.Transform,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    flat = shape or (1,)
    box = tuple(box) if box is not None else tuple((0, n) for n in flat)
    with _compat.local_mode_disabled():
        return bits.fill(words, flat, box, width, transform, dtype, device).reshape(
            [b - a for a, b in box] if shape else []
        )


def _replicated(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor; under :func:`vsf.simulate` the same value on every simulated rank."""
    if _compat.active_local_mode() is None:
        return t
    return _compat.make_local({r: t if i == 0 else t.clone() for i, r in enumerate(backend.local_ranks())})


def build(
    shape: Sequence[int], dtype: torch.dtype, s: NamedSharding, piece: Callable[[int, torch.device], torch.Tensor]
) -> torch.Tensor:
    """A DTensor of global ``shape`` laid out as ``s`` whose local shard on rank ``r`` is
    ``piece(r, device)`` (every simulated rank under :func:`vsf.simulate`, else this rank)."""
    shape = tuple(shape)
    device = local_device(s.mesh.device_type)
    mode = _compat.active_local_mode()
    pieces = {}
    for r in backend.local_ranks():
        if mode is None and r not in s.mesh.devices:
            pieces[r] = torch.empty((0,) * len(shape), dtype=dtype, device=device)
        else:
            pieces[r] = piece(r, device)
    return from_local(_compat.make_local(pieces) if mode is not None else pieces[runtime.rank()], s, shape)


def _sharded(
    words: tuple[int, int],
    shape: tuple[int, ...],
    s: NamedSharding,
    width: int,
    transform: bits.Transform,
    dtype: torch.dtype,
) -> torch.Tensor:
    return build(shape, dtype, s, lambda r, device: _shard(words, shape, s, r, width, transform, dtype, device))


def _shard(
    words: tuple[int, int],
    shape: tuple[int, ...],
    s: NamedSharding,
    rank: int,
    width: int,
    transform: bits.Transform,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Rank ``rank``'s shard: a box of the global index space, or for a ragged entry over every
    dim, a range of flat indices (:meth:`NamedSharding.index_view` rows)."""
    index = s.index(shape, rank)
    if s.ragged is None or s.ragged.dims < len(shape):
        view = tuple(s.index_view(torch.empty(shape, device="meta")).shape)
        return _box(words, view, [(sl.start, sl.stop) for sl in index], width, transform, dtype, device)
    with _compat.local_mode_disabled():
        flat = torch.arange(index[0].start, index[0].stop, device=device)
        return bits.at(words, flat // shape[-1], flat % shape[-1], shape[-1], width, transform)


# -- words to values ---------------------------------------------------------------------------


def float_dtype(dtype: torch.dtype | None, where: str) -> torch.dtype:
    """``dtype`` (default: torch's default dtype), which must be floating (``where`` names the caller)."""
    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise TypeError(f"{where} samples a floating dtype, got {dtype}")
    return dtype


def _unit(w: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Uniform on ``[0, 1)`` in ``dtype`` from an element's words (exact: k * 2**-bits)."""
    if dtype == torch.float64:
        return ((w[0] << 21) | (w[1] >> 11)).to(torch.float64) * 2.0**-53
    nbits = _precision(dtype)
    return ((w[0] >> (32 - nbits)).to(torch.float32) * 2.0**-nbits).to(dtype)


def _symmetric(w: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Uniform on the open ``(-1, 1)`` in ``dtype`` (float32 or float64): the odd multiples
    ``(2k + 1) * 2**-bits - 1`` of ``2**-bits`` for ``k`` uniform on ``[0, 2**(bits - 1))``. Each
    step is exact (``k`` and ``k * 2**(1 - bits)`` are ``dtype`` values, and so is the sum), so
    every device gives the same bits; the sum is in floating point, cheaper than on int64."""
    bits = 53 if dtype == torch.float64 else 24
    k = (
        w[0].bitwise_left_shift_(20).bitwise_or_(w[1].bitwise_right_shift_(12))
        if dtype == torch.float64
        else w[0].bitwise_right_shift_(8)
    )
    return (
        k.to(dtype).mul_(2.0 ** (1 - bits)).add_(2.0**-bits - 1)
    )  # in place on the words and the fresh cast: one temporary


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def uniform_transform(dtype: torch.dtype, minval: float = 0.0, maxval: float = 1.0) -> bits.Transform:
    """An element's words -> its ``uniform`` value on ``[minval, maxval)``."""
    if not maxval > minval:
        raise ValueError(f"vsf.random.uniform needs minval < maxval, got minval={minval}, maxval={maxval}")
    top = _below(maxval, dtype)

    def transform(w: Sequence[torch.Tensor]) -> torch.Tensor:
        u = _unit(w, dtype)
        if (minval, maxval) == (0.0, 1.0):
            return u
        return torch.clamp(u * (maxval - minval) + minval, minval, top)

    return transform


def normal_transform(dtype: torch.dtype) -> bits.Transform:
    """An element's words -> its standard ``normal`` value."""
    compute = _compute(dtype)
    return lambda w: _symmetric(w, compute).erfinv_().mul_(_SQRT2).to(dtype)


def truncated_normal_transform(dtype: torch.dtype, lower: float, upper: float) -> bits.Transform:
    """An element's words -> its ``truncated_normal`` value on ``[lower, upper]``."""
    if not upper > lower:
        raise ValueError(f"vsf.random.truncated_normal needs lower < upper, got lower={lower}, upper={upper}")
    compute = _compute(dtype)
    a, b = math.erf(lower / _SQRT2), math.erf(upper / _SQRT2)
    inside = (-_below(1.0, compute), _below(1.0, compute))  # the open interval (-1, 1) erfinv is finite on

    def transform(w: Sequence[torch.Tensor]) -> torch.Tensor:
        x = torch.clamp(_unit(w, compute) * (b - a) + a, inside[0], inside[1])
        return torch.clamp(torch.erfinv(x) * _SQRT2, lower, upper).to(dtype)

    return transform


def _precision(dtype: torch.dtype) -> int:
    """Significand bits of ``dtype``, the implicit one included (24 for float32)."""
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


def _below(x: float, dtype: torch.dtype) -> float:
    """The largest ``dtype`` value below ``x`` (``x`` rounded to ``dtype`` first), in Python
    arithmetic (no tensor: it is a constant of the trace)."""
    p, info = _precision(dtype), torch.finfo(dtype)
    if x == 0:
        return -info.tiny * info.eps
    m, e = math.frexp(x)
    r = round(m * 2**p) * 2.0 ** (e - p)
    m, e = math.frexp(abs(r))
    step = 2.0 ** (e - p - (1 if r > 0 and m == 0.5 else 0))
    return r - max(step, info.tiny * info.eps)


def scaled(transform: bits.Transform, factor: float, dtype: torch.dtype) -> bits.Transform:
    """``transform`` times ``factor`` in ``dtype``, per element (so it applies to any layout, ragged ones too)."""
    return lambda w: (transform(w) * factor).to(dtype)


def width(dtype: torch.dtype) -> int:
    """Philox words per element of a floating sample of ``dtype`` (2 for float64, else 1)."""
    return 2 if dtype == torch.float64 else 1


def uniform(
    key: torch.Tensor,
    shape: Sequence[int] = (),
    dtype: torch.dtype | None = None,
    minval: float = 0.0,
    maxval: float = 1.0,
    *,
    sharding: Sharding = None,
) -> torch.Tensor:
    """Uniform samples on ``[minval, maxval)`` (JAX's ``jax.random.uniform``).

    Example::

        >>> u = vsf.random.uniform(vsf.random.key(0), (3, 4), minval=-1.0, maxval=1.0)
    """
    dtype = float_dtype(dtype, "vsf.random.uniform")
    transform = uniform_transform(dtype, minval, maxval)
    return sample(key, shape, width(dtype), transform, dtype, sharding, "vsf.random.uniform")


def normal(
    key: torch.Tensor, shape: Sequence[int] = (), dtype: torch.dtype | None = None, *, sharding: Sharding = None
) -> torch.Tensor:
    """Standard normal samples (JAX's ``jax.random.normal``): ``sqrt(2) * erfinv(u)``, ``u`` uniform on ``(-1, 1)``.

    Example::

        >>> w = 0.02 * vsf.random.normal(vsf.random.key(0), (768, 768))
    """
    dtype = float_dtype(dtype, "vsf.random.normal")
    transform = normal_transform(dtype)
    return sample(key, shape, width(dtype), transform, dtype, sharding, "vsf.random.normal")


def truncated_normal(
    key: torch.Tensor,
    lower: float,
    upper: float,
    shape: Sequence[int] = (),
    dtype: torch.dtype | None = None,
    *,
    sharding: Sharding = None,
) -> torch.Tensor:
    """Standard normal samples conditioned on ``[lower, upper]`` (JAX's ``jax.random.truncated_normal``):
    the inverse CDF of a uniform between the CDF's values at the bounds.

    Example::

        >>> w = vsf.random.truncated_normal(vsf.random.key(0), -2.0, 2.0, (64, 64))
    """
    dtype = float_dtype(dtype, "vsf.random.truncated_normal")
    transform = truncated_normal_transform(dtype, lower, upper)
    return sample(key, shape, width(dtype), transform, dtype, sharding, "vsf.random.truncated_normal")


def bernoulli(
    key: torch.Tensor, p: float | torch.Tensor = 0.5, shape: Sequence[int] | None = None, *, sharding: Sharding = None
) -> torch.Tensor:
    """``True`` with probability ``p`` (JAX's ``jax.random.bernoulli``): ``uniform(key, shape) < p``.

    ``shape`` defaults to ``p``'s shape (``()`` for a float). Example::

        >>> keep = vsf.random.bernoulli(vsf.random.key(0), 0.9, (4, 8))
    """
    if shape is None:
        shape = tuple(p.shape) if isinstance(p, torch.Tensor) else ()
    if isinstance(p, torch.Tensor):
        return uniform(key, shape, torch.float32, sharding=sharding) < p
    return sample(key, shape, 1, bernoulli_transform(p), torch.bool, sharding, "vsf.random.bernoulli")


def bernoulli_transform(p: float) -> bits.Transform:
    """An element's word -> ``True`` with probability ``p`` (a float32 uniform below ``p``)."""
    return lambda w: _unit(w, torch.float32) < p


def randint(
    key: torch.Tensor,
    shape: Sequence[int],
    minval: int,
    maxval: int,
    dtype: torch.dtype = torch.int64,
    *,
    sharding: Sharding = None,
) -> torch.Tensor:
    """Integers uniform on ``[minval, maxval)`` (JAX's ``jax.random.randint``; torch's default ``int64``):
    63 random bits modulo the span (bias below ``span / 2**63``).

    Example::

        >>> tokens = vsf.random.randint(vsf.random.key(0), (8, 128), 0, 50257)
    """
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"vsf.random.randint samples an integer dtype, got {dtype}")
    span = int(maxval) - int(minval)
    if span <= 0 or span > 2**63:
        raise ValueError(
            f"vsf.random.randint needs minval < maxval with a span of at most 2**63, got minval={minval}, maxval={maxval}"
        )

    def transform(w: Sequence[torch.Tensor]) -> torch.Tensor:
        return (_bits63(w) % span + minval).to(dtype)

    return sample(key, shape, 2, transform, dtype, sharding, "vsf.random.randint")


def _bits63(w: Sequence[torch.Tensor]) -> torch.Tensor:
    return ((w[0] & 0x7FFFFFFF) << 32) | w[1]


def permutation(
    key: torch.Tensor, x: int | torch.Tensor, axis: int = 0, independent: bool = False, *, sharding: Sharding = None
) -> torch.Tensor:
    """A random permutation of ``range(x)``, or of ``x``'s entries along ``axis`` (JAX's
    ``jax.random.permutation``; ``independent=True`` permutes each slice along ``axis`` on its own).

    The order is an argsort of 63 random bits per global index, so it needs every index: each rank
    computes the whole permutation (and ``x`` must be whole on every rank), then keeps its shard of
    the result. Example::

        >>> order = vsf.random.permutation(vsf.random.key(0), 10)
    """
    if isinstance(x, int) and not isinstance(x, bool):
        return permutation(key, torch.arange(x), axis, independent, sharding=sharding)
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        raise TypeError(f"vsf.random.permutation needs an int or a tensor of rank >= 1, got {x!r}")
    axis = axis % x.ndim
    noise_shape = tuple(x.shape) if independent else (x.shape[axis],)
    noise = sample(key, noise_shape, 2, _bits63, torch.int64, None, "vsf.random.permutation")
    order = torch.argsort(noise, dim=axis if independent else 0, stable=True)
    out = torch.take_along_dim(x, order, dim=axis) if independent else torch.index_select(x, axis, order)
    if sharding is None:
        return out
    s = resolve(sharding, "vsf.random.permutation")
    return constrain(out, s) if _compat.fake_mode_active() else device_put(out, s)
