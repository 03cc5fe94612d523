"""The stages of a jitted function, under the names of JAX's ``jax.stages``.

``vsf.jit(f)`` gives a :class:`Jitted` (JAX's ``Wrapped``); its ``lower(*args)`` plans a call
without running it and gives a :class:`Lowered`, whose ``as_text()`` prints the plan and whose
``cost()`` is a :class:`Cost`; ``compile()`` gives the runnable :class:`Compiled` program. Use
these names in type hints and ``isinstance`` checks; the modules of ``vsf.jit`` that define them
are the planner's own.

Example::

    >>> step = vsf.jit(train_step)
    >>> lowered: vsf.stages.Lowered = step.lower(params, batch)
    >>> cost: vsf.stages.Cost = lowered.cost()
    >>> cost.comm_bytes, cost.peak_bytes
    ({'dp': 1048576.0}, 4194304)
"""

from vsf.jit import Compiled, Jitted, Lowered
from vsf.jit.report import Cost

__all__ = ["Compiled", "Cost", "Jitted", "Lowered"]
