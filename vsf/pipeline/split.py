"""Which params each pipeline stage holds: key-path prefixes per stage, checked once.

A stage is given as the key-path prefixes of its params (``"blocks.0."`` takes every leaf
whose dotted name starts with it; a full name takes that leaf). Every leaf must fall in exactly
one stage, except the names in ``tied``: a tied param (GPT's token embedding, used again as the
output layer) belongs to the first stage that names it and is lent to every later stage that
names it, Megatron's way (each step the owner's value is copied to the borrowers and their
gradients are summed into the owner's before the update).

Example::

    >>> split = assign(params, [["wte.", "wpe.", "blocks.0."], ["blocks.1.", "lnf.", "wte."]], tied=("wte.weight",))
    >>> split.owner["wte.weight"], split.users["wte.weight"]
    (0, (0, 1))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vsf import tree
from vsf.abstract import ShapeDtypeStruct
from vsf.sharding.mesh import Mesh
from vsf.sharding.named import NamedSharding
from vsf.sharding.spec import PartitionSpec

__all__ = ["Layout", "Split", "assign", "leaf_names"]


@dataclasses.dataclass(frozen=True)
class Split:
    """Stage ``s`` computes with ``names[s]`` (its own params and what it borrows); ``owner[k]`` is
    the stage that holds leaf ``k`` and its optimizer state, ``users[k]`` every stage that uses it."""

    names: tuple[tuple[str, ...], ...]
    owner: dict[str, int]
    users: dict[str, tuple[int, ...]]

    @property
    def num_stages(self) -> int:
        return len(self.names)

    def owned(self, stage: int) -> tuple[str, ...]:
        """The leaves stage ``stage`` holds (what it uses, less what it borrows)."""
        return tuple(k for k in self.names[stage] if self.owner[k] == stage)

    def borrowed(self, stage: int) -> tuple[str, ...]:
        """The tied leaves stage ``stage`` uses but another stage holds."""
        return tuple(k for k in self.names[stage] if self.owner[k] != stage)


def leaf_names(params: Any) -> list[str]:
    """Each leaf's dotted key path (``"blocks.0.attn.qkv.weight"``), in flatten order."""
    return [tree.keystr(p) for p, _ in tree.leaves_with_path(params)]


def assign(params: Any, stages: Sequence[Sequence[str]], tied: Sequence[str] = (), every_prefix: bool = True) -> Split:
    """Assign every leaf of ``params`` to the stages whose prefixes match its dotted name.

    Errors name the key path: a leaf no stage takes, a leaf two stages take that is not in
    ``tied``, a prefix that matches nothing (unless ``every_prefix`` is off: a pipeline's state,
    the buffers some stages' layers write and others' have none of), a tied name that is not a
    leaf or that only one stage uses.

    Example::

        >>> assign({"blocks.1.count": c}, [["wte.", "blocks.0."], ["blocks.1."]], every_prefix=False).names
        ((), ('blocks.1.count',))
    """
    if len(stages) < 1 or isinstance(stages, str) or any(isinstance(s, str) for s in stages):
        raise TypeError(
            "stages must be a list with one list of key-path prefixes per stage, e.g. [['wte.', 'blocks.0.'], ['blocks.1.', 'lnf.']]"
        )
    names = leaf_names(params)
    if len(set(names)) != len(names):
        raise ValueError(
            "params have leaves whose dotted key paths coincide; pipeline stages select leaves by those names"
        )
    unknown_tied = [t for t in tied if t not in names]
    if unknown_tied:
        raise ValueError(f"tied names {unknown_tied[0]!r}, which is not a leaf of params (leaves: {names[:4]}...)")
    per_stage: list[tuple[str, ...]] = []
    for s, prefixes in enumerate(stages):
        taken = tuple(k for k in names if any(k == p or k.startswith(p) for p in prefixes))
        for p in prefixes if every_prefix else ():
            if not any(k == p or k.startswith(p) for k in names):
                raise ValueError(f"stage {s}'s key-path prefix {p!r} matches no param (leaves: {names[:4]}...)")
        per_stage.append(taken)
    users = {k: tuple(s for s, taken in enumerate(per_stage) if k in taken) for k in names}
    for k, us in users.items():
        if not us:
            raise ValueError(f"param {k!r} is in no pipeline stage: add a prefix of it to one stage's list")
        if len(us) > 1 and k not in tied:
            raise ValueError(
                f"param {k!r} is in stages {list(us)}; a param lives on one stage (pass tied=({k!r},) to share it Megatron's way)"
            )
    for k in tied:
        if len(users[k]) < 2:
            raise ValueError(
                f"tied param {k!r} is used by stage {list(users[k])} only; a tied param must be named by two or more stages"
            )
    return Split(tuple(per_stage), {k: us[0] for k, us in users.items()}, users)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Where a pipeline's params live, as ``Pipeline.place`` laid them out: the stages' ``split``,
    each leaf's global ``shapes`` (and dtype) and its ``specs`` over the axes other than ``pp``, and
    the stages' ``meshes``. Every rank holds the whole layout, also of the leaves other stages
    hold. Compared by identity: the pipeline keeps its per-layout programs keyed by it.

    Example::

        >>> params, layout = pipe.place(params, specs)
        >>> layout.split.owner["wte.weight"], layout.where("wte.weight", 1)[0].spec
        (0, PartitionSpec(None, 'tp'))
    """

    split: Split
    shapes: dict[str, ShapeDtypeStruct]
    specs: dict[str, PartitionSpec]
    meshes: tuple[Mesh, ...]

    def where(self, k: str, stage: int) -> tuple[NamedSharding, tuple[int, ...]]:
        """Leaf ``k``'s layout on ``stage``'s mesh (by its spec over the other axes) and its shape."""
        return NamedSharding(self.meshes[stage], self.specs[k]), self.shapes[k].shape
