"""Gradient transformations: building blocks (optax's) and the optimizers users know (torch's numbers).

Each transform checks that the updates match its state (or the params) leaf for leaf, brings
DTensor updates to its state's layout once (see :mod:`vsf.optim._leaves`), and does its math
with ``torch._foreach_*`` ops on local shards, grouped by device and dtype; Adam's moments and
step are one fused kernel per leaf (:mod:`vsf.optim._fused`).

Where optax and ``torch.optim`` disagree, the optimizers here follow ``torch.optim`` (the
numbers PyTorch users compare against) and say so; the building blocks follow optax.

Example::

    >>> tx = vsf.optim.chain(vsf.optim.clip_by_global_norm(1.0), vsf.optim.adamw(3e-4, weight_decay=0.1))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from vsf import tree
from vsf.optim import _fused, _leaves
from vsf.optim.base import EmptyState, GradientTransformation, Params, Updates, chain
from vsf.optim.schedules import Schedule

__all__ = [
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByScheduleState",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "clip_by_global_norm",
    "lion",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "trace",
]

ScalarOrSchedule = float | Schedule
Tensors = list[torch.Tensor]


# -- helpers shared by the transforms ---------------------------------------------------------------


def _value(x: ScalarOrSchedule, count: torch.Tensor) -> float | torch.Tensor:
    return x(count) if callable(x) else x


def _add_scaled_(xs: Tensors, ys: Tensors, c: float | torch.Tensor) -> None:
    """``xs += c * ys`` in place (``xs`` are fresh tensors of this update, never inputs)."""
    if not xs:
        return
    if isinstance(c, torch.Tensor):
        torch._foreach_add_(xs, torch._foreach_mul(ys, _leaves.opmath(c, ys[0])))
    else:
        torch._foreach_add_(xs, ys, alpha=c)


def _pick(xs: list[Any], keep: list[bool]) -> list[Any]:
    return [x for x, k in zip(xs, keep) if k]


def _plus_decay(us: Tensors, ps: list[Any], keep: list[bool], weight_decay: float) -> Tensors:
    """``us`` with ``weight_decay * ps`` added (out of place) on the kept leaves."""
    if not any(keep):
        return us
    decayed = iter(torch._foreach_add(_pick(us, keep), _pick(ps, keep), alpha=weight_decay))
    return [next(decayed) if k else u for u, k in zip(us, keep)]


def _decay_mask(weight_decay: float, mask: Any, params: Params | None, n: int) -> list[bool]:
    """Which leaves get weight decay: none without it, else those ``mask`` selects (all by default)."""
    if not weight_decay:
        return [False] * n
    return [True] * n if mask is None else _leaves.mask_leaves(mask, params)


class _Step(NamedTuple):
    """One update's inputs, flattened against a reference tree (the state or the params)."""

    ref: _leaves.Flat
    updates: Tensors
    params: list[Any]  # one per leaf, None entries when no params were given


def _prepare(updates: Updates, ref_tree: Any, ref_what: str, params: Params | None, *, need_params: str = "") -> _Step:
    """Flatten ``updates`` (and ``params``) against ``ref_tree`` and settle them to its layout once."""
    ref = _leaves.flat(ref_tree)
    us = _leaves.leaves_like(ref, updates, "updates", ref_what)
    _leaves.check_floating(us, ref.paths, "updates")
    us = _leaves.settle(us, ref.leaves, ref.paths, "updates")
    if params is None:
        if need_params:
            raise ValueError(f"{need_params} needs the params: call update(updates, state, params)")
        return _Step(ref, us, [None] * len(us))
    ps = _leaves.leaves_like(ref, params, "params", ref_what)
    return _Step(ref, us, _leaves.settle(ps, ref.leaves, ref.paths, "params"))


def _prepare_stateless(updates: Updates, params: Params | None, *, need_params: str = "") -> _Step:
    """Flatten ``updates`` (against ``params`` when given) for a transform without per-parameter
    state: reduce ``Partial`` leaves once (to the params' layout when given) and bring the params
    to the updates' layout."""
    if params is None:
        if need_params:
            raise ValueError(f"{need_params} needs the params: call update(updates, state, params)")
        ref = _leaves.flat(updates)
        _leaves.check_floating(ref.leaves, ref.paths, "updates")
        return _Step(ref, _leaves.settle_partial(ref.leaves, None, ref.paths, "updates"), [None] * len(ref.leaves))
    ref = _leaves.flat(params)
    us = _leaves.leaves_like(ref, updates, "updates", "params")
    _leaves.check_floating(us, ref.paths, "updates")
    us = _leaves.settle_partial(us, ref.leaves, ref.paths, "updates")
    return _Step(ref, us, _leaves.settle(ref.leaves, us, ref.paths, "params"))


