"""``vsf.jit``: a step traced once, planned over the mesh, and run as a program over local shards.

The package's files are the stages of a call, read top-down:

* :mod:`~vsf.jit.api` - ``jit``, ``Jitted``, ``Lowered``, ``Compiled``: arguments, cache, re-planning;
* :mod:`~vsf.jit.call` - one call's arguments, prepared, and the names of their leaves;
* :mod:`~vsf.jit.replans` - why a call planned again (the first difference of two cache keys);
* :mod:`~vsf.jit.trace` - the step as one functional aten graph on global fake tensors;
* :mod:`~vsf.jit.graph` - facts about that fx graph every stage reads;
* :mod:`~vsf.jit.outputs` - the traced step's outputs: their names and the shardings they are planned to;
* :mod:`~vsf.jit.classify` - what kind each op is (decided once, carried on the plan);
* :mod:`~vsf.jit.plan` - the plan's types and the placements vocabulary;
* :mod:`~vsf.jit.strategies` - DTensor's strategies for an op (the only place that asks them);
* :mod:`~vsf.jit.cost` and :mod:`~vsf.jit.solver` - the cost model and the per-axis solver;
* :mod:`~vsf.jit.copies` - the runs of ops a repeated block's copies made, placed once and copied by the solver;
* :mod:`~vsf.jit.packed` - a packed split's pieces taken apart (``chunk``) and put together (``cat``) on local shards;
* :mod:`~vsf.jit.manual` - ``shard_map`` regions: which ops are a body's, their placements over the manual axes, collectives and local run;
* :mod:`~vsf.jit.redistribute` - transition paths between placements and their collectives;
* :mod:`~vsf.jit.buckets` - bucketing of all-reduces, all-gathers and reduce-scatters, and the execution order;
* :mod:`~vsf.jit.propagate` - the driver: per-axis choices combined and checked with DTensor;
* :mod:`~vsf.jit.lower` - the plan run (or traced) on local shards;
* :mod:`~vsf.jit.runner` - one planned program run: interpreted, traced once (and compiled by Inductor, ``backend="inductor"``), or checked;
* :mod:`~vsf.jit.replay` - under ``vsf.simulate``, a program's first call recorded as plain per-rank ops and replayed;
* :mod:`~vsf.jit.joint` - the joint graph (forward + vjp) of a call torch autograd differentiates;
* :mod:`~vsf.jit.partition` - a planned joint graph split into forward and backward programs, with the saved values (and a backward into its input and weight parts);
* :mod:`~vsf.jit.differentiable` - the joint plan of such a call and the ``torch.autograd.Function`` that runs it;
* :mod:`~vsf.jit.check` - checking mode: the plan run beside the unsharded graph, op by op;
* :mod:`~vsf.jit.donation` - donated arguments released and their buffers reused;
* :mod:`~vsf.jit.overlap` - each collective waited for at its result's first use;
* :mod:`~vsf.jit.report` - the plan's text and cost.

``vsf.jit`` (the attribute of ``vsf``) is the function; reach a stage as ``from vsf.jit import lower``
(``import vsf.jit.lower`` would look it up on the function).

Example::

    >>> step = vsf.jit(train_step, donate_argnums=(0, 1))
    >>> print(step.lower(params, opt_state, batch).as_text())
"""

from vsf.jit.api import Compiled, Jitted, Lowered, jit

__all__ = ["Compiled", "Jitted", "Lowered", "jit"]
