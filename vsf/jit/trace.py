"""Tracing a step function to one functional aten graph on global fake tensors.

The graph's inputs are the tensor leaves of the arguments in their *global* shapes; a step that
calls :func:`vsf.grad` inside becomes one joint forward+backward graph, because the backward
ops run (and are recorded) while the step is traced. In-place ops are functionalized away, and
``_foreach_*`` ops are split into one op per tensor so every node has one tensor per operand
(:mod:`vsf.jit.functionalize`: the ops from the first such one on are traced again).

While the step's code runs, :func:`step_input` says which of the step's inputs a traced tensor
is and how that input is laid out, and the rewrites an upper layer registered
(:func:`rewrite_while_tracing`) are in force: ``vsf.nn.moe`` runs a ``transformers`` experts
module whose weights arrive split on the expert dim as a dispatch to the experts' ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from vsf import _compat, tree
from vsf.config import PlanOptions
from vsf.errors import TraceError
from vsf.jit.classify import draws_random
from vsf.jit.decompose import decompose
from vsf.jit.functionalize import functionalized
from vsf.jit.graph import (
    constant_write,
    eliminate_dead_code,
    is_library_file,
    placeholders_of,
    source_line,
    user_stacklevel,
)
from vsf.jit.simplify import (
    as_strided_as_views,
    drop_identity_views,
    drop_names,
    drop_skipped_cat_inputs,
    drop_unread_total_weights,
)
from vsf.jit.stamp import Stamper, unstamped_warning
from vsf.ops.recording import tracing_step
from vsf.sharding.named import NamedSharding

__all__ = [
    "StepInput",
    "Traced",
    "computes_on_shards",
    "draws_random",
    "per_leaf",
    "rewrite_while_tracing",
    "step_input",
    "trace",
]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Traced:
    """A traced step: ``graph`` maps the flat tensor inputs to the flat tensor outputs.

    ``out_tree`` is the structure of everything the function returned; ``out_consts`` holds the
    non-tensor leaves of the result (``None`` where a tensor output goes). ``split_inputs``: the
    inputs (by position) that a rewrite computes on split, with the mesh axes it computes them
    split over (:func:`computes_on_shards`). ``stamped``: per block class (or function stamped
    per leaf, :func:`per_leaf`), how many calls each of its traces stood for (:mod:`vsf.jit.stamp`;
    empty with ``vsf.config.stamp_blocks`` off).
    """

    graph: torch.fx.GraphModule
    out_tree: tree.PyTreeSpec
    out_consts: tuple[Any, ...]
    split_inputs: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    stamped: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepInput:
    """One input of the step being traced, as :func:`step_input` finds it: its ``args[0]['w']``-style
    name and the sharding it arrives with."""

    name: str
    sharding: NamedSharding


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The inputs of a step being traced: the trace's handle, each input's sharding (``None``: not
    known, e.g. a cotangent of a joint trace) and its name, the plan's switches, and the inputs
    the step computes on split (:func:`computes_on_shards`)."""

    tracer: Any
    shardings: Sequence[NamedSharding | None]
    names: Callable[[int], str]
    options: PlanOptions
    split: dict[int, tuple[str, ...]]  # what computes_on_shards said, by input position
    aside: list[int] = dataclasses.field(default_factory=list)  # questions asked from a trace beside the step's
    stampers: list[Stamper] = dataclasses.field(default_factory=list)  # the step's stamper, while stamping is on


_TRACING: list[_Inputs] = []  # the steps whose code is running under trace now, innermost last
_REWRITES: list[Callable[[PlanOptions], contextlib.AbstractContextManager[Any]]] = []
_SAME_VALUE = {
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.clone.default,
}  # an input's value, another tensor


def rewrite_while_tracing(context: Callable[[PlanOptions], contextlib.AbstractContextManager[Any]]) -> None:
    """Run every step's code under ``context(options)`` (the plan's switches) while :func:`trace`
    records it: an upper layer's substitution of library code that it recognises, which reads the
    inputs' layout with :func:`step_input` (registered once, when that layer is imported).

    Example::

        >>> rewrite_while_tracing(vsf.nn.moe.dispatching_transformers_experts)
    """
    if context not in _REWRITES:
        _REWRITES.append(context)


