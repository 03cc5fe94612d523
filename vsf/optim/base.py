"""The optimizer protocol (optax's): a pair of pure functions over pytrees, and how to combine them.

A :class:`GradientTransformation` is ``(init, update)``: ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``. States are NamedTuples of tensors
(the step count is a 0-d int32 tensor, as in optax). Nothing is updated in place: an update
returns new tensors, so the same code runs eagerly, on DTensors, and inside a ``make_fx`` trace.

Example::

    >>> tx = vsf.optim.chain(vsf.optim.clip_by_global_norm(1.0), vsf.optim.adamw(1e-3))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = vsf.optim.apply_updates(params, updates)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from vsf import _compat, tree
from vsf.jit.trace import per_leaf
from vsf.optim import _leaves

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "MaskedState",
    "MultiStepsState",
    "apply_updates",
    "chain",
    "masked",
    "multi_steps",
]

Params = Any
Updates = Any
State = Any


class GradientTransformation(NamedTuple):
    """``init(params) -> state`` and ``update(updates, state, params=None) -> (updates, state)``.

    Example::

        >>> tx = vsf.optim.sgd(0.1)
        >>> updates, state = tx.update(grads, tx.init(params), params)
    """

    init: Callable[[Params], State]
    update: Callable[..., tuple[Updates, State]]


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates``, leaf by leaf, in each param's dtype and layout (optax's ``apply_updates``).

    An update laid out differently from its param (ZeRO: the update is sharded like the state,
    the param is not) is redistributed to the param's layout once (an all-gather).

    Example::

        >>> params = vsf.optim.apply_updates(params, updates)
    """
    ref = _leaves.flat(params)
    _leaves.check_floating(ref.leaves, ref.paths, "params")
    us = _leaves.settle(_leaves.leaves_like(ref, updates, "updates", "params"), ref.leaves, ref.paths, "updates")
    (out,) = _leaves.leafwise(_add, [ref.leaves, us], ref.leaves)
    return ref.unflatten(out)


def _add(ps: list[torch.Tensor], us: list[torch.Tensor]) -> tuple[list[torch.Tensor]]:
    out = per_leaf(torch.add, zip(ps, us), "add", together=torch._foreach_add)
    with _compat.metadata_reads():
        alike = [o.dtype == p.dtype for o, p in zip(out, ps)]
    return ([o if same else o.to(p.dtype) for o, p, same in zip(out, ps, alike)],)


