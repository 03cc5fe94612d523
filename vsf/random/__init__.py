"""Sharding-invariant random numbers: JAX's ``jax.random`` on a counter-based generator.

Keys are small int64 tensors (:mod:`vsf.random.keys`); every sample's element is a pure
function of (key, its global index), computed with Philox-4x32-10 (:mod:`vsf.random.philox`)
in integer tensor ops (:mod:`vsf.random.bits`). So a sample laid out on any mesh, with any
spec, equals the unsharded one bit for bit, each rank computes only its own shard, and nothing
is communicated. The samplers (:mod:`vsf.random.samplers`) take ``sharding=``; inside
:func:`vsf.jit` they are traced as elementwise ops the planner shards.

* :func:`init_sharded` builds a params pytree directly in its sharding (no rank holds a whole
  parameter), from initialisers such as :mod:`vsf.nn.initializers`.
* :class:`keyed` runs code that calls torch's own RNG (``F.dropout``, ``nn.Dropout``,
  ``torch.rand``, ``Tensor.normal_`` ...) with keyed, sharding-invariant draws instead.

Example::

    >>> k_init, k_drop = vsf.random.split(vsf.random.key(0))
    >>> x = vsf.random.normal(k_init, (4, 8))
    >>> y = vsf.nn.dropout(k_drop, x, 0.1)
"""

from vsf.random.init import init_sharded
from vsf.random.keyed import keyed
from vsf.random.keys import fold_in, key, split
from vsf.random.samplers import bernoulli, normal, permutation, randint, truncated_normal, uniform

__all__ = [
    "bernoulli",
    "fold_in",
    "init_sharded",
    "key",
    "keyed",
    "normal",
    "permutation",
    "randint",
    "split",
    "truncated_normal",
    "uniform",
]