def step_input(t: torch.Tensor) -> StepInput | None:
    """While a step's code runs under :func:`trace`: the step input that the traced tensor ``t`` is
    (itself, or its value through ``detach``, a dtype cast or a copy), with its sharding; ``None``
    outside a trace, for a computed value, or for an input whose sharding the trace was not given.

    Example::

        >>> found = step_input(module.down_proj)
        >>> found.name, found.sharding.spec
        ("args[0]['model.layers.0.mlp.experts.down_proj']", P('ep'))
    """
    i = _input_index(t)
    if i is None:
        return None
    step = _TRACING[-1]
    sharding = step.shardings[i] if i < len(step.shardings) else None
    return StepInput(step.names(i), sharding) if sharding is not None else None


def computes_on_shards(t: torch.Tensor, axes: Sequence[str]) -> None:
    """While a step's code runs under :func:`trace`: say that the step computes on the shards over
    mesh ``axes`` of the step input ``t`` is (as :func:`step_input` finds it), in the layout it
    arrives with (a rewrite that consumes it so: an expert-parallel dispatch's experts, split over
    the expert axis). The trace lists it (:attr:`Traced.split_inputs`), so that a caller which
    could gather it over those axes first (a pipeline's params gathered once a step) does not.

    Example::

        >>> computes_on_shards(module.down_proj, ("ep",))
    """
    i = _input_index(t)
    if i is not None:
        _TRACING[-1].split[i] = tuple(axes)


def _input_index(t: torch.Tensor) -> int | None:
    """The position of the step input that the traced tensor ``t`` is (itself, or its value through
    ``detach``, a dtype cast or a copy); ``None`` outside a trace or for a computed value."""
    if not _TRACING:
        return None
    if _compat.tracer() is not _TRACING[-1].tracer:
        _TRACING[-1].aside.append(1)
    node = _compat.traced_node(t, _TRACING[-1].tracer)
    while node is not None and node.op == "call_function" and node.target in _SAME_VALUE:
        node = node.args[0]
    if node is None or node.op != "placeholder":
        return None
    return list(node.graph.find_nodes(op="placeholder")).index(node)


@contextlib.contextmanager
def _running(inputs: _Inputs) -> Iterator[None]:
    """The step's code runs: its inputs known to :func:`step_input`, the registered rewrites in force."""
    _TRACING.append(inputs)
    try:
        with contextlib.ExitStack() as stack:
            for context in _REWRITES:
                stack.enter_context(context(inputs.options))
            yield
    finally:
        _TRACING.pop()


def trace(
    fun: Callable[..., Any],
    avals: Sequence[tuple[tuple[int, ...], torch.dtype]],
    rebuild: Callable[[list[torch.Tensor]], tuple[tuple[Any, ...], dict[str, Any]]],
    device: str,
    unplanned: Callable[[torch.fx.GraphModule], set[Any]] = lambda gm: set(),
    decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    *,
    allow_unkeyed_random: bool = False,
    shardings: Sequence[NamedSharding | None] = (),
    names: Callable[[int], str] = lambda i: f"input #{i}",
    options: PlanOptions | None = None,
) -> Traced:
    """Trace ``fun(*args, **kwargs)`` where ``rebuild(tensors)`` makes the call's arguments from
    fake tensors of the given ``(shape, dtype)`` avals. Ops ``unplanned(graph)`` names (no sharding
    strategy) are replaced by PyTorch's decompositions of them, recursively (see :func:`decompose`);
    ``decompositions`` (the ops known to be unplanned in any graph) are applied while tracing, so
    that the common ones need no second trace. A draw from torch's generator is a ``TraceError``
    unless ``allow_unkeyed_random`` (the plan's ``vsf.config.allow_unkeyed_random``).
    ``shardings`` / ``names``: the leading inputs' layouts and names, for :func:`step_input`;
    ``options``: the plan's switches (default: the defaults), for the rewrites (:func:`rewrite_while_tracing`)."""
    out_info: dict[str, Any] = {}
    split: dict[int, tuple[str, ...]] = {}
    stamped: dict[str, tuple[int, ...]] = {}
    options = options if options is not None else PlanOptions()

    def flat_fun(*tensors: torch.Tensor) -> list[torch.Tensor]:
        args, kwargs = rebuild(list(tensors))
        inputs = _Inputs(_compat.tracer(), shardings, names, options, split)
        with _running(inputs), _stamping(inputs, decompositions, stamped):
            out = fun(*args, **kwargs)
        leaves, treedef = tree.flatten(out)
        out_info["tree"] = treedef
        out_info["consts"] = tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if any(_compat.is_local_tensor(x) for x in tensors):
            _reject_simulated_constants(fun)
        return tensors

    with _compat.local_mode_disabled(), tracing_step(), _compat.lazy_graph_modules():
        with _compat.dead_code_asked_when_unread(), _compat.quick_node_values(), _compat.placeholders_at_once():
            traced = _trace(
                fun, avals, flat_fun, out_info, device, unplanned, dict(decompositions or {}), allow_unkeyed_random
            )
    return dataclasses.replace(traced, split_inputs=dict(split), stamped=stamped)


