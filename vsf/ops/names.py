"""A name on a value, for rematerialisation policies (JAX's ``checkpoint_name``): the op
``vsf::checkpoint_name(x, name)`` returns ``x``'s value, and its gradient is the cotangent as it
is. A policy of :func:`vsf.remat` sees the op and its name; :func:`vsf.jit`'s trace removes it,
so a plan never holds it.

Example::

    >>> y = NAME_OP(x, "attn_out")   # what vsf.checkpoint_name(x, "attn_out") calls
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["NAME_OP"]


@torch.library.custom_op("vsf::checkpoint_name", mutates_args=())
def _checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.clone()  # (a custom op may not return its input: eagerly, the name costs one copy)


@_checkpoint_name.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


_checkpoint_name.register_autograd(_backward)

NAME_OP = torch.ops.vsf.checkpoint_name.default
