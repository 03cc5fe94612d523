"""Every public error class of vsf, in one place (each is also exported from ``vsf``).

The messages say what was expected, what was found and where (a pytree key path, an op and the
user's source line). This module imports nothing of vsf's, so every layer may raise these.

Example::

    >>> try:
    ...     step(params, batch)
    ... except vsf.PlanError as e:
    ...     print(e)          # names the op and the user's line
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ApplyError",
    "CorruptCheckpointError",
    "HigherOrderGradError",
    "NotACheckpointError",
    "PlanCheckError",
    "PlanError",
    "PlanMismatch",
    "TraceError",
]


class ApplyError(ValueError):
    """``vsf.tree.apply`` cannot run the module as asked: its forward writes a buffer without
    ``mutable=True`` (or a parameter, or a buffer the state does not hold), or checkpoints
    activations reentrantly (the message names the tensor or the line)."""


class TraceError(ValueError):
    """The function cannot be traced to a sharded program (the message says why and where)."""


class PlanError(ValueError):
    """No sharded program can be planned (the message names the op and the user's line)."""


class HigherOrderGradError(NotImplementedError):
    """A gradient of a jitted function's gradient was asked for (``backward(create_graph=True)``
    through a ``vsf.jit``-ted call): not supported; differentiate inside it with ``vsf.grad``."""


class PlanMismatch(RuntimeError):
    """DTensor produced a placement the plan did not predict (a bug in vsf: please report it)."""


class PlanCheckError(RuntimeError):
    """A planned program computed a value that differs from the unsharded graph's, or that graph
    from the step run eagerly (checking mode, :mod:`vsf.jit.check`).

    ``op`` is the aten op (or ``"output"`` for a result's final redistribution, ``"trace"`` where
    the traced graph itself differs from the step run eagerly on one device), ``node`` its
    name in the traced graph, ``line`` the user's source line, ``inputs`` / ``outputs`` the
    placements in and out as ``typeof`` text, ``max_error`` the largest absolute difference
    (``inf`` where shapes or layouts disagree).
    """

    def __init__(
        self,
        message: str,
        *,
        op: str,
        node: str,
        line: str,
        inputs: Sequence[str],
        outputs: Sequence[str],
        max_error: float,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.node = node
        self.line = line
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.max_error = max_error


class NotACheckpointError(FileNotFoundError):
    """The path is missing, or is not a committed vsf checkpoint (no valid ``COMMITTED`` marker)."""


class CorruptCheckpointError(ValueError):
    """A checkpoint file is truncated or its bytes differ from what was written."""
