"""One pipeline stage: its programs, and the local tensors it exchanges with its neighbours.

A stage is a function ``f(params, *x) -> y`` over the stage's params (DTensors on the stage's
mesh: the pipeline mesh at that ``pp`` coordinate, over the other axes, see ``Mesh.at``) and its
inputs. It runs as a ``vsf.jit``-ted program planned over the stage's mesh, which torch autograd
differentiates (its forward and backward are planned programs), so a schedule can run the
forward of one microbatch now and its backward later.

Between stages activations travel as local tensors: each rank sends its shard to the rank at
the same coordinates of the other axes in the next stage, so a stage's result is pinned to the
activation layout (``out``, e.g. the batch dim over ``dp``) that the next stage reads it in.
:class:`StageModule` is what ``torch.distributed.pipelining.PipelineStage`` runs (and what the
in-order runner runs under ``vsf.simulate``): ``forward`` takes and returns local tensors and
wraps them as DTensors around the jitted program.
A stage whose forward writes state (:mod:`vsf.pipeline.state`) has a program returning ``(y,
state)``; its :class:`StageModule` keeps the state, each microbatch's forward reading what the one
before wrote.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf.jit import jit
from vsf.sharding.named import NamedSharding
from vsf.sharding.put import device_put

__all__ = [
    "Boundary",
    "StageModule",
    "as_global",
    "gather_program",
    "local_of",
    "mean_reducer",
    "shard_bytes",
    "stage_program",
    "stand_in",
]

Boundary = tuple[NamedSharding, tuple[int, ...]]  # a value's layout and global shape (one microbatch)


def as_global(local: torch.Tensor, where: Boundary) -> DTensor:
    """The DTensor of global shape ``where[1]`` laid out as ``where[0]`` whose shard here is
    ``local`` (differentiable: the gradient comes back as ``local``'s)."""
    sharding, shape = where
    stride = tuple(torch.empty(shape, device="meta").stride())
    return DTensor.from_local(
        local, sharding.mesh.device_mesh, sharding.placements, run_check=False, shape=shape, stride=stride
    )


def stand_in(where: Boundary, dtype: torch.dtype, grad: bool = False) -> DTensor:
    """Zeros of ``where``'s global shape laid out as ``where``: a value with the signature of one a
    stage receives (its plan depends on shapes, layouts and ``requires_grad`` only).

    Example::

        >>> stand_in((act, (2, 8, 16)), torch.float32, grad=True).requires_grad
        True
    """
    sharding, shape = where
    x = device_put(torch.zeros(shape, dtype=dtype), sharding)
    return x.requires_grad_(True) if grad else x


def shard_bytes(where: Boundary, dtype: torch.dtype) -> int:
    """Bytes of the largest shard of a ``dtype`` value of ``where``'s shape and layout.

    Example::

        >>> shard_bytes((NamedSharding(mesh, P("dp")), (2, 8, 16)), torch.float32)   # dp = 2
        512
    """
    sharding, shape = where
    return math.prod(sharding.shard_shape(shape)) * dtype.itemsize


def local_of(x: DTensor, sharding: NamedSharding) -> torch.Tensor:
    """``x``'s shard here, laid out as ``sharding`` (differentiable)."""
    if tuple(x.placements) != tuple(sharding.placements):
        x = x.redistribute(sharding.mesh.device_mesh, sharding.placements)
    return x.to_local(grad_placements=sharding.placements)


def stage_program(
    fn: Callable[..., Any],
    out: Any,
    unreduced_grad_argnums: Sequence[int] = (),
    unsharded_grad_axes: Sequence[str] = (),
    on_deferred_grads: Callable[[Callable[[], None]], None] | None = None,
    backend: str = "eager",
) -> Any:
    """``vsf.jit(fn)`` with its result pinned to ``out`` (a ``NamedSharding``, or a pytree prefix
    of a result with state: ``(activation, {name: state's layout})``; planned on the first call, forward and
    backward, and reused while shapes and layouts stay); the gradients of the arguments
    ``unreduced_grad_argnums`` (a stage's params) come back unreduced over the axes they are
    replicated on, and whole and unreduced over the ``unsharded_grad_axes`` they are split on
    (the batch's: fsdp), for the step to reduce once (see ``vsf.jit``). With
    ``on_deferred_grads`` (a zero-bubble schedule), the backward computes the input gradients only
    and hands it the function that computes those params' gradients later. ``backend``: ``vsf.jit``'s
    (``"inductor"`` compiles the forward and backward programs)."""
    deferred = tuple(unreduced_grad_argnums) if on_deferred_grads is not None else ()
    return jit(
        fn,
        out_shardings=out,
        unreduced_grad_argnums=unreduced_grad_argnums,
        unsharded_grad_axes=unsharded_grad_axes,
        deferred_grad_argnums=deferred,
        on_deferred_grads=on_deferred_grads,
        backend=backend,
    )


def mean_reducer(microbatches: int, shardings: dict[str, NamedSharding], backend: str = "eager") -> Any:
    """The jitted program that turns a stage's gradients summed over ``microbatches`` (a dict
    ``name -> DTensor``, unreduced where the stage program left them so) into their mean, laid out
    as ``shardings``: every pending reduction of the step at once, bucketed by the planner
    (``backend``: ``vsf.jit``'s).

    Example::

        >>> mean = mean_reducer(4, {"w": NamedSharding(mesh, P())})
        >>> mean({"w": w.grad})["w"].placements                   # w.grad: Partial over dp
        (Replicate(),)
    """

    def mean_of_microbatches(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: g / microbatches for k, g in grads.items()}

    return jit(mean_of_microbatches, out_shardings=shardings, backend=backend)


def gather_program(shardings: dict[str, NamedSharding], backend: str = "eager") -> Any:
    """The jitted program laying a stage's params (a dict ``name -> DTensor``) out as
    ``shardings``: the params split over the batch's axes gathered once a step (``backend``:
    ``vsf.jit``'s).

    Example::

        >>> gather = gather_program({"w": NamedSharding(stage_mesh, P(None, "tp"))})
        >>> gather({"w": w})["w"].placements                      # w: P("fsdp", "tp")
        (Replicate(), Shard(dim=1))
    """

    def gathered(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(params)

    return jit(gathered, out_shardings=shardings, backend=backend)


class StageModule(torch.nn.Module):
    """A stage as an ``nn.Module`` over local tensors: ``forward(*x_local) -> y_local``.

    ``weights`` are the stage's params (DTensor leaves requiring grad, in ``names`` order), held
    as ``nn.Parameter`` s so torch's schedules accumulate their gradients; ``ins`` the layout and
    global microbatch shape of each input, ``out`` the result's layout and shape. ``program`` is
    :func:`stage_program` of the stage function (made once, so later steps reuse its plan).
    ``state`` (``None`` for a stage without): the stage's state (DTensors), which each
    ``forward`` passes to the program and replaces by the state it returns.

    Example::

        >>> mod = StageModule(stage_program(block_fn, act), names, weights, [(act, (2, 8, 16))], (act, (2, 8, 16)), 1)
        >>> y_local = mod(x_local)
    """

    def __init__(
        self,
        program: Any,
        names: Sequence[str],
        weights: Sequence[torch.Tensor],
        ins: Sequence[Boundary],
        out: Boundary,
        index: int,
        state: dict[str, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.names = tuple(names)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(w) for w in weights])
        self.ins, (self.out, self.out_shape), self.index = list(ins), out, index
        self.program, self.state = program, state

    def params(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.weights))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        state = () if self.state is None else (self.state,)
        y = self.program(self.params(), *state, *[as_global(x, where) for x, where in zip(xs, self.ins)])
        if self.state is not None:
            y, written = y
            self.state = {k: v.detach() for k, v in written.items()}
        if torch.is_grad_enabled() and y.grad_fn is None and any(w.requires_grad for w in self.weights):
            raise RuntimeError(
                f"pipeline stage {self.index}: its vsf.jit program returned a result without an autograd graph, so no gradient could reach the stage's params"
            )
        return local_of(y, self.out)
