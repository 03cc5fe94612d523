"""User-set switches (plain attributes of this module).

* ``strict`` (default ``False``): a committed input of ``vsf.jit`` whose sharding differs from
  ``in_shardings`` is an error instead of being resharded with a logged warning.
* ``allow_replicated_fallback`` (default ``False``): an op with no DTensor sharding strategy runs
  replicated (the plan text flags it) instead of being an error.
* ``jit_mode`` (default ``"auto"``): ``"trace"`` runs each step as a traced program over local
  shards, ``"interpret"`` walks the plan on DTensors, ``"auto"`` traces in real runs and
  interprets under ``vsf.simulate`` (where per-rank programs cannot be traced).
* ``compile_random`` (default ``False``): eager ``vsf.random`` samplers compute Philox with a
  ``torch.compile`` d kernel (integer ops only, so the same bits; about 10x faster on CPU, after
  a one-off compile of tens of seconds per process).

Example::

    >>> vsf.config.strict = True
"""

strict: bool = False
allow_replicated_fallback: bool = False
jit_mode: str = "auto"
compile_random: bool = False
