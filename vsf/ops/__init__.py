"""Named-axis collectives on local tensors (JAX's ``psum``, ``all_gather``, ...) with autodiff,
including ragged variants, over gloo, NCCL or simulated ranks (see :mod:`vsf.ops.backend`).

Example::

    >>> with vsf.simulate(4), vsf.use_mesh(vsf.make_mesh((2, 2), ("dp", "tp"))):
    ...     y = vsf.ops.psum(x, "dp")
"""

from vsf.ops.collectives import (
    Linear,
    all_gather,
    all_to_all,
    apply_linear,
    axis_index,
    axis_size,
    pmax,
    pmean,
    ppermute,
    psum,
    psum_scatter,
)
from vsf.ops.ragged import all_gather_v, all_to_all_counted, all_to_all_v, reduce_scatter_v

__all__ = [
    "Linear",
    "all_gather",
    "all_gather_v",
    "all_to_all",
    "all_to_all_counted",
    "all_to_all_v",
    "apply_linear",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "ppermute",
    "psum",
    "psum_scatter",
    "reduce_scatter_v",
]
