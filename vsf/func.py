"""Function transforms over pytrees: ``grad``, ``value_and_grad``, ``remat``, ``with_sharding_constraint``,
``shard_map``.

The first three work eagerly on DTensors (using ``torch.autograd.grad``, which DTensor supports,
with plain tensors a model creates treated as replicated) and inside :func:`vsf.jit`, where the
backward ops they run are traced into the same joint graph as the forward. ``shard_map`` runs a
function on each rank's local shards; inside ``jit`` it is one op of the graph.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from vsf import _compat, remat_policies, tree
from vsf.jit.graph import user_stacklevel
from vsf.jit.trace import per_leaf
from vsf.ops.names import NAME_OP
from vsf.ops import recording
from vsf.ops.recording import current_region, manual_axes
from vsf.ops.region import Region, boundary, copies, lookup, register, summed_over
from vsf.sharding.constraint import constrain
from vsf.sharding.mesh import Mesh, current_mesh, use_mesh
from vsf.sharding.named import NamedSharding, resolve
from vsf.sharding.put import device_put, is_sharding_leaf
from vsf.sharding.spec import PartitionSpec

__all__ = ["grad", "shard_map", "value_and_grad", "with_sharding_constraint"]


def value_and_grad(
    fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """``fun``'s value and its gradient with respect to the pytree argument(s) ``argnums``.

    ``fun`` must return a scalar tensor (or ``(scalar, aux)`` with ``has_aux=True``). Gradients
    have the structure of the differentiated arguments; a leaf that does not affect the value gets
    zeros; non-floating leaves get ``None``.

    Example::

        >>> loss, grads = vsf.value_and_grad(loss_fn)(params, batch)
        >>> (loss, aux), grads = vsf.value_and_grad(loss_fn, has_aux=True)(params, batch)
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    _compat.register_stack_anchor(fun)  # under vsf.jit, ops record their line in fun (for errors)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for i in nums:
            if i >= len(args):
                raise ValueError(
                    f"argnums {argnums!r} asks for argument {i}, but {len(args)} positional arguments were given"
                )
        flat = {i: tree.flatten(args[i]) for i in nums}
        with torch.enable_grad(), implicit_replication():
            diff = {i: _watched(flat[i][0]) for i in nums}
            call_args = [tree.unflatten(flat[i][1], diff[i]) if i in nums else a for i, a in enumerate(args)]
            with recording.differentiating():
                out = fun(*call_args, **kwargs)
            value, aux = out if has_aux else (out, None)
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise TypeError(f"grad needs {getattr(fun, '__name__', 'fun')} to return a scalar tensor, got {shape}")
            wrt = [x for i in nums for x in diff[i] if _differentiable(x)]
            grads = iter(
                torch.autograd.grad(value, wrt, allow_unused=True, create_graph=recording.grad_depth() > 0)
                if wrt
                else ()
            )
        out_grads, unread = [], []
        for i in nums:
            leaves = []
            for k, x in enumerate(diff[i]):
                if not _differentiable(x):
                    leaves.append(None)
                    continue
                g = next(grads)
                if g is None:
                    unread.append((i, k))
                leaves.append(_zero_if_none(g, x))
            out_grads.append(tree.unflatten(flat[i][1], leaves))
        if unread:
            _warn_unread(fun, args, unread)
        g = out_grads[0] if isinstance(argnums, int) else tuple(out_grads)
        value = value if recording.grad_depth() > 0 else _reduced(value.detach())
        return ((value, aux) if has_aux else value), g

    return wrapped


