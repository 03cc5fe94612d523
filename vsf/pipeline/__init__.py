"""Pipeline parallelism over a mesh's ``pp`` axis (see :mod:`vsf.pipeline.api`).

Example::

    >>> pipe = vsf.pipeline.Pipeline(stage_fns, loss, prefixes, mesh=mesh, microbatches=4, schedule="1f1b", batch=P("dp"), tied=("wte.weight",))
    >>> params, layout = pipe.place(params, specs)
    >>> print(pipe.lower(params, idx, targets, layout=layout).as_text())   # each stage's plan, the sends between stages
    >>> loss, grads = pipe.value_and_grad(params, idx, targets, layout=layout)
"""

from vsf.pipeline.api import Pipeline
from vsf.pipeline.report import PipelineCost, PipelineLowered, Send, StageCost
from vsf.pipeline.schedule import (
    DEFERRED,
    INTERLEAVED,
    SCHEDULES,
    V_SHAPED,
    bubble,
    rank_actions,
    stage_actions,
    stage_rank,
)
from vsf.pipeline.split import Layout, Split, assign

__all__ = [
    "DEFERRED",
    "INTERLEAVED",
    "SCHEDULES",
    "V_SHAPED",
    "Layout",
    "Pipeline",
    "PipelineCost",
    "PipelineLowered",
    "Send",
    "Split",
    "StageCost",
    "assign",
    "bubble",
    "rank_actions",
    "stage_actions",
    "stage_rank",
]
