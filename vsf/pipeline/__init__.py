"""Pipeline parallelism over a mesh's ``pp`` axis (see :mod:`vsf.pipeline.api`).

Example::

    >>> pipe = vsf.pipeline.Pipeline(stage_fns, loss, prefixes, mesh=mesh, microbatches=4, schedule="1f1b", batch=P("dp"), tied=("wte.weight",))
    >>> params = pipe.place(params, specs)
    >>> loss, grads = pipe.value_and_grad(params, idx, targets)
"""

from vsf.pipeline.api import Pipeline, stage_group
from vsf.pipeline.schedule import SCHEDULES, bubble, stage_actions
from vsf.pipeline.split import Split, assign

__all__ = ["SCHEDULES", "Pipeline", "Split", "assign", "bubble", "stage_actions", "stage_group"]
