"""Which values a :func:`vsf.remat` region saves for the backward, with JAX's names and meanings
(``jax.checkpoint_policies``); everything else the backward computes again.

A policy is a callable ``policy(op, *args, **kwargs) -> bool``: ``op`` is the aten op that made
the value (``torch.ops.aten.mm.default``), ``args`` and ``kwargs`` its arguments; ``True`` saves
its results. A value named with :func:`vsf.checkpoint_name` is the result of the op
``torch.ops.vsf.checkpoint_name.default``, whose second argument is its name.

* :func:`everything_saveable`: save everything (no recompute; remat does nothing).
* :func:`nothing_saveable`: save nothing but the region's inputs (``vsf.remat``'s default, as ``jax.checkpoint``'s).
* :func:`dots_saveable`: save the results of matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``,
  scaled and grouped matmuls) and of attention kernels (JAX's attention is ``dot_general``\\ s).
* :func:`dots_with_no_batch_dims_saveable`: only matmuls without batch dims (``mm``, ``addmm``,
  ``_scaled_mm``): a linear layer's output, not attention's nor ``bmm``'s.
* :func:`save_only_these_names`: only the values named with one of ``names``.
* :func:`save_any_names_but_these`: every named value except those named with one of ``names``.

Example::

    >>> block = vsf.remat(block, policy=vsf.remat_policies.dots_saveable)
    >>> block = vsf.remat(block, policy=vsf.remat_policies.save_only_these_names("attn_out"))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vsf.ops.names import NAME_OP

__all__ = [
    "Policy",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "nothing_saveable",
    "save_any_names_but_these",
    "save_only_these_names",
]

aten = torch.ops.aten

Policy = Callable[..., bool]

_NO_BATCH_DOTS = frozenset({aten.mm.default, aten.addmm.default, aten._scaled_mm.default})
_BATCHED_DOTS = frozenset(
    {
        aten.bmm.default,
        aten.baddbmm.default,
        aten._grouped_mm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


def everything_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save every value: the region is not recomputed."""
    return True


def nothing_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save nothing: the backward recomputes the whole region from its inputs."""
    return False


def dots_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save the results of matmuls and attention kernels; recompute the rest (elementwise ops, norms)."""
    return op in _NO_BATCH_DOTS or op in _BATCHED_DOTS


def dots_with_no_batch_dims_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save the results of matmuls without batch dims (a linear layer's); recompute the rest."""
    return op in _NO_BATCH_DOTS


def save_only_these_names(*names: str) -> Policy:
    """A policy that saves only the values named (:func:`vsf.checkpoint_name`) with one of ``names``."""
    wanted = frozenset(names)
    return lambda op, *args, **kwargs: op is NAME_OP and args[1] in wanted


def save_any_names_but_these(*names: str) -> Policy:
    """A policy that saves every named value (:func:`vsf.checkpoint_name`) except those named with one of ``names``."""
    unwanted = frozenset(names)
    return lambda op, *args, **kwargs: op is NAME_OP and args[1] not in unwanted
