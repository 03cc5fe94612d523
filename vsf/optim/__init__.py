"""Optimizers as pure functions over pytrees (optax's shape, torch.optim's numbers), with state
laid out on the mesh (ZeRO stages 1-3).

Example::

    >>> tx = vsf.optim.sharded(vsf.optim.chain(vsf.optim.clip_by_global_norm(1.0), vsf.optim.adamw(3e-4)), zero_axes=("dp",))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = vsf.optim.apply_updates(params, updates)
"""

from vsf.optim.base import (
    EmptyState,
    GradientTransformation,
    MaskedState,
    MultiStepsState,
    apply_updates,
    chain,
    masked,
    multi_steps,
)
from vsf.optim.muon import NS_COEFFICIENTS, ScaleByMuonState, muon, newton_schulz, scale_by_muon
from vsf.optim.schedules import Schedule, constant, cosine_decay, linear, warmup_cosine_decay
from vsf.optim.sharded import ZeroLayout, init_sharded, sharded, state_shardings, zero_layout
from vsf.optim.transforms import (
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByScheduleState,
    TraceState,
    adam,
    adamw,
    add_decayed_weights,
    clip_by_global_norm,
    lion,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_schedule,
    sgd,
    trace,
)

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "MaskedState",
    "MultiStepsState",
    "NS_COEFFICIENTS",
    "Schedule",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByMuonState",
    "ScaleByScheduleState",
    "TraceState",
    "ZeroLayout",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant",
    "cosine_decay",
    "init_sharded",
    "sharded",
    "lion",
    "linear",
    "masked",
    "multi_steps",
    "muon",
    "newton_schulz",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_muon",
    "scale_by_schedule",
    "sgd",
    "state_shardings",
    "trace",
    "warmup_cosine_decay",
    "zero_layout",
]
