"""Passes over a traced step's graph that drop what the plan need not see: a name given for a remat
policy (the value itself), a loss backward's unread total weight (a constant), a cat's empty
operands (a ``transformers`` cache's ``torch.tensor([])``), a view that gives back the tensor
it was taken of (``detach``, a ``t`` of a ``t``), and an ``as_strided`` that only reshapes.

Example::

    >>> drop_skipped_cat_inputs(gm)  # %cat = cat([%empty_f32_0, %k]) -> %cat = clone(%k)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from vsf import _compat
from vsf.jit.graph import is_view
from vsf.ops.names import NAME_OP

__all__ = [
    "as_strided_as_views",
    "drop_identity_views",
    "drop_names",
    "drop_skipped_cat_inputs",
    "drop_unread_total_weights",
]

aten = torch.ops.aten
_NLL_LOSS_BACKWARD = (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
_MEAN = 1  # (torch's reduction enum: 0 none, 1 mean, 2 sum)


def drop_unread_total_weights(gm: torch.fx.GraphModule) -> None:
    """nll_loss's backward reads its ``total_weight`` (the count of the targets, or the sum of their
    class weights) only to divide a mean: for a sum or no reduction it takes a constant of the same
    shape instead, so that the count (a sum over the batch, reduced when the batch is split) is not
    computed for a value no one reads."""
    for node in gm.graph.nodes:
        if node.target in _NLL_LOSS_BACKWARD and node.args[4] != _MEAN:
            val = node.args[6].meta["val"]
            with gm.graph.inserting_before(node):
                constant = gm.graph.call_function(
                    aten.scalar_tensor.default, (0.0,), {"dtype": val.dtype, "device": val.device}
                )
            constant.meta = {**node.meta, "val": val}
            node.update_arg(6, constant)


def drop_skipped_cat_inputs(gm: torch.fx.GraphModule) -> None:
    """Drop from each ``cat`` the empty tensors, which add nothing to it (torch's legacy rule lets a
    tensor of shape ``[0]`` join a cat of any rank), and read a cat left with one tensor as a copy of it.
    A ``transformers`` cache starts each layer's keys and values as ``torch.tensor([])`` and cats the
    new ones to it: planned as written, the cat of a tensor sharded over the batch and the heads with
    a replicated constant gathers the keys and values over both (DTensor's rule replicates every
    operand), where the one-device step only copies them. A cat whose dtype its skipped operands
    promote is kept as it is.

    Example::

        >>> drop_skipped_cat_inputs(gm)  # %cat = cat([%empty_f32_0, %k]) -> %cat = clone(%k)
    """
    for node in gm.graph.find_nodes(op="call_function", target=aten.cat.default):
        parts = node.args[0]
        out = node.meta.get("val")
        kept = [t for t in parts if not _skipped_by_cat(t)]
        if len(kept) == len(parts) or not kept or out is None:
            continue
        if any(t.meta["val"].dtype != out.dtype for t in kept):
            continue
        if len(kept) > 1:
            node.update_arg(0, kept)
            continue
        _replace(gm, node, aten.clone.default, (kept[0],))


def _skipped_by_cat(t: Any) -> bool:
    """Does ``t`` (a cat's operand) add nothing to it: no elements (a legacy ``[0]``, or none along the dim)?"""
    val = t.meta.get("val") if isinstance(t, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.numel() == 0


def drop_names(gm: torch.fx.GraphModule) -> None:
    """Read every value named for a remat policy (``vsf.checkpoint_name``) as the value itself: the
    name did its work while tracing (the policy saw it), and a plan holds no copy for it."""
    for node in gm.graph.find_nodes(op="call_function", target=NAME_OP):
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)


def drop_identity_views(gm: torch.fx.GraphModule) -> None:
    """Read each view that gives back a tensor it was taken of (the same dtype, shape, strides and
    offset into the same buffer: a ``detach``, the ``t`` of a ``t``) as that tensor, except where
    the step returns it. The traced step is functional, and its backward is already in the graph,
    so a ``detach`` stops nothing; autograd's saved tensors come through one each, and a weight's
    gradient through two transposes. Planned as written, each is an op the planner places, checks
    and schedules: about a fifth of a transformer block's.

    Example::

        >>> drop_identity_views(gm)  # %mm_1 = mm(%x, %t_1), %t_1 = t(%t), %t = t(%w) -> %mm_1 = mm(%x, %w)
    """
    with _compat.metadata_reads():  # (the fake tensors' own answers: each view's are read up its chain)
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not is_view(node):
                continue
            base = node.all_input_nodes[0]
            while not _same_view(node, base) and base.op == "call_function" and is_view(base):
                base = base.all_input_nodes[0]
            if not _same_view(node, base):
                continue
            node.replace_all_uses_with(base, delete_user_cb=lambda user: user.op != "output")
            if not node.users:
                gm.graph.erase_node(node)


def _same_view(node: torch.fx.Node, base: torch.fx.Node) -> bool:
    """Are ``node``'s and ``base``'s values tensors of one dtype, shape, strides and storage offset,
    both conjugated or neither, and both negated or neither? (``conj`` of a complex tensor is a view
    that differs from it in its conjugate bit alone: Mega's EMA convolves by ``rfft``, ``conj`` and
    ``irfft``.)"""
    val, other = node.meta.get("val"), base.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and isinstance(other, torch.Tensor)
        and val.dtype == other.dtype
        and val.shape == other.shape
        and val.stride() == other.stride()
        and val.storage_offset() == other.storage_offset()
        and val.is_conj() == other.is_conj()
        and val.is_neg() == other.is_neg()
    )


