"""Running code that calls torch's RNG with keyed, sharding-invariant draws instead.

Inside ``with vsf.random.keyed(key):`` every aten op that would draw from torch's generator
(``F.dropout`` / ``nn.Dropout`` -> ``native_dropout``, ``torch.rand`` / ``randn`` / ``randint``
/ ``randperm`` / ``bernoulli`` and their ``_like`` forms, ``Tensor.uniform_`` / ``normal_`` /
``bernoulli_``, so ``torch.nn.init`` too) is replaced by the :mod:`vsf.random` sampler of the same
distribution on ``fold_in(key, i)``, ``i`` counting the draws from 0. A draw on a DTensor takes
its sharding, so the values are the same on every mesh. Any other op that draws (attention with
dropout, ``multinomial``, ``rrelu``, ``exponential_`` ...) raises an error naming it: a
different mask per layout is never produced silently. Inside :func:`vsf.jit` an op that draws
outside ``keyed`` is an error of the trace.

The replacement works at the aten level (a dispatch mode), below autograd: ``native_dropout``'s
backward uses the keyed mask. Draws are numbered in call order, so code run twice (activation
recomputation) must run under the same key and order.

Example::

    >>> @vsf.jit
    ... def step(params, batch, key):
    ...     with vsf.random.keyed(key):
    ...         loss, grads = vsf.value_and_grad(lambda p: vsf.tree.apply(model.train(), p, *batch))(params)
    ...     return loss, grads
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from vsf import _compat
from vsf.random import samplers
from vsf.random.dropout import dropout, keep_mask
from vsf.random.keys import check_key, fold_in
from vsf.sharding.named import sharding_of
from vsf.jit.classify import draws_random

__all__ = ["keyed"]

aten = torch.ops.aten


class keyed:  # noqa: N801  (a context, like torch.no_grad)
    """Replace torch's RNG by draws from ``key`` while the context is open (see the module docstring)."""

    def __init__(self, key: torch.Tensor) -> None:
        check_key(key, "vsf.random.keyed")
        self.key = key
        self.draws = 0
        self._modes: list[Any] = []

    def next_key(self) -> torch.Tensor:
        """The key of the next draw: ``fold_in(key, draws)``."""
        k = fold_in(self.key, self.draws)
        self.draws += 1
        return k

    def __enter__(self) -> "keyed":
        self._modes = [_mode_class()(self), _DropoutMode(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        modes, self._modes = self._modes, []
        for mode in reversed(modes):
            mode.__exit__(exc_type, exc, tb)


class _DropoutMode(TorchFunctionMode):
    """``F.dropout`` / ``torch.dropout`` as :func:`vsf.nn.dropout` on the next key, before they
    reach aten (on CPU torch's dropout is an in-place ``bernoulli_`` on a fresh buffer, which a
    traced step would have to copy)."""

    def __init__(self, owner: keyed) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout or func is torch.dropout:
            return _dropout(self.owner, *args, **kwargs)
        return func(*args, **kwargs)


def _dropout(
    owner: keyed,
    input: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
    train: bool | None = None,
) -> torch.Tensor:
    if train is not None:
        training = train
    if not training or p == 0:
        return input
    out = dropout(owner.next_key(), input, p)
    return input.copy_(out) if inplace else out


@functools.cache
def _mode_class() -> type:
    """The dispatch mode class (built on first use: its base comes from ``_compat``)."""
    base = _compat.dispatch_mode_base()

    class _KeyedMode(base):  # type: ignore[misc, valid-type]
        def __init__(self, owner: keyed) -> None:
            super().__init__()
            self.owner = owner

        def __torch_dispatch__(
            self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kwargs = kwargs or {}
            if not draws_random(func, args, kwargs):
                return func(*args, **kwargs)
            replace = _REPLACEMENTS.get(func)
            if replace is None:
                raise RuntimeError(
                    f"vsf.random.keyed: {func} draws from torch's generator and has no keyed replacement, so its values "
                    "would depend on the layout. Use a vsf.random sampler for it (or, for attention with dropout, an "
                    "attention written with F.dropout, e.g. attn_implementation='eager' in transformers)."
                )
            return replace(self.owner, *args, **kwargs)

    return _KeyedMode


# -- replacements (aten schemas) ------------------------------------------------------------------


def _like(x: torch.Tensor) -> dict[str, Any]:
    """``sharding=`` for a draw shaped like ``x``: its own layout when ``x`` is a DTensor."""
    return {"sharding": sharding_of(x)} if isinstance(x, DTensor) else {}


def _on(k: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return k if isinstance(x, DTensor) else k.to(x.device)


def _uniform_like(owner: keyed, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    k = owner.next_key()
    return samplers.uniform(
        _on(k, x), tuple(x.shape), dtype or (x.dtype if x.dtype.is_floating_point else torch.float32), **_like(x)
    )


def _native_dropout(owner: keyed, x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    if train is False or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    keep = keep_mask(owner.next_key(), x, p)
    return x * keep * (1.0 / (1.0 - p)), keep


def _bernoulli(
    owner: keyed, x: torch.Tensor, p: float | torch.Tensor | None = None, generator: Any = None
) -> torch.Tensor:
    return (_uniform_like(owner, x, torch.float32) < (x if p is None else p)).to(x.dtype)


def _fill(draw: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """An in-place op ``t.op_(...)`` as ``t.copy_(draw(owner, t, ...))``."""

    def op(owner: keyed, t: torch.Tensor, *args: Any, generator: Any = None, **kwargs: Any) -> torch.Tensor:
        return t.copy_(draw(owner, t, *args, **kwargs))

    return op


def _uniform(owner: keyed, t: torch.Tensor, low: float = 0.0, high: float = 1.0) -> torch.Tensor:
    return _uniform_like(owner, t) * (high - low) + low


def _normal(owner: keyed, t: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    return samplers.normal(_on(owner.next_key(), t), tuple(t.shape), t.dtype, **_like(t)) * std + mean


def _factory(draw: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A factory op ``op(size, dtype=, device=, ...)``: the draw on the key's device, then moved."""

    def op(
        owner: keyed,
        *args: Any,
        dtype: torch.dtype | None = None,
        device: Any = None,
        layout: Any = None,
        pin_memory: Any = None,
        generator: Any = None,
    ) -> torch.Tensor:
        out = draw(owner.next_key(), *args, dtype=dtype)
        return out if device is None else out.to(device)

    return op


def _randint(k: torch.Tensor, *args: Any, dtype: torch.dtype | None) -> torch.Tensor:
    low, high, size = (0, *args) if len(args) == 2 else args
    return samplers.randint(k, tuple(size), low, high, dtype or torch.int64)


def _randint_like(
    owner: keyed, x: torch.Tensor, *args: Any, dtype: torch.dtype | None = None, **_: Any
) -> torch.Tensor:
    low, high = (0, *args) if len(args) == 1 else args
    return samplers.randint(_on(owner.next_key(), x), tuple(x.shape), low, high, dtype or x.dtype, **_like(x))


def _like_factory(draw: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def op(owner: keyed, x: torch.Tensor, *, dtype: torch.dtype | None = None, **_: Any) -> torch.Tensor:
        return draw(_on(owner.next_key(), x), tuple(x.shape), dtype or x.dtype, **_like(x))

    return op


_REPLACEMENTS: dict[Any, Callable[..., Any]] = {
    aten.native_dropout.default: _native_dropout,
    aten.bernoulli.default: _bernoulli,
    aten.bernoulli.p: _bernoulli,
    aten.bernoulli_.float: _fill(lambda owner, t, p=0.5: _bernoulli(owner, t, p)),
    aten.bernoulli_.Tensor: _fill(lambda owner, t, p: _bernoulli(owner, t, p)),
    aten.uniform_.default: _fill(_uniform),
    aten.normal_.default: _fill(_normal),
    aten.rand.default: _factory(lambda k, size, dtype: samplers.uniform(k, tuple(size), dtype)),
    aten.randn.default: _factory(lambda k, size, dtype: samplers.normal(k, tuple(size), dtype)),
    aten.randint.default: _factory(_randint),
    aten.randint.low: _factory(_randint),
    aten.randperm.default: _factory(lambda k, n, dtype: samplers.permutation(k, n).to(dtype or torch.int64)),
    aten.rand_like.default: _like_factory(samplers.uniform),
    aten.randn_like.default: _like_factory(samplers.normal),
    aten.randint_like.default: _randint_like,
    aten.randint_like.low_dtype: _randint_like,
}
