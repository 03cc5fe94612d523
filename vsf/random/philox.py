"""Philox-4x32-10, the counter-based generator of Salmon et al., "Parallel Random Numbers: As
Easy as 1, 2, 3" (SC 2011), written with integer tensor ops.

Every 32-bit word is held in an ``int64`` tensor (values in ``[0, 2**32)``): the 32x32-bit
products fit in 64 bits modulo ``2**64`` (two's-complement wrap-around, the same on CPU and
CUDA), so ``(a * b) >> 32`` and ``(a * b) & MASK`` are the high and low words on any device.
Only integer ops are used, so the bits depend on nothing but the key and the counter.

Example::

    >>> philox4x32((0, 0), (torch.tensor([0]), 0, 0, 0))      # Random123's first known answer
    (tensor([1713891541]), tensor([3781805453]), tensor([3159862348]), tensor([2600524760]))
"""

from __future__ import annotations

from typing import Union

import torch

__all__ = ["MASK", "ROUNDS", "philox4x32"]

Word = Union[torch.Tensor, int]  # an int64 tensor of 32-bit words, or one word as a Python int

MASK = 0xFFFFFFFF
ROUNDS = 10
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # the Weyl key increments (golden ratio, sqrt(3) - 1)


def philox4x32(key: tuple[Word, Word], counter: tuple[Word, Word, Word, Word], rounds: int = ROUNDS) -> tuple[Word, Word, Word, Word]:
    """The four output words of Philox-4x32 for a 2-word ``key`` and a 4-word ``counter``.

    Words broadcast like tensor arithmetic; a Python int stands for a word that is the same for
    every element (and costs nothing while it stays one). Each key word may also be a 0-d tensor.
    A round multiplies words 0 and 2 and keeps the low halves of the products as words 1 and 3;
    those low halves are masked once at the end rather than every round (their high bits only
    ever reach an xor whose result is masked), ten tensor ops a round.
    """
    k0, k1 = key
    x0, x1, x2, x3 = counter
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & MASK, (k1 + _W1) & MASK
        p0, p1 = x0 * _M0, x2 * _M1
        x0, x1, x2, x3 = ((p1 >> 32) ^ x1 ^ k0) & MASK, p1, ((p0 >> 32) ^ x3 ^ k1) & MASK, p0
    return x0, x1 & MASK, x2, x3 & MASK
