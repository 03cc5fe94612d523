"""Checking mode's check of the trace itself: after the program (:mod:`vsf.jit.check`), the traced
graph runs unsharded end to end on the full inputs and the step runs eagerly, as plain PyTorch on
one device, on copies of them (:func:`like_eager`). A result that differs is a wrong trace, or a
wrong rewrite of it by vsf (a block stamped from another's trace, a view dropped as an identity),
which the op-by-op check cannot see: its reference is that same graph. A step that does not run
eagerly on plain tensors (a ``shard_map`` region, an expert dispatch) or draws from torch's
generator is not compared, with a warning saying why.

The two runs are the same arithmetic in another order (vsf's decompositions, a stamped block's
copied ops), so they round apart, and over a whole train step a model can amplify that far past
the checking tolerance: BatchNorm's centred sums feed gradients that are rounding noise, and Adam
moves a weight by about its learning rate wherever a gradient is near ``eps`` (a 3D ResNet's
weights lay 1e-4 apart after one step in float32, as far as torch's own float32 and float64 steps
do). So the results that differ are judged again in float64 (:func:`_in_float64`): both run once
more with the inputs, the dtypes the graph's ops name and its constants widened from float32, and
the step at float64 as the default dtype, where rounding is some nine digits smaller and a wrong
trace differs as much as before.

Example::

    >>> full = assembled_inputs(plan, locals_in)
    >>> run_checked(plan, locals_in)
    >>> like_eager(plan, full, eager_step, ["[0]['w']", "[1]"])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vsf import _compat
from vsf.errors import PlanCheckError
from vsf.jit.check import (
    _compare,
    _Differs,
    _every_shard_at_hand,
    _last_uses,
    _nodes_in,
    _reference,
    assemble,
)
from vsf.jit.classify import draws_random
from vsf.jit.graph import meta_of, output_node, placeholders_of, user_stacklevel, value_of
from vsf.jit.lower import _traced_layout
from vsf.jit.plan import Plan
from vsf.ops.region import REGION_OPS

__all__ = ["assembled_inputs", "like_eager"]


def assembled_inputs(plan: Plan, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The full values of the program's inputs (every simulated rank's shard of each, laid out as
    the plan takes it), as plain tensors of their own: for :func:`like_eager`, taken before the
    program runs (which may write a donated input's buffer).

    Example::

        >>> full = assembled_inputs(plan, [x.to_local() for x in inputs])
    """
    _every_shard_at_hand()
    return [
        assemble(plan.mesh, placements, meta_of((ph, 0)), x)
        for ph, placements, x in zip(placeholders_of(plan.graph), plan.inputs, inputs)
    ]


def _why_not_comparable(plan: Plan) -> str | None:
    """Why ``plan``'s graph has no one-device result to set against an eager run, if it has none: an
    op with no unsharded meaning (a ``shard_map`` region's boundary), or one that draws from
    torch's generator (an eager run draws anew)."""
    for node in plan.graph.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in REGION_OPS:
            return f"it holds a shard_map region ({node.target}), which runs on shards only"
        if draws_random(node.target, node.args, node.kwargs):
            return f"it draws from torch's generator ({node.target}), which an eager run draws from anew"
    return None


def _unsharded_outputs(
    plan: Plan, full_inputs: Sequence[torch.Tensor], dtypes: dict[torch.dtype, torch.dtype] | None = None
) -> list[torch.Tensor]:
    """``plan``'s graph run op by op on full values, as one device would (each op given its
    inputs in the traced layout, as the planned program gives them: :func:`_traced_layout`);
    ``dtypes``: the dtypes its ops name read as others (:func:`vsf.jit.check._reference`)."""
    full = {(ph, 0): x for ph, x in zip(placeholders_of(plan.graph), full_inputs)}
    last_use = _last_uses(plan)
    for node in plan.order:
        if not isinstance(node, torch.fx.Node) or node not in plan.nodes:
            continue
        out = _reference(plan, node, lambda a: _traced_layout(full[value_of(a)], meta_of(value_of(a))), dtypes)
        for i, o in enumerate(out if isinstance(out, (list, tuple)) else [out]):
            full[(node, i)] = o
        for a in _nodes_in((node.args, node.kwargs)):
            if last_use.get(value_of(a)) is node:
                full.pop(value_of(a), None)
    return [full[value_of(a)] for a in _nodes_in(output_node(plan.graph).args)]