def _zeros_like(params: Params) -> Any:
    ref = _leaves.flat(params)
    _leaves.check_floating(ref.leaves, ref.paths, "params")
    return _leaves.zeros_like(params)


# -- stateless building blocks ------------------------------------------------------------------


def scale(step_size: float) -> GradientTransformation:
    """``updates * step_size`` (optax's ``scale``).

    Example::

        >>> tx = vsf.optim.scale(-0.1)
    """

    def update(updates: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        step = _prepare_stateless(updates, None)
        (out,) = _leaves.leafwise(lambda u: (torch._foreach_mul(u, step_size),), [step.updates], step.updates)
        return step.ref.unflatten(out), state

    return GradientTransformation(lambda params: EmptyState(), update)


class ScaleByScheduleState(NamedTuple):
    count: torch.Tensor


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """``updates * step_size_fn(count)``, ``count`` the updates done before this one (optax's
    ``scale_by_schedule``: the first update uses ``step_size_fn(0)``, as a torch ``LRScheduler``
    stepped after each ``optimizer.step()`` does).

    Example::

        >>> tx = vsf.optim.scale_by_schedule(vsf.optim.linear(0.0, -1e-3, transition_steps=100))
    """

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(_leaves.zero_count(tree.leaves(params)))

    def update(
        updates: Updates, state: ScaleByScheduleState, params: Params | None = None
    ) -> tuple[Updates, ScaleByScheduleState]:
        step = _prepare_stateless(updates, None)
        done, _, count = _leaves.bump(state.count)
        factor = step_size_fn(done)
        (out,) = _leaves.leafwise(
            lambda u: (torch._foreach_mul(u, _leaves.opmath(factor, u[0])),), [step.updates], step.updates
        )
        return step.ref.unflatten(out), ScaleByScheduleState(count)

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    """``-learning_rate * updates`` (optax's ``scale_by_learning_rate``; a schedule gets the count).

    Example::

        >>> tx = vsf.optim.chain(vsf.optim.trace(0.9), vsf.optim.scale_by_learning_rate(0.1))
    """
    if callable(learning_rate):
        return scale_by_schedule(lambda count: -learning_rate(count))
    return scale(-learning_rate)


def add_decayed_weights(weight_decay: float, mask: Any = None) -> GradientTransformation:
    """``updates + weight_decay * params`` on the leaves ``mask`` selects (all without a mask);
    optax's ``add_decayed_weights``. Before a momentum/Adam transform it is torch's coupled
    ``weight_decay`` (L2); after it and before the learning rate, decoupled (AdamW).

    Example::

        >>> tx = vsf.optim.add_decayed_weights(1e-4, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()})
    """

    def update(updates: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        step = _prepare_stateless(updates, params, need_params="add_decayed_weights")
        keep = _decay_mask(weight_decay, mask, params, len(step.updates))
        (out,) = _leaves.leafwise(
            lambda u, p, k: (_plus_decay(u, p, k, weight_decay),), [step.updates, step.params, keep], step.updates
        )
        return step.ref.unflatten(out), state

    return GradientTransformation(lambda params: EmptyState(), update)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` the 2-norm of all leaves
    together: ``torch.nn.utils.clip_grad_norm_``'s rule (optax's ``clip_by_global_norm`` has no
    ``1e-6`` and divides by the norm).

    On DTensors the norm covers every shard of every leaf with one all-reduce per mesh axis
    (local sums of squares first), never a gather per leaf; ``Partial`` updates are reduced once
    first (to the params' layout when ``params`` are given).

    Example::

        >>> tx = vsf.optim.chain(vsf.optim.clip_by_global_norm(1.0), vsf.optim.sgd(0.1))
    """

    def update(updates: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        step = _prepare_stateless(updates, params)
        norm = _leaves.global_norm(step.updates)
        factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        (out,) = _leaves.leafwise(
            lambda u: (torch._foreach_mul(u, _leaves.opmath(factor, u[0])),), [step.updates], step.updates
        )
        return step.ref.unflatten(out), state

    return GradientTransformation(lambda params: EmptyState(), update)


# -- momentum ----------------------------------------------------------------------------------


class TraceState(NamedTuple):
    trace: Updates


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``t = decay * t + g``; the update is ``t``, or ``g + decay * t`` with ``nesterov``
    (optax's ``trace``; torch's SGD momentum buffer with ``dampening=0``: starting from zeros,
    the first step gives ``t = g`` exactly as torch's first-step copy does).

    Example::

        >>> tx = vsf.optim.chain(vsf.optim.trace(0.9, nesterov=True), vsf.optim.scale(-0.1))
    """

    def init(params: Params) -> TraceState:
        return TraceState(_zeros_like(params))

    def update(updates: Updates, state: TraceState, params: Params | None = None) -> tuple[Updates, TraceState]:
        step = _prepare(updates, state.trace, "the trace state", None)

        def momentum(g: Tensors, t: Tensors) -> tuple[Tensors, Tensors]:
            t = torch._foreach_mul(t, decay)
            torch._foreach_add_(t, g)
            return (torch._foreach_add(g, t, alpha=decay) if nesterov else t), t

        out, new = _leaves.leafwise(momentum, [step.updates, step.ref.leaves], step.ref.leaves, outputs=2)
        return step.ref.unflatten(out), TraceState(step.ref.unflatten(new))

    return GradientTransformation(init, update)


def sgd(
    learning_rate: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0
) -> GradientTransformation:
    """Stochastic gradient descent, numerically ``torch.optim.SGD`` with ``dampening=0``.

    ``chain(add_decayed_weights(weight_decay), trace(momentum, nesterov), scale_by_learning_rate(lr))``,
    leaving out the parts that are off. ``weight_decay`` is torch's coupled L2 (added to the
    gradient before momentum); optax's ``sgd`` has no weight decay. torch's ``dampening`` is
    not supported (optax has none either).

    Example::

        >>> tx = vsf.optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    """
    if nesterov and momentum <= 0:
        raise ValueError("sgd with nesterov=True needs momentum > 0 (as torch.optim.SGD)")
    parts = []
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay))
    if momentum:
        parts.append(trace(momentum, nesterov))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)


# -- Adam ----------------------------------------------------------------------------------------


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # updates done (0-d int32)
    mu: Updates  # first moment
    nu: Updates  # second moment


def _adam(
    b1: float,
    b2: float,
    eps: float,
    learning_rate: ScalarOrSchedule | None,
    weight_decay: float,
    decoupled: bool,
    mask: Any,
) -> GradientTransformation:
    """Adam's update, one fused pass over each leaf's memory (see :func:`adam` and :mod:`vsf.optim._fused`).

    With ``learning_rate=None`` the result is the direction ``m_hat / (sqrt(v_hat) + eps)``
    (:func:`scale_by_adam`); otherwise the finished update ``-lr * (...)`` with weight decay.
    The moments and the step are PyTorch's fused Adam kernel's: without decoupled decay, bit for
    bit ``torch.optim.Adam(fused=True)``'s.
    """
    if not 0 <= b1 < 1 or not 0 <= b2 < 1:
        raise ValueError(f"Adam needs 0 <= b1, b2 < 1, got b1={b1}, b2={b2}")

    def init(params: Params) -> ScaleByAdamState:
        count = _leaves.zero_count(tree.leaves(params))
        return ScaleByAdamState(count, _zeros_like(params), _zeros_like(params))

    def update(
        updates: Updates, state: ScaleByAdamState, params: Params | None = None
    ) -> tuple[Updates, ScaleByAdamState]:
        needs = "adam/adamw with weight_decay" if weight_decay else ""
        step = _prepare(updates, state.mu, "the Adam state", params if weight_decay else None, need_params=needs)
        keep = _decay_mask(weight_decay, mask, params, len(step.updates))
        done, n, count = _leaves.bump(state.count)
        lr = -1.0 if learning_rate is None else _value(learning_rate, done)  # the kernel steps by -lr

        def kernel(g: Tensors, m: Tensors, v: Tensors, p: list[Any], k: list[bool]) -> tuple[Tensors, Tensors, Tensors]:
            if not decoupled:
                return _fused.adam_step(
                    _plus_decay(g, p, k, weight_decay), m, v, [None] * len(g), n, lr, 0.0, b1, b2, eps
                )
            # torch multiplies the param by (1 - lr * wd) rounded to the compute dtype: the update
            # starts from that same factor, minus one (exact), times the param.
            decay = _leaves.opmath(1 - lr * weight_decay, m[0]) - 1
            return _fused.adam_step(
                g, m, v, [x if decays else None for x, decays in zip(p, k)], n, lr, decay, b1, b2, eps
            )

        u, mu, nu = _leaves.leafwise(
            kernel,
            [step.updates, step.ref.leaves, tree.leaves(state.nu), step.params, keep],
            step.ref.leaves,
            outputs=3,
        )
        return step.ref.unflatten(u), ScaleByAdamState(count, step.ref.unflatten(mu), step.ref.unflatten(nu))

    return GradientTransformation(init, update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)`` (optax's ``scale_by_adam`` with ``eps_root=0``).

    Example::

        >>> tx = vsf.optim.chain(vsf.optim.scale_by_adam(), vsf.optim.scale_by_learning_rate(1e-3))
    """
    return _adam(b1, b2, eps, None, 0.0, True, None)


def adam(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """Adam, numerically ``torch.optim.Adam(lr, betas=(b1, b2), eps, weight_decay)``.

    Bias-corrected moments; ``eps`` is added after the square root of the bias-corrected second
    moment; ``weight_decay`` is torch's coupled L2 (``g + wd * p`` before the moments), on the
    leaves ``mask`` selects. optax's ``adam`` has the same update but no ``weight_decay``. A
    schedule for ``learning_rate`` gets the count of updates done before this one.

    Example::

        >>> tx = vsf.optim.adam(1e-3)
    """
    return _adam(b1, b2, eps, learning_rate, weight_decay, False, mask)


def adamw(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask: Any = None,
) -> GradientTransformation:
    """AdamW, numerically ``torch.optim.AdamW(lr, betas=(b1, b2), eps, weight_decay)``.

    Adam's update (:func:`adam`) plus decoupled weight decay ``-lr * wd * p`` on the leaves
    ``mask`` selects (a bool pytree prefix of the params or a callable returning one; a leaf
    left out is torch's param group with ``weight_decay=0``). Defaults are torch's
    (``weight_decay=1e-2``; optax's default is ``1e-4``). torch decays the param in place
    before adding the Adam step; here both are one additive update, equal up to rounding.

    Example::

        >>> tx = vsf.optim.adamw(3e-4, weight_decay=0.1, mask=lambda p: {k: v.ndim > 1 for k, v in p.items()})
    """
    return _adam(b1, b2, eps, learning_rate, weight_decay, True, mask)


# -- Lion ----------------------------------------------------------------------------------------


class ScaleByLionState(NamedTuple):
    count: torch.Tensor
    mu: Updates


def lion(
    learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 1e-3, mask: Any = None
) -> GradientTransformation:
    """Lion (Chen et al. 2023), optax's ``lion``: ``u = -lr * (sign(b1 * m + (1 - b1) * g) + wd * p)``,
    then ``m = b2 * m + (1 - b2) * g``; decay on the leaves ``mask`` selects.

    Example::

        >>> tx = vsf.optim.lion(1e-4, weight_decay=1e-2)
    """

    def init(params: Params) -> ScaleByLionState:
        return ScaleByLionState(_leaves.zero_count(tree.leaves(params)), _zeros_like(params))

    def update(
        updates: Updates, state: ScaleByLionState, params: Params | None = None
    ) -> tuple[Updates, ScaleByLionState]:
        needs = "lion with weight_decay" if weight_decay else ""
        step = _prepare(updates, state.mu, "the Lion state", params if weight_decay else None, need_params=needs)
        keep = _decay_mask(weight_decay, mask, params, len(step.updates))
        done, _, count = _leaves.bump(state.count)
        lr = _value(learning_rate, done)

        def kernel(g: Tensors, m: Tensors, p: list[Any], k: list[bool]) -> tuple[Tensors, Tensors]:
            u = torch._foreach_lerp(m, g, 1 - b1)
            torch._foreach_sign_(u)
            _add_scaled_(_pick(u, k), _pick(p, k), weight_decay)
            torch._foreach_mul_(u, _leaves.opmath(-lr, g[0]))
            return u, torch._foreach_lerp(m, g, 1 - b2)

        u, mu = _leaves.leafwise(kernel, [step.updates, step.ref.leaves, step.params, keep], step.ref.leaves, outputs=2)
        return step.ref.unflatten(u), ScaleByLionState(count, step.ref.unflatten(mu))

    return GradientTransformation(init, update)
