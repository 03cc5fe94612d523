"""Every public error class of vsf, in one place (each is also exported from ``vsf``).

The messages say what was expected, what was found and where (a pytree key path, an op and the
user's source line). This module imports nothing, so every layer may raise these.

Example::

    >>> try:
    ...     step(params, batch)
    ... except vsf.PlanError as e:
    ...     print(e)          # names the op and the user's line
"""

from __future__ import annotations

__all__ = ["CorruptCheckpointError", "NotACheckpointError", "PlanError", "PlanMismatch", "TraceError"]


class TraceError(ValueError):
    """The function cannot be traced to a sharded program (the message says why and where)."""


class PlanError(ValueError):
    """No sharded program can be planned (the message names the op and the user's line)."""


class PlanMismatch(RuntimeError):
    """DTensor produced a placement the plan did not predict (a bug in vsf: please report it)."""


class NotACheckpointError(FileNotFoundError):
    """The path is missing, or is not a committed vsf checkpoint (no valid ``COMMITTED`` marker)."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file is truncated or its bytes differ from what was written."""
