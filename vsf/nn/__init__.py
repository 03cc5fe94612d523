"""Neural-network helpers on keyed random numbers: :func:`dropout` and :mod:`vsf.nn.initializers`
(JAX's ``jax.nn.initializers`` home and names, torch's fan conventions).

Example::

    >>> y = vsf.nn.dropout(vsf.random.fold_in(key, step), x, 0.1)
"""

from __future__ import annotations

from vsf.nn import initializers
from vsf.random.dropout import dropout

__all__ = ["dropout", "initializers"]
