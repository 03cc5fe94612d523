"""Adam's step in one pass over memory: two vsf ops on PyTorch's fused Adam kernel.

``vsf::adam_step(grad, mu, nu, param, count, lr, decay, b1, b2, eps) -> (update, mu', nu')``
reads the gradient and both moments once and writes the new moments and the update
``decay * param - lr * m_hat / (sqrt(v_hat) + eps)`` (``m_hat``, ``v_hat`` bias-corrected with
``count``, the updates done including this one; ``param`` may be ``None``, for no decay), where
Adam in ``torch._foreach_*`` ops makes ~20 passes. The update is the fused kernel's step applied
to ``decay * param`` (to zeros without decay), so without decay it is bit for bit the step
``torch.optim.Adam(fused=True)`` adds to its param.

``adam_step`` is functional (new moments, as every vsf.optim transform); ``vsf::adam_step_``
updates ``mu`` and ``nu`` in place and returns the update alone. Its schema says so
(``Tensor(a!)``), which is how ``vsf.jit``'s lowering finds it: where the moments are donated
buffers used last here, the program calls ``adam_step_`` on them, as it calls ``add_`` for a
donated ``add``. (It returns no alias of the moments: then PyTorch's functionalization, hence
Inductor, takes it as it is, a mutating op whose new moments are ``adam_step``'s last results.)
Both have fake kernels: a program that calls them compiles with Inductor
(``vsf.jit(backend="inductor")``), which runs the fused kernel on buffers of its own.

``adam_step`` is elementwise over ``grad``, ``mu``, ``nu`` and ``param`` (``count``, ``lr`` and
``decay`` are 0-d); DTensor (hence ``vsf.jit``'s planner, which only ever sees ``adam_step``)
learns that rule here.

Under ``vsf.jit(backend="inductor")`` both ops are compiled as the kernel's math in torch ops
(:func:`adam_math`, registered with :func:`vsf.jit.runner.register_inductor_math`), which Inductor
fuses with the ops around them: one pass per leaf reads the gradient, both moments and the
param and writes the donated moments and param, where the opaque op is one call per leaf (36
for the 2-layer GPT of ``benchmarks/bench_torch.py --quick``, ~50 us each on a CPU) between
the passes that scale the param and add the update. The math is the kernel's (a ``lerp`` for the first moment, the bias
corrections in float64, the step size rounded to the moments' dtype), so the numbers are the
fused kernel's up to rounding: Inductor may contract and order the float ops otherwise.
"""

from __future__ import annotations

import torch

from vsf import _compat
from vsf.jit.runner import register_inductor_math
from vsf.jit.strategies import register_elementwise
from vsf.jit.trace import per_leaf

__all__ = ["adam_step"]

_ARGS = "Tensor? param, Tensor count, Tensor lr, Tensor decay, float b1, float b2, float eps"
torch.library.define("vsf::adam_step", f"(Tensor grad, Tensor mu, Tensor nu, {_ARGS}) -> (Tensor, Tensor, Tensor)")
torch.library.define("vsf::adam_step_", f"(Tensor grad, Tensor(a!) mu, Tensor(b!) nu, {_ARGS}) -> Tensor")


@torch.library.impl("vsf::adam_step_", "CompositeExplicitAutograd")
def _adam_step_inplace(
    grad: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    param: torch.Tensor | None,
    count: torch.Tensor,
    lr: torch.Tensor,
    decay: torch.Tensor,
    b1: float,
    b2: float,
    eps: float,
) -> torch.Tensor:
    # The kernel walks every tensor as one flat array: all must share one memory order.
    if not (mu.is_contiguous() and nu.is_contiguous()):
        raise ValueError(
            f"vsf::adam_step_ updates contiguous moments only, got strides {mu.stride()} and {nu.stride()}"
        )
    if param is None:
        update = torch.zeros_like(mu)
    else:
        update = torch.mul(param.to(mu.dtype), decay.to(mu.dtype)).contiguous()  # (a 0-d param: not promoted)
    _compat.fused_adam_(update, grad.to(mu.dtype).contiguous(), mu, nu, count, lr, b1, b2, eps)
    return update