@contextlib.contextmanager
def _stamping(
    inputs: _Inputs, decompositions: Mapping[Any, Callable[..., Any]] | None, stamped: dict[str, tuple[int, ...]]
) -> Iterator[None]:
    """The step's repeated blocks traced once and stamped out (:mod:`vsf.jit.stamp`), unless the
    plan's ``stamp_blocks`` is off; ``stamped`` gets what :attr:`Stamper.stamped` says."""
    if not inputs.options.stamp_blocks:
        yield
        return
    stamper = Stamper(inputs.tracer, dict(decompositions or {}), _draws, lambda: len(inputs.aside))
    inputs.stampers.append(stamper)
    try:
        with _compat.module_calls_through(inputs.tracer, stamper):
            yield
    finally:
        inputs.stampers.remove(stamper)
    stamped.update({k: tuple(v) for k, v in stamper.stamped.items()})
    for block, kind in stamper.unstamped.items():
        if block not in stamper.stamped:
            warnings.warn(unstamped_warning(block, kind), stacklevel=user_stacklevel())


def per_leaf(
    fn: Callable[..., Any], rows: Iterable[tuple[Any, ...]], name: str, together: Callable[..., list[Any]] | None = None
) -> list[Any]:
    """``[fn(*row) for row in rows]``: an update applied to each leaf of a tree. While a step is
    traced with ``stamp_blocks`` on (and this is the step's trace, not one beside it), ``fn`` is
    traced once per distinct key of its row (``fn``, each tensor's shape, strides, dtype, device
    and ``requires_grad``, each other value: a float hyper-parameter, a ``None`` for a leaf
    without weight decay) and its ops are copied for the other rows alike (:mod:`vsf.jit.stamp`),
    reported under ``name`` in :attr:`Traced.stamped`. ``fn`` must read no tensor but its row's
    (one that does is traced row by row). Otherwise ``together`` (a foreach op), where given,
    computes every row at once from the rows' columns: one node of a trace, split per row later.

    Example::

        >>> outs = per_leaf(torch.ops.vsf.adam_step, zip(grads, mus, nus, params, ...), "adam_step")
        >>> sums = per_leaf(torch.add, zip(params, updates), "add", together=torch._foreach_add)
    """
    rows = [tuple(row) for row in rows]
    step = _TRACING[-1] if _TRACING else None
    if step is None or not step.stampers or _compat.tracer() is not step.tracer:
        if together is not None and rows:
            return list(together(*(list(column) for column in zip(*rows))))
        return [fn(*row) for row in rows]
    return step.stampers[-1].apply(fn, rows, name)


def _draws(node: torch.fx.Node) -> bool:
    return draws_random(node.target, node.args, node.kwargs)