def as_strided_as_views(gm: torch.fx.GraphModule) -> None:
    """Read each ``as_strided`` that lays a contiguous tensor's elements out in order in another
    shape as a ``view`` of it (the strides of dims of size 1 address nothing), and each
    ``as_strided_scatter`` that writes such a view over the whole of a contiguous tensor as its
    source viewed in that tensor's shape: ops DTensor plans, where it has no rule for these two.
    torch's decomposition of ``adaptive_avg_pool2d`` restrides its mean's size-1 dims so (Swin's
    pooler, ``AdaptiveAvgPool1d`` on a transposed input), and the backward of ``as_strided``
    scatters the gradient into zeros of the input's size so. Any other is left as it is.

    Example::

        >>> as_strided_as_views(gm)  # %a = as_strided(%mean, [4, 8, 1, 1], [8, 1, 8, 8], 0) -> view(%mean, [4, 8, 1, 1])
    """
    for node in gm.graph.find_nodes(op="call_function", target=aten.as_strided.default):
        source, size, stride, *rest = node.args
        if _reshapes(source, size, stride, rest[0] if rest else node.kwargs.get("storage_offset")):
            _replace(gm, node, aten.view.default, (source, list(size)))
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.prims.as_strided_scatter.default):
        if len(node.args) != 5:  # (its arguments named: not a case met, left as it is)
            continue
        base, source, size, stride, offset = node.args
        whole = _reshapes(base, size, stride, offset) and _contiguous(source)
        if whole and list(source.meta["val"].shape) == list(size):
            _replace(gm, node, aten.view.default, (source, list(base.meta["val"].shape)))


def _contiguous(t: Any) -> bool:
    val = t.meta.get("val") if isinstance(t, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_contiguous() and val.storage_offset() == 0


def _reshapes(source: Any, size: Any, stride: Any, offset: Any) -> bool:
    """Does ``as_strided(source, size, stride, offset)`` take all of a contiguous ``source``, in order?"""
    if not _contiguous(source) or offset not in (None, 0) or source.meta["val"].numel() != math.prod(size):
        return False
    expected = 1
    for n, step in reversed(list(zip(size, stride))):
        if n != 1 and step != expected:
            return False
        expected *= n
    return True


def _replace(gm: torch.fx.GraphModule, node: torch.fx.Node, target: Any, args: tuple[Any, ...]) -> None:
    """``node`` replaced by a call of ``target`` on ``args`` in its place, with its metadata."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args)
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