@torch.library.impl("vsf::adam_step", "CompositeExplicitAutograd")
def _adam_step(
    grad: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    param: torch.Tensor | None,
    count: torch.Tensor,
    lr: torch.Tensor,
    decay: torch.Tensor,
    b1: float,
    b2: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, v = mu.clone(memory_format=torch.contiguous_format), nu.clone(memory_format=torch.contiguous_format)
    return torch.ops.vsf.adam_step_(grad, m, v, param, count, lr, decay, b1, b2, eps), m, v


@torch.library.register_fake("vsf::adam_step")
def _adam_step_fake(
    grad: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    param: torch.Tensor | None,
    count: torch.Tensor,
    lr: torch.Tensor,
    decay: torch.Tensor,
    b1: float,
    b2: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.empty_like(mu, memory_format=torch.contiguous_format) for _ in range(3))  # type: ignore[return-value]


@torch.library.register_fake("vsf::adam_step_")
def _adam_step_inplace_fake(
    grad: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    param: torch.Tensor | None,
    count: torch.Tensor,
    lr: torch.Tensor,
    decay: torch.Tensor,
    b1: float,
    b2: float,
    eps: float,
) -> torch.Tensor:
    return torch.empty_like(mu, memory_format=torch.contiguous_format)


def adam_math(
    grad: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    param: torch.Tensor | None,
    count: torch.Tensor,
    lr: torch.Tensor,
    decay: torch.Tensor,
    b1: float,
    b2: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``vsf::adam_step`` in torch ops (what Inductor compiles instead of the fused kernel):
    ``(update, mu', nu')``, the fused kernel's math.

    Example::

        >>> lr, decay = torch.tensor(1e-3, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
        >>> update, m, v = adam_math(g, mu, nu, None, torch.tensor(1.0), lr, decay, 0.9, 0.999, 1e-8)
    """
    dtype = mu.dtype
    g = grad.to(dtype)
    m = torch.lerp(mu, g, 1 - b1)
    v = torch.addcmul(nu * b2, g, g, value=1 - b2)
    steps = count.to(torch.float64)
    step_size = (lr.to(steps.device, torch.float64) / (1 - torch.pow(b1, steps))).to(dtype)
    root = torch.sqrt(1 - torch.pow(b2, steps)).to(dtype)
    start = torch.zeros_like(mu) if param is None else param.to(dtype) * decay.to(mu.device, dtype)
    return start - step_size * m / (v.sqrt() / root + eps), m, v


def adam_math_(
    grad: torch.Tensor,
    mu: torch.Tensor,
    nu: torch.Tensor,
    param: torch.Tensor | None,
    count: torch.Tensor,
    lr: torch.Tensor,
    decay: torch.Tensor,
    b1: float,
    b2: float,
    eps: float,
) -> torch.Tensor:
    """``vsf::adam_step_`` in torch ops: :func:`adam_math` with the new moments written into
    ``mu`` and ``nu``; returns the update."""
    update, m, v = adam_math(grad, mu, nu, param, count, lr, decay, b1, b2, eps)
    mu.copy_(m)
    nu.copy_(v)
    return update


register_elementwise(torch.ops.vsf.adam_step.default, outputs=3)
register_inductor_math(torch.ops.vsf.adam_step.default, adam_math)
register_inductor_math(torch.ops.vsf.adam_step_.default, adam_math_)


def adam_step(
    grads: list[torch.Tensor],
    mus: list[torch.Tensor],
    nus: list[torch.Tensor],
    params: list[torch.Tensor | None],
    count: torch.Tensor,
    lr: float | torch.Tensor,
    decay: float | torch.Tensor,
    b1: float,
    b2: float,
    eps: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``(updates, new mus, new nus)`` of one Adam step per leaf:
    ``decay * param - lr * m_hat / (sqrt(v_hat) + eps)`` (``lr=-1`` and no params give Adam's
    direction itself), ``count`` the updates done including this one; a ``None`` param has no
    decay. The tensors are local shards (or the fake tensors of a trace), all on one device.

    Example::

        >>> updates, mus, nus = adam_step(grads, mus, nus, [None] * len(grads), torch.tensor(1.0), 1e-3, 0.0, 0.9, 0.999, 1e-8)
    """
    if not grads:
        return [], [], []
    device = mus[0].device
    count = count.to(device=device, dtype=torch.float32)
    lr = _compat.fused_adam_lr(lr, device)
    decay = (
        decay.to(dtype=torch.float64) if isinstance(decay, torch.Tensor) else torch.full((), decay, dtype=torch.float64)
    )
    rows = [(g, m, v, p, count, lr, decay, b1, b2, eps) for g, m, v, p in zip(grads, mus, nus, params)]
    out = per_leaf(torch.ops.vsf.adam_step, rows, "adam_step")
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]