def _trace(
    fun: Callable[..., Any],
    avals: Sequence[tuple[tuple[int, ...], torch.dtype]],
    flat_fun: Callable[..., Any],
    out_info: dict[str, Any],
    device: str,
    unplanned: Callable[[torch.fx.GraphModule], set[Any]],
    decompositions: dict[Any, Callable[..., Any]],
    allow_unkeyed_random: bool,
) -> Traced:
    fakes = _compat.fake_inputs(avals, device)
    _compat.register_stack_anchor(fun)
    try:
        with _compat.checkpointing_as_eager(), _compat.kept_frames_only(), _compat.real_writes_refused(_StateWrite):
            joint = make_fx(
                flat_fun, decomposition_table=decompositions, tracing_mode="fake", record_stack_traces=True
            )(*fakes)
        if (write := constant_write(joint)) is not None:
            raise _StateWrite(write[0].target, *write[1:], where=source_line(write[0]) or "<unknown location>")
    except _StateWrite as e:
        raise TraceError(
            f"{_fun_name(fun)} writes a tensor it does not take as an argument at {e.where or _user_frame(e)} ({e}): "
            "vsf.jit would write it itself (while tracing, or at each call), and each call's result would depend "
            "on the calls before. Pass it in and return its new value (a module's buffers: vsf.tree.from_module, "
            "as the params)."
        ) from None
    except Exception as e:
        if (op := _compat.value_shaped_op(e)) is not None:
            raise TraceError(
                f"{_fun_name(fun)} computes a tensor whose shape depends on tensor values at {_user_frame(e)} ({op}; "
                "torch.nonzero, torch.where of a condition alone, indexing by a boolean mask and unique do): vsf.jit "
                "plans every tensor's shape before the step runs. Keep the shapes fixed: compute over every "
                "element and mask (torch.where(cond, x, 0)), take a fixed number (torch.topk), or pad to a fixed size; "
                "experts a router picks tokens for: vsf.nn.expert_parallel."
            ) from None
        if not _compat.is_data_dependent_error(e):
            raise
        raise TraceError(
            f"{_fun_name(fun)} branches on or reads a tensor value at {_user_frame(e)}: vsf.jit traces with "
            "abstract values, so data-dependent Python control flow (if/while on a tensor, .item(), "
            "bool(tensor)) cannot be traced. Use torch.where, or pass the value as a static argument."
        ) from None
    _reject_module_weights(joint, fun)
    gm = functionalized(joint, decompositions)
    drop_names(gm)
    gm = decompose(gm, unplanned, decompositions)
    _reject_input_mutation(gm, fun)
    _reject_collectives(gm, fun)
    if not allow_unkeyed_random:
        _reject_unkeyed_random(gm, fun)
    drop_unread_total_weights(gm)
    drop_skipped_cat_inputs(gm)
    as_strided_as_views(gm)
    drop_identity_views(gm)
    eliminate_dead_code(gm)
    gm.recompile()
    return Traced(gm, out_info["tree"], out_info["consts"])


def _reject_input_mutation(gm: torch.fx.GraphModule, fun: Callable[..., Any]) -> None:
    """Refuse a step that writes an input in place: what functionalization leaves of it, the
    input's new values copied into it (``copy_``) or its shape changed in place (``t_``,
    ``unsqueeze_``: decomposed to ``as_strided_``)."""
    placeholders = placeholders_of(gm)
    for node in gm.graph.nodes:  # (a placeholder's or the output's target has no schema: nothing written)
        for _, written in _compat.written_values(node.target, node.args, node.kwargs, torch.fx.Node):
            if written not in placeholders:
                continue
            index = placeholders.index(written)
            raise TraceError(
                f"{_fun_name(fun)} mutates its input tensor #{index} in place (its values or its shape); jitted "
                "functions must be pure. Return the new value instead (e.g. `x = x + 1`, not `x.add_(1)`; "
                "`x = x.t()`, not `x.t_()`)."
            )


def _reject_collectives(gm: torch.fx.GraphModule, fun: Callable[..., Any]) -> None:
    """A collective of ``torch.distributed`` the step calls itself would run on each rank's shard
    of values the step computes whole: refuse it (vsf inserts the collectives its plan needs)."""
    for node in _compat.collective_nodes(gm.graph):
        where = source_line(node)
        raise TraceError(
            f"{_fun_name(fun)} calls a torch.distributed collective ({node.target}{' at ' + where if where else ''}) "
            "inside vsf.jit, which computes on whole values as one device would and inserts the collectives its plan "
            "needs: a collective of its own would run on each rank's shard. Remove it (a library that calls its own "
            "when torch.distributed is initialized needs that turned off, e.g. st-moe's is_distributed=False); for "
            "per-shard code with explicit collectives use vsf.shard_map and vsf.ops' psum, all_gather, ..."
        )


