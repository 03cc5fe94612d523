"""Tracing a model's repeated blocks once and stamping their graph out for the others.

Tracing records each op of a step at about a millisecond of CPU (fake dispatch, the fx node and its
metadata, autograd's recording of the backward), so a deep model's trace grows with its depth. While
:func:`vsf.jit.trace.trace` records a step, each call of a child of a ``ModuleList`` or
``Sequential`` that has a sibling of the same class and parameter shapes (a transformer's blocks)
goes through :class:`Stamper`: the first block of its kind is traced by itself, forward and
backward in one trace beside the step's (``_compat.trace_aside``), and that block and every later
one of the same kind are *stamped*: their forward ops are copied into the step's graph reading the
block's own inputs, and the backward ops likewise when autograd reaches the block (a
``torch.autograd.Function`` whose forward and backward copy the nodes), each with the stack trace
the plain trace records there. The copies are the ops the plain trace records, in its order, so
the plan is the same (tests plan both ways); copying a node costs a small part of tracing it.

What must match for two calls to share a trace (the key): each module's class and training flag,
the parameters' and buffers' names, shapes, strides, dtypes, devices and ``requires_grad``, the
call's argument structure, its tensors' shapes, strides, dtypes, devices and ``requires_grad``, its
other arguments' values (numbers, strings, ``None``, dtypes), grad mode, and the attributes of
its modules that the traced block's code read (a plain value by value; an object that holds
nothing but plain values, as a diffusers ``Attention``'s processor of its own, by its class and
those values; any other object by identity: Llama's ``layer_idx``, read only to index a cache,
does not split the layers, while an attribute a layer branches on does); a read through
``vars(module)`` is not seen. A call is traced the plain way when a shared trace could be wrong: a
hook on any module of the block (or a global
one), a dispatch mode other than the trace's own (``vsf.random.keyed``: each draw folds in its
count), autocast, hooks on the tensors autograd saves (activation checkpointing around the block,
which recomputes what the block saves; checkpointing inside it is traced with it), a tensor held
in two slots, passed twice, or held by another block too (a tied weight), an argument of another
kind (a ``transformers`` ``DynamicCache``: ``use_cache=True`` writes each layer's keys into it),
and, once traced, a block that reads a tensor from outside its inputs, writes in place into a tensor
it was given (a write into one it made, mamba.py's scan, is copied with it), assigns an attribute of
one of its modules (a cache's length), draws random numbers, returns an input or an object other
than a tensor or a plain value (a dataclass of tensors), or asks :func:`vsf.jit.trace.step_input`
about a tensor, or whose trace beside the step fails (its fresh inputs written in place: leaves that
require grad there); so is a block inside nested ``vsf.grad`` transforms (a gradient penalty: the
inner gradient's backward is differentiated again, which copied ops cannot record). A stamped
block's backward differentiated again some other way (``torch.autograd.grad(...,
create_graph=True)`` in the step) is a ``TraceError``; a gradient arriving with other strides than
the block's trace assumed is copied into those strides. ``vsf.config.stamp_blocks = False`` traces
every call the plain way. What the key cannot see is Python state outside the block's modules (a
global the blocks count their places in): such blocks are stamped from one trace, and checking mode,
which runs the step eagerly beside its trace (:func:`vsf.jit.check_trace.like_eager`), stops there.

The same machinery stamps a function applied to each leaf of a tree (:meth:`Stamper.apply`, which
:func:`vsf.jit.trace.per_leaf` reaches: vsf.optim's Adam update of each leaf): the key is the
function itself and its call's part of a block's key (the arguments' structure, their tensors'
metadata and other values, grad mode), so rows that differ in a float it bakes into an op, a
dtype, strides or a ``None`` for a leaf without weight decay get traces of their own; a tensor it
reads from outside its arguments (a closure) makes it traced row by row.

Example::

    >>> stamper = Stamper(tracer, {}, lambda node: False, lambda: 0)
    >>> with _compat.module_calls_through(tracer, stamper):
    ...     loss = model(x)
    >>> stamper.stamped            # one trace of GPT's Block stood for its 24 blocks
    {'Block': [24]}
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from vsf import _compat, tree
from vsf.errors import TraceError
from vsf.jit.copies import COPY
from vsf.jit.donation import allocates
from vsf.jit.stamp_key import (
    Call,
    all_held,
    block_key,
    read_values,
    rebuild,
    recording_reads,
    restored,
    row_keys,
    stampable_now,
    unkeyed_kind,
)

__all__ = ["Stamper", "unstamped_warning"]

_UNTRACED = object()


@dataclasses.dataclass
class _Trace:
    """A block traced once: its graph's input placeholders (the slots' tensors, then the
    arguments'), the forward nodes and the backward nodes in trace order, the node of each tensor
    output (``None`` for another value, kept in ``consts``), the node standing for each
    differentiable output's gradient, the node of each input's gradient (``None``: none), the
    block's class name, and the stack trace of the call it was traced at."""

    inputs: list[torch.fx.Node]
    forward: list[torch.fx.Node]
    backward: list[torch.fx.Node]
    outs: list[torch.fx.Node | None]
    consts: list[Any]
    out_tree: tree.PyTreeSpec
    differentiable: list[bool]
    tangents: list[torch.fx.Node]
    grads: list[torch.fx.Node | None]
    name: str
    stack: str | None  # the stack trace of the call it was traced at, which its nodes' traces start with
    # per (part, stack trace of a call), the copies' stack traces: :func:`_stacks`
    stacks: dict[tuple[str, str | None], list[tuple[torch.fx.Node, str | None]]] = dataclasses.field(
        default_factory=dict
    )


