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

from collections.abc import Sequence
from typing import Union

import torch

__all__ = ["MASK", "ROUNDS", "Scratch", "philox4x32"]

Word = Union[torch.Tensor, int]  # an int64 tensor of 32-bit words, or one word as a Python int

MASK = 0xFFFFFFFF
ROUNDS = 10
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # the round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # the Weyl key increments (golden ratio, sqrt(3) - 1)


def philox4x32(
    key: tuple[Word, Word], counter: tuple[Word, Word, Word, Word], rounds: int = ROUNDS, out: Scratch | None = None
) -> tuple[Word, Word, Word, Word]:
    """The four output words of Philox-4x32 for a 2-word ``key`` and a 4-word ``counter``.

    Words broadcast like tensor arithmetic; a Python int stands for a word that is the same for
    every element (and costs nothing while it stays one: Python ints fold together before they
    meet a tensor). Each key word may also be a 0-d tensor. A round multiplies words 0 and 2 and
    keeps the low halves of the products as words 1 and 3; those low halves are masked once at
    the end rather than every round (their high bits only ever reach an xor whose result is
    masked). With ``out`` (a :class:`Scratch`; every tensor word then has its one shape) every
    op writes into one of its buffers and the words land in its ``words``: no tensor is allocated.
    """
    k0, k1 = key
    x0, x1, x2, x3 = counter
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & MASK, (k1 + _W1) & MASK
        p0, p1 = _mul(x0, _M0, out), _mul(x2, _M1, out)
        _release(out, x0, x2)
        y0 = _mix(p1, x1, k0, out)
        _release(out, x1)
        y2 = _mix(p0, x3, k1, out)
        _release(out, x3)
        x0, x1, x2, x3 = y0, p1, y2, p0
    if out is None:
        return x0, x1 & MASK, x2, x3 & MASK
    for word, dst in zip((x0, x1, x2, x3), out.words):
        if isinstance(word, int):
            dst.fill_(word & MASK)
        else:
            torch.bitwise_and(word, MASK, out=dst)  # x0, x2 are masked already: this is their copy
    _release(out, x0, x1, x2, x3)
    return tuple(out.words)


class Scratch:
    """Where an in-place :func:`philox4x32` writes: ``words``, four destination tensors (e.g.
    strided views of one buffer), and ``buffers``, six int64 tensors of the words' shape for the
    rounds' products and mixes (a round holds at most six words at once). An eager fill makes
    one per chunk from buffers it keeps for all chunks, so the rounds allocate nothing: fresh
    memory costs about as much as the op that touches it."""

    def __init__(self, words: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        self.words = list(words)
        self.free = list(buffers)
        self.mine = {id(b) for b in buffers}

    def take(self) -> torch.Tensor:
        return self.free.pop()


def _release(out: Scratch | None, *words: Word) -> None:
    """Hand the buffers of dead ``words`` back to ``out`` (a word it did not lend, such as the
    caller's counter, is never written)."""
    if out is not None:
        out.free.extend(w for w in words if isinstance(w, torch.Tensor) and id(w) in out.mine)


def _mul(x: Word, m: int, out: Scratch | None) -> Word:
    if out is None or isinstance(x, int):
        return x * m
    return torch.mul(x, m, out=out.take())


def _mix(p: Word, x: Word, k: Word, out: Scratch | None) -> Word:
    """``((p >> 32) ^ x ^ k) & MASK``. The terms that are Python ints xor together first, so the
    mix costs a tensor op per tensor term (plus the mask); with ``out`` every op writes into one
    of its buffers (``p >> 32``'s, xored and masked there, or a fresh one of them)."""
    hi = (
        torch.bitwise_right_shift(p, 32, out=out.take()) if out is not None and isinstance(p, torch.Tensor) else p >> 32
    )
    const, tensors = 0, []
    for term in (hi, x, k):
        if isinstance(term, int):
            const ^= term
        else:
            tensors.append(term)
    if not tensors:
        return const & MASK
    first, rest = tensors[0], tensors[1:] + ([const] if const else [])
    if out is None:
        for term in rest:
            first = first ^ term
        return first & MASK
    if first is not hi:  # no buffer of out's holds a term yet: the first op writes into one
        first = (
            torch.bitwise_xor(first, rest.pop(0), out=out.take())
            if rest
            else torch.bitwise_and(first, MASK, out=out.take())
        )
    for term in rest:
        first.bitwise_xor_(term)
    return first.bitwise_and_(MASK)
