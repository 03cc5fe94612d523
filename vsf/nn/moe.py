"""Expert parallelism: a mixture-of-experts layer whose experts are split over a mesh axis, with
the tokens sent to the experts' ranks and back (all-to-all dispatch and combine with the counts
routing gives each step) instead of the experts' weights gathered to the tokens.

:func:`expert_parallel` is one ``vsf.shard_map`` region, manual over the token axes (which include
the expert axis): on each rank its tokens' copies (one per chosen expert) are sorted by expert, the
per-expert counts are all-gathered over the expert axis (``n x experts`` integers), the rows go to
the ranks holding their experts (:func:`vsf.ops.all_to_all_counted`), each rank runs its local
experts on the rows it received, grouped by expert (``experts(rows, offsets, *weights)``, e.g.
``torch.nn.functional.grouped_mm``), and the results go back by the transposed exchange, to be
weighted by the router's gates and summed per token. The backward is the same exchanges reversed.
Inside ``vsf.jit`` the plan lists the exchanges (``all_to_all_v`` over the expert axis) and moves
no expert weight over that axis.

A Hugging Face ``transformers`` MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ...: every
experts module that transformers builds with ``@use_experts_implementation``, fused weights with the
expert dim first) needs no call: inside ``vsf.jit``, an experts module whose weights
(``gate_up_proj`` / ``up_proj`` and ``down_proj``) arrive split on the expert dim over one mesh axis
runs through it (:func:`dispatching_transformers_experts`, in force while a step is traced),
its tokens split over every mesh axis but those that split the weights on their ffn dims alone
(tensor parallelism; an axis that splits a hidden dim stores them split, as efsdp's
``P("ep", "fsdp")`` does, and carries tokens), in the order that moves the fewest bytes (the
region is ``any_order``: each token is routed alone, so the plan weighs each order of the token axes and takes the tokens as they arrive, ``P(("ep", "dp"))`` on a
``("dp", "ep")`` mesh included).

Why every such axis carries tokens (per MoE layer, ``T`` tokens of ``h`` bytes, top-``k``, ``e``
ranks on the expert axis, an axis ``a`` of ``n`` ranks): with ``a`` among the token axes each of the
four exchanges (dispatch and combine, forward and backward) sends a rank's ``T/(e n) * k * h``;
left out, ``T/e * k * h``, ``n`` times as much, and nothing else is saved. Tokens that arrive split
over ``a`` would be gathered first; tokens that arrive whole over ``a`` (``tp`` after a row-parallel
all-reduce) are sliced for free and their result and its gradient gathered over ``a``:
``2 * T/e * h * (n-1)/n``, less than the ``4 * T/e * k * h * (n-1)/n`` the exchanges save for any
``k >= 1`` (and the experts run ``1/n`` of the rows). A weight
split on the expert dim over several axes, or the two weights split differently, is a
``PlanError``; to gather the experts instead, split another of their dims or set
``vsf.config.dispatch_experts = False``. :func:`use_expert_parallel` sets the axes explicitly, as an experts implementation of
transformers' own registry.
torchtitan's MoE (0.3's ``RoutedExperts``: separate ``w1_EFD``, ``w3_EFD`` and ``w2_EDF`` weights)
is recognised alike from its weights' specs (:func:`vsf.nn.torchtitan_moe.dispatching_torchtitan_experts`).

A transformers experts module whose weights no axis splits on the expert dim (replicated, as data
parallelism keeps them, or split over their ffn dims alone) runs on each rank's own tokens: one
``shard_map(own_tokens)`` region over the same token axes, the weights whole over them and their
gradients summed over them, as DDP's are. Planned as traced, the implementation's sort of the
tokens by expert needs the whole batch, and every rank would gather every rank's tokens and run
the experts on all of them, in each MoE layer.

Example::

    >>> def experts(rows, offsets, w_in, w_out):
    ...     h = F.grouped_mm(rows, w_in.transpose(1, 2), offs=offsets)
    ...     return F.grouped_mm(F.silu(h), w_out.transpose(1, 2), offs=offsets)
    >>> y = vsf.nn.expert_parallel(experts, x, top_k_index, top_k_weights, (w_in, w_out), axis="ep", token_axes=("dp", "ep"))
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from vsf import _compat, ops
from vsf.config import PlanOptions
from vsf.errors import PlanError
from vsf.func import shard_map
from vsf.jit.trace import StepInput, computes_on_shards, rewrite_while_tracing, step_input
from vsf.sharding.mesh import Mesh, current_mesh
from vsf.sharding.named import NamedSharding
from vsf.sharding.spec import P

__all__ = [
    "dispatch_split",
    "dispatching_transformers_experts",
    "expert_parallel",
    "use_expert_parallel",
]

_IMPLEMENTATION = "vsf_expert_parallel"  # the name of vsf's experts implementation in transformers' registry


def expert_parallel(
    experts: Callable[..., torch.Tensor],
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: Sequence[torch.Tensor],
    *,
    axis: str,
    token_axes: Sequence[str] | None = None,
    capacity: int | None = None,
    mesh: Mesh | None = None,
) -> torch.Tensor:
    """The routed experts' output for each token, ``sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(x[t])``,
    with the experts split over mesh axis ``axis`` and the tokens sent to them.

    ``x``: the tokens ``[tokens, hidden]``; ``top_k_index`` / ``top_k_weights``: each token's chosen
    experts and their gates ``[tokens, k]``; ``weights``: the experts' weights, each with the expert
    dim first (``[experts, ...]``), split over ``axis`` on it (``P(axis)``); ``experts(rows,
    offsets, *local_weights)``: the local experts on ``rows`` grouped by expert, expert ``e``'s rows
    ending at ``offsets[e]`` (int32, ``grouped_mm``'s convention; rows past the last offset are
    padding, zero in and ignored out). ``token_axes``: the mesh axes the tokens are split over (dim
    0, major to minor; default ``(axis,)``), which must include ``axis``: each rank routes its own
    tokens. ``capacity``: the rows each rank's receive buffer holds, by default ``n`` times its
    token copies (``n * tokens * k`` for its share of the tokens over ``axis`` of size ``n``: enough
    when every rank routes all its tokens to one rank's experts). A smaller one saves memory, and a
    step whose routing sends a rank more rows than it holds is a ``ValueError`` naming the rank and
    the rows (no token is ever dropped).

    Example::

        >>> y = vsf.nn.expert_parallel(experts, x, idx, gates, (w_in, w_out), axis="ep", token_axes=("dp", "ep"))
    """
    tokens = tuple(token_axes) if token_axes is not None else (axis,)
    if axis not in tokens:
        raise ValueError(
            f"expert_parallel: token_axes {tokens!r} must include the expert axis {axis!r} (each rank of it routes its own tokens)"
        )
    m = mesh if mesh is not None else current_mesh()
    if m is None:
        raise ValueError("expert_parallel needs a mesh: pass mesh=... or call it inside `with vsf.use_mesh(mesh):`")
    n = m.axis_size(axis)
    for i, w in enumerate(weights):
        if w.shape[0] % n:
            raise ValueError(
                f"expert_parallel: weights[{i}] has {w.shape[0]} experts (dim 0), which {axis!r} of size {n} does not divide"
            )
    split = P(tokens)
    for w in weights:  # (inside vsf.jit: never gathered over the axis, by a pipeline either)
        computes_on_shards(w, (axis,))

    def expert_dispatch(
        x: torch.Tensor, index: torch.Tensor, gates: torch.Tensor, *local: torch.Tensor
    ) -> torch.Tensor:
        return _routed(experts, x, index, gates, local, axis, n, capacity)

    region = shard_map(
        expert_dispatch,
        mesh=m,
        in_specs=(split, split, split, *(P(axis) for _ in weights)),
        out_specs=split,
        axis_names=tokens,
        any_order=True,  # each token is routed alone: the plan takes the token axes in the order that moves fewest bytes
    )
    return region(x, top_k_index, top_k_weights, *weights)


def _routed(
    experts: Callable[..., torch.Tensor],
    x: torch.Tensor,
    index: torch.Tensor,
    gates: torch.Tensor,
    local: tuple[torch.Tensor, ...],
    axis: str,
    n: int,
    capacity: int | None,
) -> torch.Tensor:
    """One rank's part: dispatch its token copies, run its experts, combine (see the module docs)."""
    t, k = index.shape
    per_rank = local[0].shape[0]
    rows = t * k
    capacity = n * rows if capacity is None else capacity
    if capacity < rows:
        raise ValueError(
            f"expert_parallel: capacity {capacity} is less than the {rows} token copies of a rank ({t} tokens x top-{k}), which the ranks receive on average"
        )
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, so by the rank that holds it
    sent = x[order // k]
    mine = (flat[:, None] == torch.arange(n * per_rank, device=flat.device)).sum(0)
    table = ops.all_gather(mine[None], axis).view(n, n, per_rank)  # [source, destination, its expert]
    by_rank = table.sum(-1)
    got = ops.all_to_all_counted(sent, by_rank, axis, capacity)
    # the received rows are grouped by source, then by expert: which local expert each one is for
    here = table.index_select(1, ops.axis_index(axis).reshape(1)).reshape(n * per_rank)
    ends = torch.cumsum(here, 0).clamp(
        max=capacity
    )  # row r is in segment #(ends <= r): searchsorted, as a scatter and a cumsum
    segment = (
        torch.zeros(capacity + 1, dtype=ends.dtype, device=ends.device)
        .scatter_add(0, ends, torch.ones_like(ends))
        .cumsum(0)[:capacity]
    )
    expert = torch.where(segment < n * per_rank, segment % per_rank, per_rank)
    regroup = torch.argsort(expert, stable=True)
    offsets = torch.cumsum(here.view(n, per_rank).sum(0), 0).to(torch.int32)
    valid = (torch.arange(capacity, device=flat.device) < offsets[-1])[:, None]
    out = experts(torch.where(valid, got[regroup], 0.0), offsets, *local)
    out = torch.where(valid, out, 0.0)[torch.argsort(regroup)]
    back = ops.all_to_all_counted(out, by_rank.T, axis, rows)[torch.argsort(order)]
    return (back.view(t, k, -1) * gates[..., None]).sum(1).to(x.dtype)


def use_expert_parallel(
    model: torch.nn.Module, *, axis: str, token_axes: Sequence[str] | None = None, mesh: Mesh | None = None
) -> None:
    """Run the routed experts of the ``transformers`` model ``model`` through :func:`expert_parallel`
    over ``axis`` (the tokens split over ``token_axes``, default ``(axis,)``, on ``mesh``, default the
    current one): vsf's experts implementation is registered with transformers
    (``ALL_EXPERTS_FUNCTIONS``) and set on the model (``set_experts_implementation``). Lay the
    experts' weights out ``P(axis)`` (``gate_up_proj`` / ``up_proj`` and ``down_proj``) and the
    batch over ``token_axes``. An experts module with biases or a post-expert norm is a
    ``ValueError`` when it runs.

    Example::

        >>> vsf.nn.use_expert_parallel(model, axis="ep", token_axes=("dp", "ep"), mesh=mesh)
        >>> p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {k: P("ep") if ".experts." in k else P() for k in params}))
    """
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # type: ignore[import-not-found]  # (an optional dependency: the lint environment has none)

    m = mesh if mesh is not None else current_mesh()
    if m is None:
        raise ValueError("use_expert_parallel needs a mesh: pass mesh=... or call it inside `with vsf.use_mesh(mesh):`")
    settings = (m, axis, tuple(token_axes) if token_axes is not None else None)
    found = [
        module for module in model.modules() if hasattr(module, "is_concatenated") and hasattr(module, "down_proj")
    ]
    if not found:
        raise ValueError(
            f"use_expert_parallel: {type(model).__name__} has no transformers experts module (one built with @use_experts_implementation)"
        )
    for module in found:
        module.vsf_expert_parallel = settings
    ALL_EXPERTS_FUNCTIONS[_IMPLEMENTATION] = _transformers_experts
    model.set_experts_implementation(_IMPLEMENTATION)


def _transformers_experts(
    module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward (its signature) through :func:`expert_parallel`, with
    :func:`use_expert_parallel`'s settings."""
    return _dispatched(module, hidden_states, top_k_index, top_k_weights, *module.vsf_expert_parallel)


def _dispatched(
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    mesh: Mesh,
    axis: str,
    token_axes: Sequence[str] | None,
) -> torch.Tensor:
    """The transformers experts ``module`` run through :func:`expert_parallel` over ``axis``."""
    name = type(module).__name__
    if module.has_bias or module.has_post_expert_norm:
        raise ValueError(
            f"expert parallelism: {name} has expert biases or a post-expert norm, which vsf's dispatch does not run"
        )
    up = module.gate_up_proj if module.has_gate else module.up_proj
    ffn = 2 if module.is_transposed else 1  # gate_up's (or up's) ffn dim
    parts = _packed_parts(up, ffn)

    def grouped(rows: torch.Tensor, offsets: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return F.grouped_mm(x, w if module.is_transposed else w.transpose(1, 2), offs=offsets)

        # a packed gate_up (vsf.packed): each piece's columns from its own rows, put together
        # packed again, so the gate's chunk of them needs no rank's rows but its own
        pieces = w_up.unflatten(ffn, (parts, -1)).unbind(ffn) if parts else (w_up,)
        h = torch.cat([linear(rows, w) for w in pieces], dim=-1) if parts else linear(rows, w_up)
        return linear(module._apply_gate(h) if module.has_gate else module.act_fn(h), w_down)

    return expert_parallel(
        grouped,
        hidden_states,
        top_k_index,
        top_k_weights,
        (up, module.down_proj),
        axis=axis,
        token_axes=token_axes,
        mesh=mesh,
    )


def _packed_parts(weight: torch.Tensor, ffn: int) -> int | None:
    """How many pieces a step input ``weight`` packs its ffn dim ``ffn`` in (``vsf.packed``),
    else ``None``."""
    found = step_input(weight)
    entry = found.sharding.spec.packed.get(ffn) if found is not None else None
    return entry.parts if entry is not None else None


@contextlib.contextmanager
def dispatching_transformers_experts(options: PlanOptions) -> Iterator[None]:
    """Inside, transformers' experts implementations (``ALL_EXPERTS_FUNCTIONS``) run a module whose
    weights are step inputs split on the expert dim (``P("ep")``, ``P("ep", "fsdp")``, ...) through
    :func:`expert_parallel` over that axis, the tokens split over every mesh axis but those that
    split the weights on their ffn dims alone (in the order the plan finds cheapest; those, e.g.
    Megatron's ``tp``, stay automatic in the region, each rank running a slice of every expert);
    a module whose weights are step inputs that no axis splits on the expert dim runs on each
    rank's own tokens over the same token axes (:func:`_on_own_tokens`); any other module runs as
    transformers would. ``vsf.jit`` enters it while it traces a step
    (:func:`vsf.jit.trace.rewrite_while_tracing`), with the plan's ``options``: nothing changes
    where ``vsf.config.dispatch_experts`` is off, or where transformers' MoE integration is not
    imported. :func:`use_expert_parallel`'s explicit settings take precedence.

    Example::

        >>> p = vsf.device_put(params, vsf.NamedSharding.tree(mesh, {k: P("ep") if ".experts." in k else P() for k in params}))
        >>> p, s, loss = vsf.jit(train_step)(p, s, batch)  # the plan's text lists shard_map(expert_dispatch)
    """
    integration = sys.modules.get("transformers.integrations.moe")
    interface = integration.ALL_EXPERTS_FUNCTIONS if integration is not None else None
    if (
        interface is None or not options.dispatch_experts or "get_interface" in vars(interface)
    ):  # (already in force: a trace inside a trace)
        yield
        return
    resolve = interface.get_interface
    interface.get_interface = lambda implementation, default: _dispatch_if_split(resolve(implementation, default))
    try:
        yield
    finally:
        del interface.get_interface


def _dispatch_if_split(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The experts implementation ``forward``, or the dispatch where the module's weights say so."""
    if forward is _transformers_experts:
        return forward

    def experts(
        module: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        up = "gate_up_proj" if module.has_gate else "up_proj"
        hidden = {up: 1 if module.is_transposed else 2, "down_proj": 2 if module.is_transposed else 1}
        split = dispatch_split(module, hidden, hidden_states.shape[0])
        if split is not None:
            return _dispatched(module, hidden_states, top_k_index, top_k_weights, *split)
        local = _token_split(module, hidden, hidden_states.shape[0])
        if local is None:
            return forward(module, hidden_states, top_k_index, top_k_weights)
        return _on_own_tokens(forward, module, hidden_states, top_k_index, top_k_weights, *local)

    return experts


def _token_split(module: Any, hidden: dict[str, int], tokens: int) -> tuple[Mesh, tuple[str, ...]] | None:
    """``(mesh, token axes)`` where the experts ``module``'s weights (named in ``hidden``) are step
    inputs that no axis splits on the expert dim (replicated experts, as data parallelism keeps
    them, or split on their ffn dims by tensor parallelism): the token axes are the mesh's axes of
    more than one rank but those that split the weights' ffn dims alone (:func:`_token_axes`,
    as for a dispatch), and they divide the ``tokens``; else ``None`` (the module runs as traced)."""
    found = {k: step_input(getattr(module, k)) for k in hidden}
    if any(f is None for f in found.values()):
        return None
    mesh, carrying = _token_axes({k: f.sharding for k, f in found.items() if f is not None}, hidden)
    axes = tuple(a for a in carrying if mesh.axis_size(a) > 1)
    if not axes or tokens % math.prod(mesh.axis_size(a) for a in axes):
        return None
    return mesh, axes


def _on_own_tokens(
    forward: Callable[..., torch.Tensor],
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    mesh: Mesh,
    token_axes: tuple[str, ...],
) -> torch.Tensor:
    """The experts ``module`` (its implementation ``forward``) run on each rank's own tokens: one
    ``vsf.shard_map`` region manual over ``token_axes``, the tokens and their routing split over
    them, the module's weights whole over them (their gradients summed over them, as data
    parallelism's are). Each token's result depends on that token alone, but the experts'
    implementations sort and scatter the tokens by expert, which planned on the whole batch
    gathers the tokens over the batch axes (each rank would hold every rank's tokens, every layer)."""
    slots = [
        (table, name)
        for _, m in module.named_modules()
        for table in _compat.module_tables(m)[:2]
        for name, t in table.items()
        if t is not None
    ]
    split = P(token_axes)

    def own_tokens(x: torch.Tensor, index: torch.Tensor, gates: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        held = [table[name] for table, name in slots]
        for (table, name), w in zip(slots, weights):
            table[name] = w
        try:
            return forward(module, x, index, gates)
        finally:
            for (table, name), w in zip(slots, held):
                table[name] = w

    region = shard_map(
        own_tokens,
        mesh=mesh,
        in_specs=(split, split, split, *(P() for _ in slots)),
        out_specs=split,
        axis_names=token_axes,
        any_order=True,  # (each token alone: the plan takes the token axes in the order that moves fewest bytes)
    )
    return region(hidden_states, top_k_index, top_k_weights, *(table[name] for table, name in slots))


def dispatch_split(module: Any, hidden: dict[str, int], tokens: int) -> tuple[Mesh, str, tuple[str, ...]] | None:
    """:func:`_expert_split` of the experts ``module`` (its weights named in ``hidden``, each with
    its hidden dim), checked against the ``tokens`` it runs: a ``PlanError`` where the token axes'
    ranks do not divide them.

    Example::

        >>> dispatch_split(experts, {"gate_up_proj": 2, "down_proj": 1}, 64)  # weights P("ep") on (dp, ep)
        (Mesh(...), 'ep', ('dp', 'ep'))
    """
    split = _expert_split(module, hidden)
    if split is None:
        return None
    mesh, axis, token_axes = split
    ranks = math.prod(mesh.axis_size(a) for a in token_axes)
    if tokens % ranks:
        raise PlanError(
            f"{type(module).__name__}: its experts split over {axis!r} take {tokens} tokens, which the {ranks} ranks of the "
            f"token axes {token_axes!r} (every axis but those that split its weights' ffn dims alone) do not divide: vsf dispatches each rank's share. "
            "Give it a divisible number of tokens, or set vsf.config.dispatch_experts = False to gather the experts instead"
        )
    return split


def _expert_split(module: Any, hidden: dict[str, int]) -> tuple[Mesh, str, tuple[str, ...]] | None:
    """``(mesh, expert axis, token axes)`` where the weights of the experts ``module`` (the
    attributes named in ``hidden``, each ``[experts, ...]`` with its hidden dim there: transformers'
    fused ``gate_up_proj`` and ``down_proj``, torchtitan's separate ``w1``, ``w3`` and ``w2``)
    arrive split on the expert dim (plain axis entries; a ragged or balanced one is not an expert
    split), else ``None``.
    The token axes are every mesh axis but those that split the weights on their ffn dims alone
    (each rank runs a slice of every expert's ffn, Megatron's tensor parallelism: automatic in the
    dispatch); an axis that splits a weight's hidden dim stores it split, as FSDP does (efsdp's
    ``P("ep", "fsdp")``): the tokens are split over it too and the weights gathered over it into
    the dispatch, their gradients reduce-scattered."""
    found = {k: step_input(getattr(module, k)) for k in hidden}
    on_experts = {k: _expert_axes(f) for k, f in found.items()}
    if not any(on_experts.values()):
        return None
    said = "; ".join(
        f"{f.name} is {f.sharding.spec!r}" if f is not None else f"{k} is not a step input" for k, f in found.items()
    )
    axes = set(on_experts.values())
    if len(axes) > 1:
        raise PlanError(
            f"{type(module).__name__}: its weights split the expert dim (dim 0) differently ({said}): vsf dispatches tokens to experts "
            "split alike over one mesh axis. Lay them all out alike (e.g. P('ep')), or split none on dim 0 (or set vsf.config.dispatch_experts = False) to gather them"
        )
    (split,) = axes
    if len(split) > 1:
        raise PlanError(
            f"{type(module).__name__}: its weights split the expert dim (dim 0) over {split!r} ({said}): vsf dispatches tokens over "
            f"one mesh axis. Split dim 0 over one axis and another dim over the rest (efsdp: P({split[0]!r}, {split[1]!r}))"
        )
    mesh, token_axes = _token_axes({k: f.sharding for k, f in found.items() if f is not None}, hidden)
    return mesh, split[0], token_axes


def _token_axes(shardings: dict[str, NamedSharding], hidden: dict[str, int]) -> tuple[Mesh, tuple[str, ...]]:
    """The experts' mesh and the axes their tokens split over: every mesh axis but those that split
    the weights (``shardings``, each weight's hidden dim in ``hidden``) on their ffn dims alone
    (tensor parallelism; an axis that splits a hidden dim stores the weights split, as FSDP does)."""
    splits = {
        (d == hidden[k], a) for k, s in shardings.items() for d in range(1, len(s.spec)) for a in s.spec.entry_axes(d)
    }
    tensor_parallel = {a for on_hidden, a in splits if not on_hidden} - {a for on_hidden, a in splits if on_hidden}
    mesh = next(iter(shardings.values())).mesh
    return mesh, tuple(a for a in mesh.axis_names if a not in tensor_parallel)


def _expert_axes(found: StepInput | None) -> tuple[str, ...]:
    """The mesh axes a step input's plain entry for dim 0 splits it over (none for another input)."""
    spec = found.sharding.spec if found is not None else P()
    return spec.entry_axes(0) if len(spec) and isinstance(spec[0], (str, tuple)) else ()


rewrite_while_tracing(dispatching_transformers_experts)
