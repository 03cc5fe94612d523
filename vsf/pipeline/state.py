"""State a pipeline stage's forward writes: buffers such as a MoE router's token counts or a
running mean, which ``vsf.tree.apply(module, ..., mutable=True)`` returns instead of writing.

The state is a pytree of its own beside the params, placed on the stages by the same key-path
prefixes (``pipe.place(buffers, state=True)``: a stage may hold none of it, nothing is tied) and
passed to the step as the pair ``place`` returns (``state=``). Each stage function then takes
its state after its params and returns ``(y, written)`` (the entries it wrote); its program
returns ``(y, state)`` (:func:`with_state`), and the stage's
:class:`~vsf.pipeline.stage.StageModule` keeps the state it returned, so each microbatch's forward
reads what the one before wrote, in the schedule's order, as a module's buffers are written under
torch's schedules, on real processes as under ``vsf.simulate``. The step returns the state after
the last microbatch with its layout (:func:`returned`).

Example::

    >>> counts = pipe.place(vsf.tree.from_module(model, params=False, buffers=True), state=True)  # (tree, layout)
    >>> (loss, counts), grads = pipe.value_and_grad(params, x, t, layout=layout, state=counts)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import tree
from vsf.pipeline.split import Layout, leaf_names
from vsf.pipeline.stage import Boundary, StageModule, stand_in

__all__ = ["check", "held", "returned", "shapes", "stand_ins", "where", "with_state"]


def with_state(fn: Callable[..., Any], stage: int) -> Callable[..., Any]:
    """Stage function ``fn(params, state, *x) -> (y, written)`` as one returning ``(y, state)``:
    the whole state, the entries ``written`` replaced (an error naming the stage for an entry
    ``state`` does not have).

    Example::

        >>> with_state(lambda p, st, x: (x, {"n": st["n"] + 1}), 0)({}, {"n": n, "m": m}, x)[1].keys()
        dict_keys(['n', 'm'])
    """

    def stage_with_state(params: Any, state: dict[str, Any], *xs: Any) -> tuple[Any, dict[str, Any]]:
        result = fn(params, state, *xs)
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
            got = "a tensor" if isinstance(result, torch.Tensor) else f"a {type(result).__name__}"
            raise TypeError(
                f"pipeline stage {stage} was given state, so its function must return (output, written state), a dict; got {got}"
            )
        y, written = result
        unknown = sorted(set(written) - set(state))
        if unknown:
            raise ValueError(
                f"pipeline stage {stage} wrote state {unknown}, which is not its own (its state: {sorted(state)}); the state's keys are the dotted names the pipeline's prefixes assign to it"
            )
        return y, {k: written.get(k, v) for k, v in state.items()}

    return stage_with_state


def check(state: Any) -> Any:
    """A step's ``state``, the pair ``pipe.place(buffers, state=True)`` returned: its layout."""
    if not (isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], Layout)):
        raise TypeError(
            f"state must be the pair (state, layout) that pipe.place(buffers, state=True) returned (or the step returned); got {type(state).__name__}"
        )
    return state[1]


def where(layout: Layout | None, s: int) -> dict[str, Boundary] | None:
    """Stage ``s``'s state entries' layouts and shapes, as ``layout`` (the state's) places them;
    ``None`` for a step without state.

    Example::

        >>> where(counts_layout, 1)
        {'layers.1.router.tokens_per_expert_E': (NamedSharding(mesh=..., spec=P()), (4,))}
    """
    return None if layout is None else {k: layout.where(k, s) for k in layout.split.names[s]}


def stand_ins(layout: Layout | None, s: int) -> tuple[dict[str, torch.Tensor], ...]:
    """Stage ``s``'s state as its program's argument after the params, zeros of its layouts and
    shapes (:func:`~vsf.pipeline.stage.stand_in`): one dict, or no argument without state."""
    if layout is None:
        return ()
    return ({k: stand_in(layout.where(k, s), layout.shapes[k].dtype) for k in layout.split.names[s]},)


def shapes(layout: Layout | None, s: int) -> tuple[dict[str, Any], ...]:
    """Stage ``s``'s state as ``ShapeDtypeStruct`` s (for ``vsf.eval_shape``): one dict, or none."""
    return () if layout is None else ({k: layout.shapes[k] for k in layout.split.names[s]},)


def held(state: Any, layout: Layout | None, s: int) -> dict[str, DTensor] | None:
    """Stage ``s``'s entries of ``state`` (DTensors on its mesh, as ``place(state, state=True)`` laid
    them out), detached; ``None`` for a step without state."""
    if layout is None:
        return None
    given = dict(zip(leaf_names(state), tree.leaves(state)))
    out = {}
    for k in layout.split.names[s]:
        if not isinstance(v := given.get(k), DTensor):
            raise TypeError(
                f"state {k!r} is a {type(v).__name__}, not a DTensor on stage {s}'s mesh: lay the state out with pipe.place(state, state=True)"
            )
        out[k] = v.detach()
    return out


def returned(state: tuple[Any, Layout], mods: Mapping[int, StageModule]) -> tuple[Any, Layout]:
    """The pair ``state`` (a tree and its layout) holding what the stages ``mods`` hold after the
    step (``None`` where the tree is)."""
    given, layout = state
    now = {k: v for mod in mods.values() for k, v in (mod.state or {}).items()}
    new = [now[k] if v is not None else None for k, v in zip(leaf_names(given), tree.leaves(given))]
    return tree.unflatten(tree.structure(given), new), layout