class Stamper:
    """The module calls of one trace (``tracer``, a ``_compat.tracer()``): each child of a
    ``ModuleList`` or ``Sequential`` is stamped from one trace per key (the module docstring),
    anything else runs as it is. ``decompositions`` are the trace's; ``draws`` says whether an op
    node draws random numbers; ``asked()`` counts the questions :func:`vsf.jit.trace.step_input`
    was asked from a trace beside the step's. ``stamped`` maps a block's class name (a stamped
    function's name) to the number of calls each of its traces stood for.

    Example::

        >>> with _compat.module_calls_through(tracer, Stamper(tracer, {}, lambda node: False, lambda: 0)):
        ...     out = model(x)
    """

    def __init__(
        self,
        tracer: Any,
        decompositions: Mapping[Any, Callable[..., Any]],
        draws: Callable[[torch.fx.Node], bool],
        asked: Callable[[], int],
    ) -> None:
        self.tracer = tracer
        self.decompositions = decompositions
        self.draws = draws
        self.asked = asked
        self.blocks: set[int] = set()  # ids of the children of a ModuleList or Sequential seen called
        self.traces: dict[Any, list[tuple[frozenset[tuple[int, str]], Any, _Trace | None]]] = {}
        self.stamped: dict[str, list[int]] = {}
        # per block class called with an argument no trace can stand for, that argument's type's name
        self.unstamped: dict[str, str] = {}
        self._held: set[int] = set()  # ids of the tensors the blocks keyed so far hold
        self._uses: dict[int, int] = {}

    def __call__(
        self, module: torch.nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        containers = [module] if isinstance(module, torch.nn.Sequential) else []
        containers += [c for c in module.children() if isinstance(c, (torch.nn.ModuleList, torch.nn.Sequential))]
        self.blocks.update(id(b) for c in containers for b in _repeated(c))
        if id(module) not in self.blocks:
            return forward(*args, **kwargs)
        keyed = block_key(module, args, kwargs, self.tracer)
        if keyed is None:
            if (kind := unkeyed_kind(args, kwargs)) is not None:
                self.unstamped.setdefault(type(module).__name__, kind)
            return forward(*args, **kwargs)
        key, call = keyed
        held = {id(t) for t in call.operands[: len(call.slots)]}
        shared, self._held = bool(held & self._held), self._held | held
        if shared:  # a tensor another block holds too (a tied weight): traced by itself
            return forward(*args, **kwargs)
        return self._stamp(key, call, forward, type(module).__name__, _compat.stack_trace_now(self.tracer))

    def apply(self, fn: Callable[..., Any], rows: Sequence[tuple[Any, ...]], name: str) -> list[Any]:
        """``[fn(*row) for row in rows]``, each row stamped from one trace per key (``fn`` itself, the
        row's structure, its tensors' metadata and other values, as a block call's), as a block named
        ``name``: an optimizer's update of each leaf, stamped for every leaf like it (every row with
        the stack trace of this call: the frames a trace keeps are its caller's).

        Example::

            >>> outs = stamper.apply(torch.ops.vsf.adam_step, rows, "adam_step")
        """
        if not stampable_now():
            return [fn(*row) for row in rows]
        now = _compat.stack_trace_now(self.tracer)
        return [
            fn(*row) if keyed is None else self._stamp((fn, name, keyed[0]), keyed[1], fn, name, now)
            for row, keyed in zip(rows, row_keys(rows, self.tracer))
        ]

    def _stamp(self, key: Any, call: Call, forward: Callable[..., Any], name: str, now: str | None) -> Any:
        """The call stamped from the trace of its key (traced now if it is the first) with the stack
        trace ``now``, or run as it is (``forward`` on its arguments) where no trace can stand for it."""
        traces = self.traces.setdefault(key, [])
        traced = next((t for reads, values, t in traces if read_values(call.modules, reads) == values), _UNTRACED)
        if traced is _UNTRACED:
            reads, traced = self._trace(forward, call, name)
            traces.append((reads, read_values(call.modules, reads), traced))
        if traced is None:
            args, kwargs = rebuild(call, call.operands[len(call.slots) :])
            return forward(*args, **kwargs)
        if id(traced) not in self._uses:
            self._uses[id(traced)] = len(self.stamped.setdefault(traced.name, []))
            self.stamped[traced.name].append(0)
        self.stamped[traced.name][self._uses[id(traced)]] += 1
        if torch.is_grad_enabled() and any(call.grads):
            outs = iter(_Replay.apply(self.tracer, traced, now, call, *call.operands))
        else:  # (no gradient flows: the copies alone, as _Replay's forward makes them)
            outs = iter(_replayed(self.tracer, traced, now, call.nodes)[0])
        return tree.unflatten(
            traced.out_tree, [next(outs) if n is not None else c for n, c in zip(traced.outs, traced.consts)]
        )

    def _trace(
        self, forward: Callable[..., Any], call: Call, name: str
    ) -> tuple[frozenset[tuple[int, str]], _Trace | None]:
        """Trace the block by itself on fresh inputs like the call's, forward and (where a grad
        flows) backward: the attributes of its modules its code read (by module index and name),
        and the trace, ``None`` where it could not stand for another block or could not be traced
        by itself."""
        inputs = [_compat.untraced_like(t, t.requires_grad) for t in call.operands]
        marks: dict[str, Any] = {}
        asked = self.asked()

        def joint(*xs: torch.Tensor) -> list[torch.Tensor]:
            placed = [table[name] for table, name in call.slots]
            for (table, name), x in zip(call.slots, xs):
                table[name] = x
            try:  # (the block's own tensors stay swapped for a backward that recomputes it: checkpointing)
                with recording_reads(call.modules) as marks["reads"]:
                    return _joint(forward, call, list(xs), marks)
            finally:
                for (table, name), t in zip(call.slots, placed):
                    table[name] = t

        stack = _compat.stack_trace_now(self.tracer)
        attributes = [dict(vars(m)) for m in call.modules]
        try:
            gm = _compat.trace_aside(joint, inputs, self.decompositions)
        except RuntimeError:  # (run as the step runs it, the block raises there what is its own)
            # the block failed on its trace's fresh inputs, which the step's are not: autograd refuses
            # a leaf that requires grad written in place (the step's input to it is a computed value)
            return frozenset(marks.get("reads", ())), None
        finally:
            assigned = restored(call.modules, attributes)
        reads = frozenset(marks["reads"])
        if self.asked() != asked or assigned:
            return reads, None
        return reads, _cut(gm, marks, name, stack, self.draws)


def _joint(
    forward: Callable[..., Any], call: Call, xs: list[torch.Tensor], marks: dict[str, Any]
) -> list[torch.Tensor]:
    """Run the block on ``xs`` (its slots' tensors, then its arguments'), and its backward where a
    gradient flows, noting in ``marks`` where each part of the trace starts and ends and which
    nodes are its outputs, the stand-ins of their gradients, and the inputs' gradients."""
    inner = _compat.tracer()
    args, kwargs = rebuild(call, xs[len(call.slots) :])
    out = forward(*args, **kwargs)
    leaves, marks["tree"] = tree.flatten(out)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    marks["leaves"] = leaves
    marks["outs"] = [_compat.traced_node(x, inner) for x in tensors]
    marks["forward_end"] = _last(inner)
    wrt = [x for x in xs if x.requires_grad]
    diff = [x for x in tensors if x.requires_grad]
    marks["differentiable"] = [x.requires_grad for x in tensors]
    if not (torch.is_grad_enabled() and wrt and diff):
        marks["tangents"], marks["backward_start"], marks["grads"] = [], None, [None] * len(xs)
        return tensors
    tangents = [torch.empty_like(x) for x in diff]
    marks["tangents"] = [_compat.traced_node(t, inner) for t in tangents]
    marks["backward_start"] = _last(inner)
    grads = iter(torch.autograd.grad(diff, wrt, tangents, allow_unused=True))
    found = [next(grads) if x.requires_grad else None for x in xs]
    marks["grads"] = [None if g is None else _compat.traced_node(g, inner) for g in found]
    return tensors + [g for g in found if g is not None]


def _cut(
    gm: torch.fx.GraphModule,
    marks: dict[str, Any],
    name: str,
    stack: str | None,
    draws: Callable[[torch.fx.Node], bool],
) -> _Trace | None:
    """The block's trace ``gm`` split at the marks :meth:`Stamper._trace` set, or ``None`` where it
    reads a constant (a tensor from outside its inputs), writes in place into a tensor it was given
    (:func:`_writes_an_input`), draws random numbers, takes
    a symbolic number as an argument (which :func:`_copy` would copy as it is), or returns one of its
    inputs, one value twice, or an object other than a tensor or a plain value (it would hold this
    trace's tensors, and every copy would return that one object)."""
    nodes = list(gm.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    ops = [n for n in nodes if n.op == "call_function"]
    outs = marks["outs"]
    if any(n.op == "get_attr" for n in nodes) or _writes_an_input(nodes):
        return None
    if any(draws(n) or _compat.holds_symbolic(n) for n in ops):
        return None
    if any(o is None or o.op == "placeholder" for o in outs) or len(set(outs)) != len(outs):
        return None
    if not all_held(marks["leaves"]):  # (an object it returns would be this trace's, given to every copy)
        return None
    if any(t is None for t in marks["tangents"]):
        return None
    position = {n: i for i, n in enumerate(nodes)}
    end = position[marks["forward_end"]]
    start = position[marks["backward_start"]] if marks["backward_start"] is not None else len(nodes)
    forward = [n for n in ops if position[n] <= end]
    backward = [n for n in ops if position[n] > start]
    it = iter(outs)
    leaves = marks["leaves"]
    return _Trace(
        inputs,
        forward,
        backward,
        [next(it) if isinstance(x, torch.Tensor) else None for x in leaves],
        [None if isinstance(x, torch.Tensor) else x for x in leaves],
        marks["tree"],
        marks["differentiable"],
        marks["tangents"],
        marks["grads"],
        name,
        stack,
    )


def _laid_out_like(grad: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``want``'s strides: the block's backward was traced for a gradient laid out as
    its trace's was, and its ops (a ``view`` of the gradient) may hold only for that layout; where
    the step hands the block a gradient laid out otherwise (a consumer's backward that transposes:
    diffusers' UNet attention), it is copied into that layout first, one op in the graph."""
    if grad.stride() == want.stride():
        return grad
    return torch.empty_strided(want.shape, want.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)


class _Replay(torch.autograd.Function):
    """A stamped block: forward copies its trace's forward nodes into the running trace's graph,
    backward its backward nodes, each reading the copies of the nodes it reads."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, tracer: Any, traced: _Trace, stack: str | None, call: Call, *operands: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        values, env = _replayed(tracer, traced, stack, call.nodes)
        ctx.mark_non_differentiable(*(v for v, d in zip(values, traced.differentiable) if not d))
        ctx.stamp = (tracer, traced, env, call.grads)
        return values

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        tracer, traced, env, needs = ctx.stamp
        if torch.is_grad_enabled():
            raise TraceError(
                f"the backward of a stamped {traced.name} block is differentiated again (vsf.grad of vsf.grad, "
                "create_graph=True), which its copied ops cannot record; set vsf.config.stamp_blocks = False"
            )
        flowing = [g for g, d in zip(grads, traced.differentiable) if d]
        for node, g in zip(traced.tangents, flowing):
            want = node.meta["val"]
            if g.shape != want.shape or g.dtype != want.dtype:
                raise TraceError(
                    f"a stamped {traced.name} block's output gradient is {g.dtype} {list(g.shape)}, its trace's "
                    f"{want.dtype} {list(want.shape)}; set vsf.config.stamp_blocks = False to trace every block by itself"
                )
            env[node] = _compat.traced_node(_laid_out_like(g, want), tracer)
        tracked = [n if need else None for n, need in zip(traced.grads, needs)]
        _copy(tracer, traced, "backward", env, _compat.stack_trace_now(tracer))
        out = [
            None if n is None else _compat.track_as(_compat.untraced_like(n.meta["val"]), env[n], tracer)
            for n in tracked
        ]
        return (None, None, None, None, *out)


def _replayed(
    tracer: Any, traced: _Trace, stack: str | None, nodes: Sequence[torch.fx.Node]
) -> tuple[tuple[torch.Tensor, ...], dict[torch.fx.Node, Any]]:
    """A stamped block's forward: its trace's forward nodes copied into ``tracer``'s graph reading
    its operands' ``nodes``, with the stack trace ``stack``; the new tensors the trace reads as
    its tensor outputs, and the map from the trace's nodes to their copies."""
    env: dict[torch.fx.Node, Any] = dict(zip(traced.inputs, nodes))
    outs = [n for n in traced.outs if n is not None]
    _copy(tracer, traced, "forward", env, stack)
    return tuple(_compat.track_as(_compat.untraced_like(n.meta["val"]), env[n], tracer) for n in outs), env


def _copy(tracer: Any, traced: _Trace, part: str, env: dict[torch.fx.Node, Any], now: str | None) -> None:
    """Copy the ``part`` (``"forward"`` or ``"backward"``) nodes of ``traced`` into ``tracer``'s
    graph, each reading the copies ``env`` maps its inputs to, each with the value its trace
    recorded (the plain trace's metadata, storage offset included; every copy of a node holds that
    one fake tensor, which a trace taking them as inputs replaces where met twice:
    :mod:`vsf.jit.functionalize`; the copies of the block's outputs get values of their own from
    ``_compat.track_as`` next), with the stack trace :func:`_stacks` gives it for a call at ``now``,
    and marked as this copy's (:data:`vsf.jit.copies.COPY`: the name of the copy's first node)."""
    nodes = getattr(traced, part)
    _compat.copy_nodes(tracer.graph, nodes, env)
    for node, trace in _stacks(traced, part, now):
        env[node].meta["stack_trace"] = trace
    if nodes:
        copy = env[nodes[0]].name
        for node in nodes:
            env[node].meta[COPY] = copy


def _stacks(traced: _Trace, part: str, now: str | None) -> list[tuple[torch.fx.Node, str | None]]:
    """Each node of the ``part`` of ``traced`` that has a stack trace, with the stack trace the
    step's trace records for it at a call whose stack trace is ``now``: the frames ``now`` in place
    of the frames of the call the block was traced at, before the block's own. Worked out once per
    part and ``now`` (a model's blocks are called from one line, its optimizer's rows from one call).

    Example::

        >>> _stacks(traced, "forward", now)[0]  # (linear, 'File "train.py", line 9 ... File "model.py", line 40 ...')
    """
    key = (part, now)
    if key not in traced.stacks:
        was = traced.stack
        traced.stacks[key] = [
            (
                node,
                ((now or "") + (trace[len(was) :] if was and trace.startswith(was) else "\n" + trace)).strip() or None,
            )
            for node in getattr(traced, part)
            if (trace := node.meta.get("stack_trace")) is not None
        ]
    return traced.stacks[key]


def _last(tracer: Any) -> torch.fx.Node:
    return next(iter(reversed(tracer.graph.nodes)))


def _repeated(container: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of ``container`` that have a sibling of the same class with parameters of the
    same names and shapes (a stack of blocks; a lone layer is not worth a trace of its own)."""
    kinds: dict[Any, list[torch.nn.Module]] = {}
    for child in container.children():
        with _compat.metadata_reads():
            shapes = tuple((k, tuple(v.shape)) for k, v in child.named_parameters(remove_duplicate=False))
        kinds.setdefault((type(child), shapes), []).append(child)
    return [c for group in kinds.values() if len(group) > 1 for c in group]


def _writes_an_input(nodes: list[torch.fx.Node]) -> bool:
    """Whether an op of a block's trace (``nodes``, in order) may write in place into a buffer the
    block was given (an input, a parameter, or a view of one; an op without a schema, other than
    ``getitem``, may write anything). A write into a buffer the block made itself (mamba.py's
    parallel scan, in place on its own tensors) is copied with the block as the plain trace
    records it, and functionalized with the step (:mod:`vsf.jit.functionalize`).

    Example::

        >>> _writes_an_input(list(trace_of(lambda x: x.exp().add_(1)).graph.nodes))   # its own exp
        False
    """
    given: set[torch.fx.Node] = set()  # the values that may share a buffer with an input
    for n in nodes:
        if n.op == "placeholder":
            given.add(n)
            continue
        if n.op != "call_function":
            continue
        if not allocates(n) and any(a in given for a in n.all_input_nodes):
            given.add(n)
        if n.target is operator.getitem:
            continue
        schema = _compat.op_schema(n.target)
        if schema is None:
            return True
        if schema.is_mutable and any(
            w in given for _, w in _compat.written_values(n.target, n.args, n.kwargs, kind=torch.fx.Node)
        ):
            return True
    return False


def unstamped_warning(block: str, kind: str) -> str:
    """What a user reads where a model's repeated ``block`` s were each traced by itself because
    each call took an argument of type ``kind``, which no shared trace can stand for.

    Example::

        >>> unstamped_warning("LlamaDecoderLayer", "DynamicCache")  # ends: 'pass use_cache=False'
    """
    hint = (
        "a transformers cache, which a training step does not read: pass use_cache=False"
        if kind.endswith("Cache")
        else "pass tensors and plain values (numbers, strings, None) only"
    )
    return (
        f"vsf.jit: each {block} block is traced by itself, since each call takes an argument of type {kind} "
        f"(planning takes longer, growing with the number of blocks); to trace one and stamp the others, {hint}"
    )