def _reject_module_weights(gm: torch.fx.GraphModule, fun: Callable[..., Any]) -> None:
    """A module's ``nn.Parameter`` that the traced code read from the module (not from the step's
    arguments) would be a constant of the plan: replicated, and never trained. Refuse it."""
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target)
        if isinstance(value, torch.nn.Parameter):
            where = next((line for user in node.users if (line := source_line(user))), "")
            raise TraceError(
                f"{_fun_name(fun)} reads a module's parameter ({str(value.dtype).removeprefix('torch.')}{list(value.shape)}) from the "
                f"module itself{' at ' + where if where else ''}, which would make it a constant of the plan, never trained nor "
                "sharded. Pass the params as arguments and run the module with vsf.tree.apply(model, params, ...) (a direct read "
                "such as `model.head.weight`, or torch.func.functional_call with activation checkpointing, whose recompute reads "
                "the module's own weights, does this)."
            )


def _reject_simulated_constants(fun: Callable[..., Any]) -> None:
    """A result computed from a tensor made under ``vsf.simulate`` that the step did not take as an
    argument (one value per simulated rank, run rank by rank outside the traced graph): refuse it,
    naming the module parameter or buffer the function closes over, where one is found."""
    found = _simulated_module_tensors(fun)
    what = (
        f"the module tensor{'s' if len(found) > 1 else ''} {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}"
        if found
        else "a tensor"
    )
    raise TraceError(
        f"{_fun_name(fun)} reads {what} built inside `vsf.simulate` from outside its arguments: such a tensor holds one "
        "value per simulated rank and cannot be a constant of a traced step. Build the model outside `vsf.simulate`, "
        "or pass its params as arguments and run it with vsf.tree.apply(model, params, ...)."
    )


def _simulated_module_tensors(fun: Callable[..., Any]) -> list[str]:
    """``name.param`` of each parameter or buffer made under ``vsf.simulate`` of the modules ``fun``
    is, is bound to, closes over or names as a global."""
    code = getattr(fun, "__code__", None)
    named: dict[str, Any] = {_fun_name(fun): fun, "self": getattr(fun, "__self__", None)}
    if code is not None:
        cells = getattr(fun, "__closure__", None) or ()
        named |= {name: _cell_value(cell) for name, cell in zip(code.co_freevars, cells, strict=True)}
        named |= {name: fun.__globals__[name] for name in code.co_names if name in fun.__globals__}
    return [
        f"{name}.{key}"
        for name, module in named.items()
        if isinstance(module, torch.nn.Module)
        for key, t in (*module.named_parameters(), *module.named_buffers())
        if _compat.is_local_tensor(t)
    ]


def _cell_value(cell: Any) -> Any:
    """What the closure cell ``cell`` holds (``None`` before the enclosing function assigns it)."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _reject_unkeyed_random(gm: torch.fx.GraphModule, fun: Callable[..., Any]) -> None:
    """A draw from torch's generator would give a different mask per layout: refuse it."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and draws_random(node.target, node.args, node.kwargs):
            where = source_line(node)
            raise TraceError(
                f"{_fun_name(fun)} draws random numbers from torch's generator ({node.target}"
                f"{' at ' + where if where else ''}), which would differ between layouts inside vsf.jit. "
                "Pass a key and use vsf.random (vsf.nn.dropout, vsf.random.normal, ...), or run the model "
                "under `with vsf.random.keyed(key):` so that its dropout and torch.rand* calls draw from the key "
                "(vsf.config.allow_unkeyed_random = True plans it like any op, with other values on every layout)."
            )


def _fun_name(fun: Callable[..., Any]) -> str:
    return getattr(fun, "__qualname__", getattr(fun, "__name__", repr(fun)))


class _StateWrite(Exception):
    """An op of a traced step about to write into a tensor ``t`` the step closes over, at the user's
    line ``where`` (``""``: the innermost user frame of its traceback)."""

    def __init__(self, op: Any, name: str, t: torch.Tensor, where: str = "") -> None:
        super().__init__(f"{op} into its argument {name!r}, in a {tuple(t.shape)} {t.dtype} tensor")
        self.where = where


def _user_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not is_library_file(f.filename) and not f.filename.startswith("<")]
    if not user:
        return "<unknown location>"
    f = user[-1]
    code = (f.line or "").strip()
    return f'File "{f.filename}", line {f.lineno}, in {f.name}' + (f": `{code}`" if code else "")


# Fake-tensor metas narrower than their kernels: grouped_mm's meta asks for bf16, while the CPU
# kernel runs fp32 (Mixtral's experts). Traced through PyTorch's meta on bf16 stand-ins.
_compat.register_fake_via_dtype(aten._grouped_mm.default, torch.bfloat16)
