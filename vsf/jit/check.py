"""Checking mode: run a jitted program beside its unsharded graph and stop at the first op that differs.

Under :func:`vsf.simulate` (real numbers) every rank's shard of every value is at hand, so each
value the planned program computes can be assembled into the full tensor its plan placements
describe (shards placed by vsf's own layout, partial values reduced, replicas compared) and set
against what the traced global graph computes. :class:`Checker` does that op by op while
:func:`vsf.jit.lower.execute` walks the plan: each op of the unsharded graph runs on the full values
the planned program gave its inputs, so rounding differences do not pile up and the first op that
differs is the one at fault (its own sharding or the redistributions of its inputs). Random ops
(the planned program draws its own numbers) and ``empty`` buffers are not compared; their
assembled result feeds the ops after them (an ``empty`` buffer zeroed first on every rank: its
replicas, garbage otherwise, then agree where a model writes it piece by piece).

The traced graph itself is checked too, against the step run eagerly (:mod:`vsf.jit.check_trace`).

Turn it on with ``vsf.config.check_plan = True`` (every jitted call checks) or call
``f.check(*args)`` (this call only): two switches, one code path. The flag checks a script as it
is, whichever functions it jits and wherever it calls them (a step inside a library or a training
loop); the method checks one call of one function, in a notebook or a test, and leaves no global
state behind. The error is a :class:`PlanCheckError` naming the op, the user's source line, the
placements in and out and the largest error. Checking mode assembles every value whole (and keeps
it until the last op that reads it) and computes every op twice: it is for debugging, not training.

Example::

    >>> with vsf.simulate(2):
    ...     step.check(params, batch)       # raises PlanCheckError at the first op that differs
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Partial, Replicate
from torch.fx.node import map_aggregate, map_arg

from vsf import _compat, config, runtime
from vsf.errors import PlanCheckError
from vsf.jit.classify import draws_random
from vsf.jit.graph import (
    Value,
    is_tensor_node,
    meta_of,
    output_node,
    placeholders_of,
    source_line,
    value_of,
)
from vsf.jit.lower import execute
from vsf.jit.plan import Placements, Plan, as_contiguous, is_shard, split_dim
from vsf.jit import manual
from vsf.ops.region import REGION_OPS
from vsf.sharding.inspect import type_string
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import from_placements
from vsf.sharding.placement import balanced_order, kind_of

__all__ = ["Checker", "assemble", "run_checked"]


class _Differs(Exception):
    """What :func:`assemble` or the comparison found wrong with one value (turned into a PlanCheckError)."""

    def __init__(self, what: str, max_error: float) -> None:
        super().__init__(what)
        self.what = what
        self.max_error = max_error


def assemble(mesh: Mesh, placements: Placements, meta: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The full value that every simulated rank's shard of ``local`` forms when laid out as
    ``placements`` over ``mesh`` (``meta`` gives the global shape and dtype), as a plain tensor.

    Shards are placed by vsf's layout (:meth:`NamedSharding.index`), pending reductions
    (``Partial``) are carried out, and replicas must agree with the first copy. A shard of the
    wrong shape or differing replicas raise (the message says which rank).

    A nesting of splits no ``P`` expresses (a step of a redistribution) is gathered by DTensor instead.

    Example::

        >>> full = assemble(mesh, (Shard(0),), meta, x.to_local())
    """
    try:
        layout = from_placements(
            mesh, tuple(Replicate() if isinstance(p, Partial) else p for p in placements), meta.ndim
        )
    except ValueError:
        return _gathered(mesh, placements, meta, local)
    if layout.packed:  # (its view, a transpose of the pieces, is a copy: DTensor gathers a strided shard)
        return _gathered(mesh, placements, meta, local)
    if layout.balanced:  # assembled in the balanced view, whose blocks are the ranks' shards; then put in order
        view = assemble(
            mesh, as_contiguous(placements), layout.index_view(torch.empty_like(meta, device="meta")), local
        )
        return _in_order(mesh, placements, view)
    partial = [(axis, p) for axis, p in zip(mesh.device_axes, placements) if isinstance(p, Partial)]
    held = {a for d in range(meta.ndim) for a in layout.spec.entry_axes(d)} | {a for a, _ in partial}
    shape = tuple(meta.shape)
    shards = _compat.local_shards(local, runtime.rank())
    copies: dict[tuple[int, ...], torch.Tensor] = {}
    with _compat.local_mode_disabled():
        for r in mesh.devices:
            coord = mesh.coordinate(r)
            key = tuple(coord[a] for a, _ in partial)
            full = copies.setdefault(key, torch.zeros(shape, dtype=meta.dtype, device=shards[r].device))
            block = layout.index_view(full)[layout.index(shape, r)]
            if tuple(block.shape) != tuple(shards[r].shape):
                raise _Differs(
                    f"rank {r} holds a shard of shape {tuple(shards[r].shape)}, the placements give {tuple(block.shape)}",
                    float("inf"),
                )
            if all(coord[a] == 0 for a in mesh.axis_names if a not in held):
                block.copy_(shards[r])
            else:
                _compare(shards[r], block, f"rank {r}'s copy", "the first copy's")
        for _, p in reversed(partial):
            copies = _reduce_last_axis(copies, p)
    return copies[()]