def chain(*txs: GradientTransformation) -> GradientTransformation:
    """Apply ``txs`` in order; the state is the tuple of their states (optax's ``chain``).

    Layouts are not its business: each transform takes the gradients as they come and brings
    them to its own state's layout; :func:`vsf.optim.sharded` reduces them into the state's
    layout once, before the first transform.

    Example::

        >>> tx = vsf.optim.chain(vsf.optim.clip_by_global_norm(1.0), vsf.optim.adamw(1e-3))
    """
    for i, t in enumerate(txs):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain argument {i} must be a GradientTransformation, got {type(t).__name__}")

    def init(params: Params) -> tuple[State, ...]:
        return tuple(t.init(params) for t in txs)

    def update(
        updates: Updates, state: tuple[State, ...], params: Params | None = None
    ) -> tuple[Updates, tuple[State, ...]]:
        if not isinstance(state, tuple) or len(state) != len(txs):
            raise ValueError(
                f"chain of {len(txs)} transforms needs a tuple of {len(txs)} states, got {type(state).__name__}"
            )
        new_state = []
        for t, s in zip(txs, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


class MaskedState(NamedTuple):
    """State of :func:`masked`: the inner transform's state over the selected leaves."""

    inner_state: State


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """Apply ``inner`` only to the leaves where ``mask`` is True; pass the others through
    unchanged (optax's ``masked``).

    ``mask`` is a bool pytree prefix of the params, or a callable ``mask(tree) -> such a tree``
    (called with the params in ``init`` and the updates in ``update``). Inside, unselected leaves
    are ``None`` (an empty node), so the inner state has holes there.

    Example::

        >>> no_bias = lambda p: {k: not k.endswith("bias") for k in p}
        >>> tx = vsf.optim.masked(vsf.optim.add_decayed_weights(1e-2), no_bias)
    """

    def select(x: Any, keep: list[bool]) -> Any:
        ref = _leaves.flat(x)
        return ref.unflatten([leaf if k else None for leaf, k in zip(ref.leaves, keep)])

    def init(params: Params) -> MaskedState:
        return MaskedState(inner.init(select(params, _leaves.mask_leaves(mask, params))))

    def update(updates: Updates, state: MaskedState, params: Params | None = None) -> tuple[Updates, MaskedState]:
        keep = _leaves.mask_leaves(mask, updates)
        sub_params = None if params is None else select(params, keep)
        new, inner_state = inner.update(select(updates, keep), state.inner_state, sub_params)
        ref = _leaves.flat(updates)
        picked = iter(tree.leaves(new))
        return ref.unflatten([next(picked) if k else u for u, k in zip(ref.leaves, keep)]), MaskedState(inner_state)

    return GradientTransformation(init, update)


class MultiStepsState(NamedTuple):
    """State of :func:`multi_steps`."""

    mini_step: torch.Tensor  # gradients accumulated since the last inner update (0-d int32)
    gradient_step: torch.Tensor  # inner updates done (0-d int32)
    inner_state: State
    acc_grads: Updates  # running mean of the accumulated gradients


def multi_steps(inner: GradientTransformation, every_k: int) -> GradientTransformation:
    """Gradient accumulation (optax's ``MultiSteps``): average ``every_k`` gradients, then apply
    ``inner`` to the mean; updates in between are zeros.

    The mean is a running mean (``acc += (g - acc) / n``, optax's ``use_grad_mean=True``). To
    stay traceable (no branch on a tensor value) ``inner.update`` runs at every call and its
    result is kept only on every ``every_k``-th: ``every_k`` times the optimizer arithmetic of
    plain ``inner``, none of it on the gradient path.

    Example::

        >>> tx = vsf.optim.multi_steps(vsf.optim.adamw(1e-3), every_k=4)
    """
    if not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"multi_steps needs every_k >= 1, got {every_k!r}")

    def init(params: Params) -> MultiStepsState:
        ref = _leaves.flat(params)
        _leaves.check_floating(ref.leaves, ref.paths, "params")
        count = _leaves.zero_count(ref.leaves)
        return MultiStepsState(count, count, inner.init(params), _leaves.zeros_like(params))

    def update(
        updates: Updates, state: MultiStepsState, params: Params | None = None
    ) -> tuple[Updates, MultiStepsState]:
        acc = _leaves.flat(state.acc_grads)
        gs = _leaves.leaves_like(acc, updates, "updates", "the accumulated gradients")
        _leaves.check_floating(gs, acc.paths, "updates")
        gs = _leaves.settle(gs, acc.leaves, acc.paths, "updates")
        done, n, _ = _leaves.bump(state.mini_step)

        def mean(g: list[torch.Tensor], a: list[torch.Tensor]) -> tuple[list[torch.Tensor]]:
            new = torch._foreach_sub(g, a)
            torch._foreach_div_(new, _leaves.opmath(n, a[0]))
            torch._foreach_add_(new, a)
            return (new,)

        (new_acc,) = _leaves.leafwise(mean, [gs, acc.leaves], acc.leaves)
        new_acc_tree = acc.unflatten(new_acc)
        inner_updates, inner_state = inner.update(new_acc_tree, state.inner_state, params)
        emit = (done + 1) == every_k
        zeros = _leaves.zeros_like(inner_updates)
        mini = _leaves.wrap(torch.where(emit, 0, _leaves.local(state.mini_step) + 1).to(torch.int32), state.mini_step)
        grad_step = _leaves.wrap((_leaves.local(state.gradient_step) + emit.to(torch.int32)), state.gradient_step)
        return _leaves.where(emit, inner_updates, zeros), MultiStepsState(
            mini,
            grad_step,
            _leaves.where(emit, inner_state, state.inner_state),
            _leaves.where(emit, _leaves.zeros_like(new_acc_tree), new_acc_tree),
        )

    return GradientTransformation(init, update)