def grad(fun: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of scalar-valued ``fun`` with respect to argument(s) ``argnums`` (JAX's ``grad``).

    Example::

        >>> grads = vsf.grad(loss_fn)(params, batch)
    """
    vg = value_and_grad(fun, argnums, has_aux)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        (value_aux, g) = vg(*args, **kwargs)
        return (g, value_aux[1]) if has_aux else g

    return wrapped


def remat(fun: Callable[..., Any], policy: remat_policies.Policy | None = None) -> Callable[..., Any]:
    """``fun`` whose intermediate values the backward computes again instead of keeping them from
    the forward (JAX's ``jax.checkpoint`` / ``jax.remat``): only what ``policy`` saves (see
    :mod:`vsf.remat_policies`; ``None``: nothing but ``fun``'s inputs) is kept. Inside
    :func:`vsf.jit` the plan runs the recomputed ops right before their first backward use (and
    gathers a sharded weight they read again there, under ``reshard_after_forward``); its text
    marks them. Eagerly it is torch's non-reentrant ``torch.utils.checkpoint.checkpoint`` with a
    selective-checkpoint policy. The values are those of ``fun`` itself: the recompute reads the
    same inputs, and a random draw must come from a key (``vsf.random``) to repeat.

    Example::

        >>> block = vsf.remat(block, policy=vsf.remat_policies.dots_saveable)
        >>> loss, grads = vsf.value_and_grad(lambda p: block(p, x).sum())(params)
    """
    save = policy or remat_policies.nothing_saveable

    def choose(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if save(op, *args, **kwargs) else CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, choose)

    @functools.wraps(fun)
    def rematted(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(functools.partial(fun, **kwargs), *args, use_reentrant=False, context_fn=context)

    return rematted


def checkpoint_name(x: Any, name: str) -> Any:
    """``x`` (a tensor or a pytree of them) named ``name`` for a :func:`remat` policy (JAX's
    ``checkpoint_name``): :func:`vsf.remat_policies.save_only_these_names` saves it by that name.

    Example::

        >>> h = vsf.checkpoint_name(torch.relu(x @ w1), "hidden")
    """
    return tree.map(lambda t: NAME_OP(t, name) if isinstance(t, torch.Tensor) else t, x)


def _reduced(value: torch.Tensor) -> torch.Tensor:
    """An eager DTensor value with pending reductions, reduced (it is one number: cheap, and printable)."""
    if isinstance(value, DTensor) and any(isinstance(p, Partial) for p in value.placements):
        with _compat.quiet_redistribute():
            return value.redistribute(
                value.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in value.placements]
            )
    return value


def _differentiable(x: Any) -> bool:
    if not isinstance(x, torch.Tensor):
        return False
    with _compat.metadata_reads():
        return x.is_floating_point() or x.is_complex()


def _watched(xs: list[Any]) -> list[Any]:
    """The leaves ``xs`` as the differentiated function reads them: each differentiable tensor that
    no enclosing differentiation records already detached, as a new leaf requiring grad (under
    :func:`vsf.jit`, one trace of the detach per kind of leaf, copied for the others:
    :func:`vsf.jit.trace.per_leaf`)."""
    with _compat.metadata_reads():
        fresh = [
            i for i, x in enumerate(xs) if _differentiable(x) and not (x.requires_grad and recording.grad_depth() > 0)
        ]
    out = list(xs)
    for i, x in zip(fresh, per_leaf(torch.Tensor.detach, [(xs[i],) for i in fresh], "detach")):
        out[i] = x.requires_grad_(True)
    return out


def _warn_unread(fun: Callable[..., Any], args: Sequence[Any], unread: list[tuple[int, int]]) -> None:
    """Say which differentiated leaves (``(argument, leaf)`` positions) the value does not read."""
    paths = {i: tree.flatten_with_path(args[i])[0] for i, _ in unread}
    names = [f"args[{i}]{tree.keystr(paths[i][k][0], brackets=True)}" for i, k in unread]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    warnings.warn(
        f"vsf.value_and_grad({getattr(fun, '__name__', 'fun')}): the value does not depend on {len(names)} "
        f"differentiated leaf(s) ({shown}): their gradients are zeros. An optimizer still moves them (vsf.optim's "
        "AdamW decays them and steps them on their moments, as optax does) where torch.optim leaves a parameter "
        "whose .grad is None as it is: differentiate only what the value reads, and pass the rest beside",
        stacklevel=user_stacklevel(),
    )


def _zero_if_none(g: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if g is None else g


def with_sharding_constraint(x: Any, shardings: Any) -> Any:
    """Pin the sharding of every tensor leaf of ``x`` (shardings: a pytree prefix of ``x``).

    Inside :func:`vsf.jit` the propagator must give those values exactly that sharding
    (``P.UNCONSTRAINED`` dims are left to it); eagerly, DTensor leaves are resharded.

    Example::

        >>> h = vsf.with_sharding_constraint(h, P("dp", None, "tp"))
    """
    pairs, treedef = tree.flatten_with_path(x)
    per_leaf = tree.broadcast_prefix(shardings, x, is_leaf=is_sharding_leaf, what="shardings")
    out = []
    for (path, leaf), s in zip(pairs, per_leaf):
        if s is None or not isinstance(leaf, torch.Tensor):
            out.append(leaf)
            continue
        s = resolve(s, tree.keystr(path))
        if _compat.is_fake(leaf):
            _check_constraint(s, leaf, tree.keystr(path))
            out.append(constrain(leaf, s))
        elif leaf.requires_grad and s.spec.ragged is None:
            out.append(_reshard_in_graph(leaf, s, tree.keystr(path)))
        else:
            out.append(device_put(leaf, s))
    return tree.unflatten(treedef, out)


def _reshard_in_graph(x: torch.Tensor, s: NamedSharding, where: str) -> DTensor:
    """Reshard eagerly through DTensor's differentiable ops, so a gradient flows back through the
    constraint (``device_put`` makes a new leaf)."""
    s.check(tuple(x.shape), where)
    dm = s.mesh.device_mesh
    if not isinstance(x, DTensor):
        if _compat.active_local_mode() is not None and not _compat.is_local_tensor(x):
            return device_put(x, s)  # a plain tensor made outside the simulation: no graph to keep
        x = DTensor.from_local(x, dm, [Replicate()] * dm.ndim, run_check=False)
    with _compat.quiet_redistribute():
        return x.redistribute(dm, s.placements)


def _check_constraint(s: NamedSharding, x: torch.Tensor, where: str) -> None:
    if len(s.spec) > x.ndim:
        raise ValueError(
            f"with_sharding_constraint {s.spec!r} for {where} has {len(s.spec)} entries but the value has rank {x.ndim} (shape {tuple(x.shape)})"
        )


def shard_map(
    f: Callable[..., Any],
    *,
    in_specs: Any,
    out_specs: Any,
    mesh: Mesh | None = None,
    axis_names: Sequence[str] | None = None,
    check_vma: bool = True,
    any_order: bool = False,
) -> Callable[..., Any]:
    """``f`` run on each rank's local shards, with collectives you write (JAX's ``shard_map``).

    Each tensor argument is laid out as ``in_specs`` says (a pytree prefix of the arguments, one
    ``P`` per leaf or subtree; arguments already laid out that way are not moved) and ``f`` gets
    its local shards as plain tensors, with ``mesh`` as the current mesh, so the named-axis
    collectives of :mod:`vsf.ops` (``psum``, ``pmean``, ``pmax``, ``all_gather``, ``psum_scatter``,
    ``all_to_all``, ``ppermute``, ``axis_index``, ...) work on them. ``f``'s tensor results are
    this rank's shards of global values laid out as ``out_specs`` (a prefix of the results): a dim
    split over axes of total size ``k`` is ``k`` times as long globally. Every split dim must
    divide evenly, as in JAX. ``axis_names`` (JAX's partial-manual): the manual axes (default:
    all); the specs may name only those, collectives may run only over those, and over the other
    (automatic) axes the body sees whole values. Inside :func:`vsf.jit` the propagator plans the
    body over the automatic axes like the rest of the step (a batch split over ``dp`` stays split,
    params split over ``fsdp`` are gathered where the body needs them); eagerly every rank there
    runs the body on the whole values.

    **Replicated values**: over the manual axes an input's spec leaves out every rank gets the
    whole value and its gradient is summed over them; over the manual axes an output's spec leaves
    out the result must be the same on every rank, and its cotangent is split evenly among them (so
    ``psum``'s backward, which sums the ranks' cotangents, gives it back once). A result that
    differs across such ranks has no defined global value. ``check_vma`` (JAX's name): inside
    :func:`vsf.jit` such a result is an error naming its key path, found from the body's dataflow
    (a value varies over an axis its input's spec splits, or ``axis_index``, ``ppermute``,
    ``all_to_all`` or ``psum_scatter`` over it, made it vary; ``psum``, ``pmean``, ``pmax`` and
    ``all_gather`` over it make it the same everywhere); ``check_vma=False`` trusts the body.
    Eagerly vsf does not check. The gradient rule is the same either way (JAX's without
    ``check_vma``). ``any_order`` (vsf's): ``f`` computes each block of a dim split over several
    axes without regard to which rank holds it (rows routed one by one, say), so inside
    :func:`vsf.jit` the planner may take that entry's axes in another order, the same in every spec
    that names them together (``P(("ep", "cp"))`` for ``P(("cp", "ep"))``), where the plan then
    moves fewer bytes (the values arrive in that order); eagerly the specs hold as written.

    Gradients flow through it (:func:`vsf.grad` of a function calling it). Inside
    :func:`vsf.jit` the body is traced into the step's graph (see :mod:`vsf.ops.region`): the plan
    pins its inputs to ``in_specs`` and its results to ``out_specs``, its collectives are the
    program's (``Lowered.as_text()`` lists them), and its backward is the body's, every collective
    transposed. The body may read only its arguments and constants (a traced value it closes over
    is an error: pass it in); ragged collectives run there where every rank's operand and result
    have one shape (:mod:`vsf.ops.ragged`).

    Example (Megatron's MLP: the hidden dim split over ``tp``, one all-reduce)::

        >>> def mlp(x, w1, w2):
        ...     return vsf.ops.psum(torch.relu(x @ w1) @ w2, "tp")
        >>> y = vsf.shard_map(mlp, mesh=mesh, in_specs=(P("dp"), P(None, "tp"), P("tp")), out_specs=P("dp"))(x, w1, w2)
    """
    name = getattr(f, "__name__", "f")

    @functools.wraps(f)
    def mapped(*args: Any) -> Any:
        m = mesh if mesh is not None else current_mesh()
        if m is None:
            raise ValueError("shard_map needs a mesh: pass mesh=... or call it inside `with vsf.use_mesh(mesh):`")
        manual = _manual(axis_names, m, name)
        in_pairs, in_def = tree.flatten_with_path(args)
        specs = tree.broadcast_prefix(in_specs, args, is_leaf=_is_spec, what="in_specs")
        placed = [
            (
                x,
                _only_manual(
                    _even(NamedSharding(m, spec), tuple(x.shape), f"args{tree.keystr(path)}"),
                    manual,
                    name,
                    "in_specs",
                    f"args{tree.keystr(path)}",
                )
                if isinstance(x, torch.Tensor)
                else None,
            )
            for (path, x), spec in zip(in_pairs, specs)
        ]
        if any(isinstance(x, torch.Tensor) and _compat.is_fake(x) for x, _ in placed):
            return _traced_region(f, name, m, manual, out_specs, in_def, placed, check_vma, any_order)
        local = [_local_shard(x, s, manual) if s is not None else x for x, s in placed]
        with use_mesh(m), manual_axes(name, manual):
            out = f(*tree.unflatten(in_def, local))
        out_pairs, out_def = tree.flatten_with_path(out)
        specs = tree.broadcast_prefix(out_specs, out, is_leaf=_is_spec, what="out_specs")
        return tree.unflatten(
            out_def,
            [
                _global(y, NamedSharding(m, spec), _result(path), manual, name)
                for (path, y), spec in zip(out_pairs, specs)
            ],
        )

    return mapped


def _manual(axis_names: Sequence[str] | None, m: Mesh, name: str) -> tuple[str, ...]:
    """The region's manual axes, in mesh order (all of them by default)."""
    if axis_names is None:
        return tuple(m.axis_names)
    unknown = [a for a in axis_names if a not in m.axis_names]
    if unknown:
        raise ValueError(
            f"shard_map({name}): axis_names {tuple(axis_names)!r} names {unknown[0]!r}, which is not an axis of the mesh {tuple(m.axis_names)!r}"
        )
    return tuple(a for a in m.axis_names if a in axis_names)


def _only_manual(s: NamedSharding, manual: tuple[str, ...], name: str, what: str, where: str) -> NamedSharding:
    """``s``, if its spec names manual axes only (the automatic ones are not the region's to split)."""
    auto = [a for a in s.spec.axes if a not in manual]
    if auto:
        raise ValueError(
            f"shard_map({name}): {what} gives {where} the spec {s.spec!r}, which splits over {auto[0]!r}; the region is manual over {manual!r} only, and specs may name only those axes"
        )
    return s


def _result(path: Any) -> str:
    return "the result" + (tree.keystr(path) if path else "")


def _traced_region(
    f: Callable[..., Any],
    name: str,
    m: Mesh,
    manual: tuple[str, ...],
    out_specs: Any,
    in_def: Any,
    placed: list[tuple[Any, NamedSharding | None]],
    check_vma: bool,
    any_order: bool,
) -> Any:
    """The region traced into the graph under way (see :mod:`vsf.ops.region`): each tensor
    argument enters it through a ``manual_in`` op, the body's ops and collectives are traced as
    they run on the values it sees, and each tensor result leaves through a ``manual_out`` op."""
    outer = current_region()
    if outer is not None:
        raise ValueError(
            f"shard_map({name}) is called inside shard_map({lookup(outer).name}) in a vsf.jit step: nested regions are not supported there; make one region manual over both sets of axes"
        )
    region = Region(name, m, manual, tuple(s for _, s in placed if s is not None), check_vma, any_order=any_order)
    key = register(region)
    entered = iter(boundary(x, key, i, "manual_in") for i, x in enumerate(x for x, s in placed if s is not None))
    with use_mesh(m), manual_axes(name, manual, key):
        out = f(*tree.unflatten(in_def, [next(entered) if s is not None else x for x, s in placed]))
    out_pairs, out_def = tree.flatten_with_path(out)
    specs = tree.broadcast_prefix(out_specs, out, is_leaf=_is_spec, what="out_specs")
    region.outs = tuple(
        _out_sharding(y, NamedSharding(m, spec), _result(path), manual, name)
        for (path, y), spec in zip(out_pairs, specs)
        if isinstance(y, torch.Tensor)
    )
    region.out_names = tuple(_result(path) for path, y in out_pairs if isinstance(y, torch.Tensor))
    results = iter(
        boundary(y, key, i, "manual_out") for i, y in enumerate(y for _, y in out_pairs if isinstance(y, torch.Tensor))
    )
    return tree.unflatten(out_def, [next(results) if isinstance(y, torch.Tensor) else y for _, y in out_pairs])


def _out_sharding(y: torch.Tensor, s: NamedSharding, where: str, manual: tuple[str, ...], name: str) -> NamedSharding:
    if isinstance(y, DTensor):
        raise TypeError(f"shard_map: {where} is a DTensor; the function must return its local shards as plain tensors")
    if len(s.spec) > y.ndim:
        raise ValueError(f"shard_map: {where} has {y.ndim} dims but out_specs gives it {s.spec!r}")
    return _only_manual(s, manual, name, "out_specs", where)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _even(s: NamedSharding, shape: tuple[int, ...], where: str) -> NamedSharding:
    """``s`` if every dim it splits divides evenly (shard_map's rule), else a ``ValueError`` saying where."""
    if s.ragged is not None:
        raise ValueError(f"shard_map: {where} has the ragged spec {s.spec!r}; shard_map takes even splits only")
    s.check(shape, where)
    for d in range(len(shape)):
        if shape[d] % s.num_shards(d):
            raise ValueError(
                f"shard_map: {where} has {shape[d]} in dim {d}, which {s.spec!r} splits {s.num_shards(d)} ways: it must divide evenly"
            )
    return s


def _local_shard(x: torch.Tensor, s: NamedSharding, manual: tuple[str, ...]) -> torch.Tensor:
    """This rank's shard of ``x`` laid out as ``s``, through autograd when ``x`` needs a gradient:
    over the manual axes ``s`` replicates ``x``, each rank's gradient is a partial sum (JAX's
    transpose of the implicit broadcast), reduced where the gradient is used."""
    if not x.requires_grad:
        return device_put(x, s).to_local()
    return _reshard_in_graph(x, s, "").to_local(grad_placements=summed_over(s, manual))


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward divides the gradient by ``k``."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, k: int) -> torch.Tensor:
        ctx.k = k
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g / ctx.k, None


def _global(y: Any, s: NamedSharding, where: str, manual: tuple[str, ...], name: str) -> Any:
    """The DTensor whose local shard on this rank is ``y``, laid out as ``s`` (non-tensors pass through)."""
    if not isinstance(y, torch.Tensor):
        return y
    _out_sharding(y, s, where, manual, name)
    shape = tuple(n * s.num_shards(d) for d, n in enumerate(y.shape))
    stride = tuple(torch.empty(shape, device="meta").stride())
    k = copies(s, manual)
    if y.requires_grad and k > 1:
        # the ranks a spec replicates y over each get the whole gradient, and each sends it back
        # through f; psum's backward sums them, so each takes its share (JAX's rule without check_rep)
        y = _ScaleGrad.apply(y, k)
    return DTensor.from_local(y, s.mesh.device_mesh, s.placements, run_check=False, shape=shape, stride=stride)