def _gathered(mesh: Mesh, placements: Placements, meta: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The full value as DTensor's redistribution to ``Replicate`` gathers it (first rank's copy);
    balanced splits gathered as their view's contiguous shards, then put in order."""
    full = _compat.redistribute_local(
        local,
        mesh.device_mesh,
        as_contiguous(tuple(placements)),
        (Replicate(),) * len(placements),
        shape=meta.shape,
        stride=meta.stride(),
        dtype=meta.dtype,
    )
    return _in_order(mesh, placements, _compat.local_shards(full, runtime.rank())[mesh.devices[0]].detach().clone())


def _in_order(mesh: Mesh, placements: Placements, view: torch.Tensor) -> torch.Tensor:
    """``view`` (a whole value in the balanced order of ``placements``' balanced splits) in its
    original order. A balanced split of groups (a view's merge) reorders within each group of the
    block the earlier mesh dims' shards leave: the dim holds that many groups per such block."""
    for k, p in enumerate(placements):
        if kind_of(p) == "balanced":
            blocks = math.prod(
                mesh.axis_size(a)
                for j, (a, q) in enumerate(zip(mesh.device_axes, placements))
                if j < k and is_shard(q) and split_dim(q) == p.dim
            )
            order = balanced_order(view.shape[p.dim], mesh.axis_size(mesh.device_axes[k]), blocks * p.groups)
            view = view.index_select(p.dim, torch.argsort(order))
    return view


def _reduce_last_axis(copies: dict[tuple[int, ...], torch.Tensor], p: Partial) -> dict[tuple[int, ...], torch.Tensor]:
    """Carry out the pending reduction ``p`` over the last partial axis of the copies' keys."""
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for key, v in copies.items():
        groups.setdefault(key[:-1], []).append(v)
    try:
        return {k: _compat.reduce_partial(p, vs) for k, vs in groups.items()}
    except ValueError as e:
        raise _Differs(str(e), float("inf")) from None


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    rtol, atol = config.check_tolerance
    if dtype in (torch.float16, torch.bfloat16):
        return max(rtol, 1e-2), max(atol, 1e-3)
    return rtol, atol


