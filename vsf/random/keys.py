"""Keys: JAX's ``key`` / ``split`` / ``fold_in`` on Philox, as small int64 tensors.

A key is an ``int64`` tensor of shape ``(2,)`` holding two 32-bit words (the Philox key). Being a
tensor, it can be an argument of :func:`vsf.jit` (replicated on every rank) and be split or
folded inside the step. Derived keys come from Philox itself, on counters of their own domain
(word 2 of the counter is 1 for ``split``, 2 for ``fold_in``; samplers use 0), so a derived key
never repeats a sampler's bits.

Example::

    >>> k = vsf.random.key(0)
    >>> k1, k2 = vsf.random.split(k)            # a (2, 2) tensor unpacks into two keys
    >>> step_key = vsf.random.fold_in(k, 7)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat, runtime
from vsf.random.philox import MASK, philox4x32

__all__ = ["check_key", "fold_in", "key", "key_words", "split"]

_SPLIT, _FOLD = 1, 2  # counter word 2 of derived keys (samplers use 0)


def key(seed: int) -> torch.Tensor:
    """A key from an integer seed (any Python int; taken modulo ``2**64``).

    Example::

        >>> vsf.random.key(42)
        tensor([ 0, 42])
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"vsf.random.key(seed) needs a Python int seed, got {seed!r} ({type(seed).__name__})")
    seed &= (1 << 64) - 1
    return torch.tensor([seed >> 32, seed & MASK], dtype=torch.int64)


def check_key(k: torch.Tensor, where: str) -> None:
    """Raise ``TypeError`` unless ``k`` is a key (an int64 tensor of shape ``(2,)``); ``where`` names the caller."""
    if not isinstance(k, torch.Tensor) or k.dtype != torch.int64 or tuple(k.shape) != (2,):
        found = (
            f"a {k.dtype} tensor of shape {tuple(k.shape)}"
            if isinstance(k, torch.Tensor)
            else f"{type(k).__name__} {k!r}"
        )
        raise TypeError(
            f"{where} needs a key (an int64 tensor of shape (2,), from vsf.random.key/split/fold_in), got {found}"
        )


def _derive(k: torch.Tensor, c0: torch.Tensor | int, c1: torch.Tensor | int, domain: int) -> torch.Tensor:
    words = philox4x32((k[0], k[1]), (c0, c1, domain, 0))
    return torch.stack(torch.broadcast_tensors(words[0], words[1]), dim=-1)


def split(k: torch.Tensor, num: int = 2) -> torch.Tensor:
    """``num`` new keys from ``k``, as a ``(num, 2)`` tensor (index or unpack it for each key).

    Example::

        >>> params_key, dropout_key = vsf.random.split(vsf.random.key(0))
        >>> keys = vsf.random.split(k, 8)          # keys[i] is the i-th
    """
    check_key(k, "vsf.random.split")
    if isinstance(num, bool) or not isinstance(num, int) or num < 0:
        raise ValueError(f"vsf.random.split(key, num) needs a non-negative int num, got {num!r}")
    return _derive(k, torch.arange(num, device=k.device), 0, _SPLIT)


def fold_in(k: torch.Tensor, data: int | torch.Tensor) -> torch.Tensor:
    """A new key from ``k`` and an integer ``data`` (a Python int modulo ``2**64``, or an integer
    0-d tensor, e.g. a step counter inside a jitted step).

    Example::

        >>> step_key = vsf.random.fold_in(base_key, step)
    """
    check_key(k, "vsf.random.fold_in")
    if isinstance(data, torch.Tensor):
        if data.dtype.is_floating_point or data.dtype.is_complex or data.ndim:
            raise TypeError(
                f"vsf.random.fold_in data must be an int or an integer 0-d tensor, got a {data.dtype} tensor of shape {tuple(data.shape)}"
            )
        d = data.to(torch.int64)
        return _derive(k, d & MASK, (d >> 32) & MASK, _FOLD)
    if isinstance(data, bool) or not isinstance(data, int):
        raise TypeError(f"vsf.random.fold_in data must be an int or an integer 0-d tensor, got {data!r}")
    data &= (1 << 64) - 1
    return _derive(k, data & MASK, data >> 32, _FOLD)


def key_words(k: torch.Tensor, where: str) -> tuple[int, int]:
    """The two words of a concrete key as Python ints (a replicated DTensor key too; under
    :func:`vsf.simulate` every rank must hold the same key)."""
    check_key(k, where)
    if isinstance(k, DTensor):
        k = _compat.dtensor_local(k)
    values = {tuple(int(w) for w in v.tolist()) for v in _values(k)}
    if len(values) != 1:
        raise ValueError(f"{where}: the key differs between ranks ({sorted(values)}); pass the same key on every rank")
    (pair,) = values
    return pair


def _values(k: torch.Tensor) -> list[torch.Tensor]:
    with _compat.local_mode_disabled():
        return list(_compat.local_shards(k, runtime.rank()).values())
