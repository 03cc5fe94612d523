"""Named-axis collectives on local tensors (JAX's ``psum``, ``all_gather``, ...) with autodiff,
including ragged variants, over gloo, NCCL or simulated ranks (see :mod:`vsf.ops.backend`).

Example::

    >>> with vsf.simulate(4), vsf.use_mesh(vsf.make_mesh((2, 2), ("dp", "tp"))):
    ...     y = vsf.ops.psum(x, "dp")
"""

from vsf.ops.collectives import (
    all_gather,
    all_gather_v,
    all_to_all,
    all_to_all_v,
    ppermute,
    psum,
    psum_scatter,
    reduce_scatter_v,
)

__all__ = [
    "all_gather",
    "all_gather_v",
    "all_to_all",
    "all_to_all_v",
    "ppermute",
    "psum",
    "psum_scatter",
    "reduce_scatter_v",
]