def _compare(got: torch.Tensor, want: torch.Tensor, what: str, than: str) -> None:
    """Raise :class:`_Differs` unless ``got`` (``what``) equals ``want`` (``than``) within the
    checking tolerance (exactly for integers and booleans; NaN where ``want`` has NaN)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise _Differs(
            f"{what} is {type_string(tuple(got.shape), got.dtype, None)}, {than} {type_string(tuple(want.shape), want.dtype, None)}",
            float("inf"),
        )
    if not (got.is_floating_point() or got.is_complex()):
        wrong = got != want
        if wrong.any():
            err = float("inf") if got.dtype == torch.bool else float((got.double() - want.double()).abs().max())
            raise _Differs(f"{what} differs from {than} in {int(wrong.sum())} of {got.numel()} elements", err)
        return
    rtol, atol = _tolerance(got.dtype)
    close = torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if not close.all():
        err = (got.double() - want.double()).abs().nan_to_num(float("inf"))
        raise _Differs(
            f"{what} differs from {than} in {int((~close).sum())} of {got.numel()} elements (rtol={rtol:g}, atol={atol:g})",
            float(err[~close].max()),
        )


def _nodes_in(args: Any) -> list[torch.fx.Node]:
    """The graph nodes in (nested) fx arguments, in order, as often as they occur."""
    found: list[torch.fx.Node] = []
    map_arg(args, lambda n: found.append(n) or n)
    return found


aten = torch.ops.aten
_UNINITIALISED = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_like.default,
        aten.empty_strided.default,
        aten.empty_permuted.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)


def _unchecked(node: torch.fx.Node) -> bool:
    """Is ``node``'s value not the unsharded op's to compare: random numbers, memory left
    uninitialised, or a value leaving a manual region (its body has no unsharded op; its
    assembled results are what later ops are checked against)?"""
    return (
        node.target in _UNINITIALISED or node.target in REGION_OPS or draws_random(node.target, node.args, node.kwargs)
    )


def _reference(
    plan: Plan,
    node: torch.fx.Node,
    full: Callable[[torch.fx.Node], torch.Tensor],
    dtypes: dict[torch.dtype, torch.dtype] | None = None,
) -> Any:
    """The op ``node`` run unsharded, on the full values (``full``) of its tensor arguments;
    ``dtypes``: each dtype its arguments name, and a constant tensor's, read as the one it maps to
    (float32 as float64: :mod:`vsf.jit.check_trace`)."""
    if node.op == "get_attr":
        held = getattr(plan.graph, node.target)
        return (
            held.to(dtypes[held.dtype]) if dtypes and isinstance(held, torch.Tensor) and held.dtype in dtypes else held
        )
    args, kwargs = map_arg((node.args, node.kwargs), lambda a: full(a) if is_tensor_node(a) else a)
    if dtypes:
        args, kwargs = map_aggregate((args, kwargs), lambda a: dtypes.get(a, a) if isinstance(a, torch.dtype) else a)
    if plan.nodes[node].op.kind == "constraint":
        return args[0]
    with _compat.local_mode_disabled():
        return node.target(*args, **kwargs)


def _last_uses(plan: Plan) -> dict[Value, torch.fx.Node]:
    """The op that reads each value last, in the order the program runs; graph results are read
    at the end (by no op), so they are left out."""
    last: dict[Value, torch.fx.Node] = {}
    for node in plan.order:
        if isinstance(node, torch.fx.Node) and node in plan.nodes:
            for a in _nodes_in((node.args, node.kwargs)):
                last[value_of(a)] = node
    output = output_node(plan.graph)
    for a in _nodes_in(output.args):
        last.pop(value_of(a), None)
    return last


class Checker:
    """Checks one run of ``plan`` op by op: call it after each op with the op's local results
    (as :func:`vsf.jit.lower.execute` does when given it), then :meth:`outputs` with the program's results.

    Example::

        >>> check = Checker(plan, locals_in)
        >>> check.outputs(execute(plan, locals_in, check))
    """

    def __init__(self, plan: Plan, inputs: Sequence[torch.Tensor]) -> None:
        _every_shard_at_hand()
        self.plan = plan
        self.full: dict[Value, torch.Tensor] = {}
        self.last_use = _last_uses(plan)
        for ph, placements, x in zip(placeholders_of(plan.graph), plan.inputs, inputs):
            v = (ph, 0)
            self.full[v] = self._assembled(v, placements, x, ph)

    def __call__(self, node: torch.fx.Node, outs: Sequence[Any]) -> None:
        """Compare the op ``node``'s local results ``outs`` with the unsharded op on its inputs' full values."""
        if manual.inside(node):
            return  # a region's body value: each rank's own, no global value to assemble
        step = self.plan.nodes[node]
        if node.target in _UNINITIALISED:  # zeroed (uninitialised memory may hold anything): replicas then agree, and
            for o in outs:  # what the program reads of it before writing it is read alike by the unsharded graph
                if isinstance(o, torch.Tensor):
                    o.zero_()
        want = None if _unchecked(node) else self._reference(node)
        wants = want if isinstance(want, (list, tuple)) else [want]
        for i, (o, placements) in enumerate(zip(outs, step.outs)):
            if placements is None:
                continue
            got = self._assembled((node, i), placements, o, node)
            if want is not None:
                self._check(node, got, wants[i], f"output {i}" if len(step.outs) > 1 else "the result")
            self.full[(node, i)] = got
        for a in _nodes_in((node.args, node.kwargs)):
            if self.last_use.get(value_of(a)) is node:
                self.full.pop(value_of(a), None)

    def outputs(self, outs: Sequence[torch.Tensor]) -> None:
        """Compare the program's results (after their final redistributions) with the graph's outputs."""
        output = output_node(self.plan.graph)
        for k, (a, placements, o) in enumerate(zip(_nodes_in(output.args), self.plan.outputs, outs)):
            v = value_of(a)
            try:
                _compare(
                    assemble(self.plan.mesh, placements, meta_of(v), o),
                    self.full[v],
                    f"result {k} (node {v[0].name})",
                    "the unsharded graph's",
                )
            except _Differs as e:
                raise self._error(
                    output, e, [self._typeof(v, self.plan.placement(v))], [self._typeof(v, placements)]
                ) from None

    def _assembled(self, v: Value, placements: Placements, local: torch.Tensor, node: torch.fx.Node) -> torch.Tensor:
        try:
            return assemble(self.plan.mesh, placements, meta_of(v), local)
        except _Differs as e:
            raise self._error(node, e, self._ins(node), [self._typeof(v, placements)]) from None

    def _reference(self, node: torch.fx.Node) -> Any:
        """The unsharded op on the full values of its inputs."""
        return _reference(self.plan, node, lambda a: self.full[value_of(a)])

    def _check(self, node: torch.fx.Node, got: torch.Tensor, want: Any, what: str) -> None:
        try:
            if not isinstance(want, torch.Tensor):
                raise _Differs(f"{what} is a tensor, the unsharded op's a {type(want).__name__}", float("inf"))
            _compare(got, want, what, "the unsharded op's")
        except _Differs as e:
            step = self.plan.nodes[node]
            raise self._error(
                node, e, self._ins(node), [self._typeof((node, i), p) for i, p in enumerate(step.outs) if p is not None]
            ) from None

    def _ins(self, node: torch.fx.Node) -> list[str]:
        """Each tensor input as the planned program holds it -> as the op uses it."""
        if node.op == "placeholder" or node not in self.plan.nodes:
            return []
        args = [a for a in _nodes_in((node.args, node.kwargs)) if is_tensor_node(a)]
        out = []
        for a, used in zip(args, self.plan.nodes[node].ins):
            v = value_of(a)
            held = self.plan.placement(v)
            out.append(self._typeof(v, held) + ("" if held == used else f" -> {self._typeof(v, used)}"))
        return out

    def _typeof(self, v: Value, placements: Placements) -> str:
        meta = meta_of(v)
        return type_string(tuple(meta.shape), meta.dtype, self.plan.mesh, placements)

    def _error(self, node: torch.fx.Node, e: _Differs, ins: list[str], outs: list[str]) -> PlanCheckError:
        line = source_line(node)
        op = "output" if node.op == "output" else str(node.target)
        where = f" at {line}" if line else ""
        message = f"vsf.jit checking mode: {op} (node {node.name}){where}: {e.what}, max error {e.max_error:.3g}\n  inputs (held -> used): {', '.join(ins) or '-'}\n  outputs: {', '.join(outs) or '-'}"
        return PlanCheckError(
            message, op=op, node=node.name, line=line, inputs=ins, outputs=outs, max_error=e.max_error
        )


def run_checked(plan: Plan, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`vsf.jit.lower.execute` in checking mode: the same local results, or a :class:`PlanCheckError`.

    Example::

        >>> locals_out = run_checked(compiled.plan, [x.to_local() for x in inputs])
    """
    check = Checker(plan, inputs)
    with _compat.quiet_redistribute():
        out = execute(plan, inputs, check)
    check.outputs(out)
    return out


def _every_shard_at_hand() -> None:
    if not runtime.is_simulated() or not runtime.computes_values():
        raise RuntimeError(
            "vsf.config.check_plan / f.check need every rank's shard: run under vsf.simulate(n) with real numbers (compute=True)"
        )
