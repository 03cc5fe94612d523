"""Neural-network helpers: :func:`dropout` on keyed random numbers, :mod:`vsf.nn.initializers`
(JAX's ``jax.nn.initializers`` home and names, torch's fan conventions), and
:func:`expert_parallel` (a mixture-of-experts layer with its experts split over a mesh axis; a
``transformers`` MoE model's experts, and torchtitan's routed experts, run through it inside
``vsf.jit`` when their weights' specs split the expert dim, or :func:`use_expert_parallel` sets the axes).

Example::

    >>> y = vsf.nn.dropout(vsf.random.fold_in(key, step), x, 0.1)
"""

from __future__ import annotations

from vsf.nn import initializers, torchtitan_moe  # noqa: F401  (torchtitan_moe: its rewrite registers on import)
from vsf.nn.moe import expert_parallel, use_expert_parallel
from vsf.random.dropout import dropout

__all__ = ["dropout", "expert_parallel", "initializers", "use_expert_parallel"]