def like_eager(
    plan: Plan,
    full_inputs: Sequence[torch.Tensor],
    eager: Callable[[list[torch.Tensor]], list[Any]],
    names: Sequence[str],
) -> None:
    """Check the traced graph against the step it was traced from: ``plan``'s graph run unsharded
    on ``full_inputs`` (:func:`assembled_inputs`) and ``eager`` (the step as plain PyTorch on one
    device, returning its tensor results in the graph's output order) run on copies of them must
    give the same results (``names``: their key paths) within the checking tolerance, and where
    they do not, again in float64 (:func:`_in_float64`: rounding amplified by the step is not a wrong
    trace). A result that differs raises :class:`PlanCheckError` (``op`` ``"trace"``); a step that
    cannot be compared so warns and returns.

    Example::

        >>> full = assembled_inputs(plan, locals_in)
        >>> run_checked(plan, locals_in)
        >>> like_eager(plan, full, eager_step, ["[0]['w']", "[1]"])
    """
    if (why := _why_not_comparable(plan)) is not None:
        return _not_compared(why)
    with _compat.local_mode_disabled():
        try:
            want = _unsharded_outputs(plan, full_inputs)
        except Exception as e:  # (an op of the graph that runs on shards only)
            return _not_compared(f"the graph did not run unsharded ({_first_line(e)})")
        try:
            got = eager([x.clone() for x in full_inputs])
        except Exception as e:  # (the step as it is: whatever it raises on plain tensors)
            return _not_compared(f"the step raised on plain tensors ({_first_line(e)})")
        if len(got) != len(want):
            return _not_compared(f"the eager step returned {len(got)} tensors where the trace returned {len(want)}")
        wrong = _differing(got, want, names)
        again = _in_float64(plan, full_inputs, eager, names, [k for k, _, _ in wrong]) if wrong else {}
    if isinstance(again, dict):
        wrong = [(k, name, e) for k, name, e in wrong if k in again]
    if wrong:
        k, name, e = max(wrong, key=lambda w: w[2].max_error)
        if isinstance(again, str):
            wide = f" (not rounding? vsf could not run them in float64 to tell: {again})"
        else:
            wide = f"; in float64 too: {again[k].what}, max error {again[k].max_error:.3g}"
        output = output_node(plan.graph)
        raise PlanCheckError(
            f"vsf.jit checking mode: the traced graph, run unsharded, differs from the step run eagerly on one device in "
            f"{len(wrong)} of {len(names)} results ({', '.join(w[1] for w in wrong[:8])}{', ...' if len(wrong) > 8 else ''}); "
            f"most in result {k} ({name}): {e.what}, max error {e.max_error:.3g}{wide}. The trace, or vsf's rewrite of "
            "it, is wrong (the op-by-op check compares the program with that graph, so it cannot see this): please report "
            "it, saying whether it still differs with vsf.config.stamp_blocks = False (a block stamped from another's trace)",
            op="trace",
            node=value_of(_nodes_in(output.args)[k])[0].name,
            line="",
            inputs=[],
            outputs=[],
            max_error=e.max_error,
        )


def _differing(
    got: Sequence[Any], want: Sequence[torch.Tensor], names: Sequence[str]
) -> list[tuple[int, str, _Differs]]:
    """The results of the eager step (``got``) that differ from the traced graph's (``want``) beyond
    the checking tolerance: each one's number, name and difference."""
    wrong = []
    for k, (name, g, w) in enumerate(zip(names, got, want)):
        try:
            if not isinstance(g, torch.Tensor):
                raise _Differs(f"the eager step's is a {type(g).__name__}, not a tensor", float("inf"))
            _compare(g.detach(), w, "the eager step's", "the traced graph's")
        except _Differs as e:
            wrong.append((k, name, e))
    return wrong


# float32 and complex64, widened: the dtypes a float32 step's graph names and its tensors hold
_WIDER = {torch.float32: torch.float64, torch.complex64: torch.complex128}


def _in_float64(
    plan: Plan,
    full_inputs: Sequence[torch.Tensor],
    eager: Callable[[list[torch.Tensor]], list[Any]],
    names: Sequence[str],
    results: Sequence[int],
) -> dict[int, _Differs] | str:
    """The graph run unsharded and the step run eagerly again, in float64: the inputs, the dtypes
    the graph's ops name (a loss's ``total_weight``, a factory's default dtype) and its constants
    widened from float32 (complex64 to complex128), and the step run with float64 as the default
    dtype (what it makes without naming a dtype, alike). Of ``results``, those that still differ,
    each with how; or why the two did not run so (a kernel that takes float32 alone, a module's
    own float32 tensor).

    Example::

        >>> _in_float64(plan, full, eager_step, names, [3, 7])   # rounding in float32 alone
        {}
    """
    wide = [x.to(_WIDER[x.dtype]) if x.dtype in _WIDER else x for x in full_inputs]
    was = torch.get_default_dtype()
    try:
        want = _unsharded_outputs(plan, wide, _WIDER)
        torch.set_default_dtype(torch.float64)
        got = eager([x.clone() for x in wide])
    except Exception as e:
        return _first_line(e)
    finally:
        torch.set_default_dtype(was)
    if len(got) != len(want):
        return f"the eager step returned {len(got)} tensors where the trace returned {len(want)}"
    asked = set(results)
    return {k: e for k, _, e in _differing(got, want, names) if k in asked}


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _not_compared(why: str) -> None:
    warnings.warn(
        f"vsf.jit checking mode did not compare the traced graph with the step run eagerly: {why}",
        stacklevel=user_stacklevel(),
    )
