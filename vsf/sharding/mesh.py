"""Named device meshes.

A :class:`Mesh` is a value: axis names, axis sizes, the global ranks laid out row-major over
them, and the device type. It builds (once, and only for axes larger than one) the
``torch.distributed.DeviceMesh`` that DTensor runs on, so a 5D mesh such as
``("pp", "dp", "fsdp", "cp", "tp") = (1, 2, 2, 1, 2)`` costs communicators for three axes only.

Example::

    >>> with vsf.simulate(8):
    ...     mesh = vsf.make_mesh((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"))
    ...     mesh.shape
    {'pp': 1, 'dp': 2, 'fsdp': 2, 'cp': 1, 'tp': 2}
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from vsf import _compat, runtime

__all__ = ["Mesh", "current_mesh", "held_only_by_its_ranks", "make_mesh", "mesh_of", "use_mesh"]


class Mesh:
    """An immutable, hashable named mesh of ranks.

    ``devices`` lists the global rank at each mesh position, row-major over ``axis_names``
    (default ``0..size-1``, JAX's ``np.arange(n).reshape(shape)``).

    Example::

        >>> mesh = vsf.Mesh((2, 4), ("dp", "tp"))
        >>> mesh.size, mesh.axis_names
        (8, ('dp', 'tp'))
    """

    __slots__ = ("_names", "_sizes", "_devices", "_device_type", "_hash")
    _names: tuple[str, ...]
    _sizes: tuple[int, ...]
    _devices: tuple[int, ...]
    _device_type: str
    _hash: int

    def __init__(
        self,
        axis_shapes: Sequence[int],
        axis_names: Sequence[str],
        *,
        device_type: str = "cpu",
        devices: Sequence[int] | None = None,
    ) -> None:
        sizes, names = tuple(axis_shapes), tuple(axis_names)
        if len(sizes) != len(names):
            raise ValueError(f"mesh has {len(sizes)} axis sizes {sizes} but {len(names)} axis names {names}")
        if not names:
            raise ValueError("a mesh needs at least one axis")
        if not all(isinstance(n, str) and n for n in names):
            raise TypeError(f"mesh axis names must be non-empty strings, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be distinct, got {names!r}")
        if not all(isinstance(s, int) and s >= 1 for s in sizes):
            raise ValueError(f"mesh axis sizes must be positive integers, got {sizes!r}")
        n = math.prod(sizes)
        devs = tuple(range(n)) if devices is None else tuple(int(d) for d in devices)
        if len(devs) != n or len(set(devs)) != n or min(devs) < 0:
            raise ValueError(f"mesh of shape {sizes} needs {n} distinct non-negative ranks, got {devs!r}")
        for slot, value in zip(self.__slots__, (names, sizes, devs, device_type)):
            object.__setattr__(self, slot, value)
        object.__setattr__(self, "_hash", hash(self._key()))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Mesh is immutable")

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names, in mesh order."""
        return self._names

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        """Axis sizes, in mesh order."""
        return self._sizes

    @property
    def shape(self) -> dict[str, int]:
        """Ordered mapping axis name -> size."""
        return dict(zip(self._names, self._sizes))

    @property
    def size(self) -> int:
        """Number of ranks in the mesh."""
        return len(self._devices)

    @property
    def devices(self) -> tuple[int, ...]:
        """Global ranks, row-major over the axes."""
        return self._devices

    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
        return self._device_type

    def axis_size(self, name: str) -> int:
        """Size of axis ``name`` (a ``ValueError`` naming the mesh's axes if unknown)."""
        return self._sizes[self.axis_index(name)]

    def axis_index(self, name: str) -> int:
        """Position of axis ``name`` in mesh order."""
        try:
            return self._names.index(name)
        except ValueError:
            raise ValueError(f"unknown mesh axis {name!r}; the mesh has axes {self.shape}") from None

    def coordinate(self, rank: int) -> dict[str, int]:
        """Position of global ``rank`` on each axis (in its own copy: :meth:`copy_devices`)."""
        return self._position(self.copy_devices(rank).index(rank))

    def copy_devices(self, rank: int) -> tuple[int, ...]:
        """The global ranks of the copy of this mesh that holds ``rank``, row-major over the axes.

        A sub-mesh (``mesh[names]``, ``mesh.at(axis, i)``) exists once per group of ranks (each
        rank gets the copy that holds it), so a rank of another copy computes in its own: its
        position and its groups there. That matters under :class:`vsf.simulate`, where one process
        holds every rank. A rank no copy holds is a ``ValueError``.

        Example::

            >>> mesh = vsf.make_mesh((2, 2), ("pp", "ep"))            # under vsf.simulate(4)
            >>> mesh.at("pp", 1).devices, mesh.at("pp", 1).copy_devices(0)
            ((2, 3), (0, 1))
        """
        if rank in self._devices:
            return self._devices
        dm = _DEVICE_MESHES.get(self)
        grid = None if dm is None else _compat.copy_holding(dm, rank)
        if grid is None:
            raise ValueError(f"rank {rank} is not in {self!r}")
        at = (self._position(flat) for flat in range(self.size))
        return tuple(int(grid[tuple(coords.get(n, 0) for n in dm.mesh_dim_names)]) for coords in at)

    def _position(self, flat: int) -> dict[str, int]:
        """The coordinates of the ``flat``-th position, row-major over the axes."""
        coords = {}
        for name, size in zip(reversed(self._names), reversed(self._sizes)):
            flat, coords[name] = divmod(flat, size)
        return {n: coords[n] for n in self._names}

    @property
    def device_axes(self) -> tuple[str, ...]:
        """The dims of the underlying DeviceMesh, in its order: the axes larger than 1 (the first
        axis if none is). A sub-mesh keeps its parent's order there, whatever order it names."""
        if self in _DEVICE_MESHES:
            return tuple(_DEVICE_MESHES[self].mesh_dim_names)
        big = tuple(n for n, s in zip(self._names, self._sizes) if s > 1)
        return big or self._names[:1]

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``torch.distributed.DeviceMesh`` over :attr:`device_axes` (built once per process group)."""
        return _device_mesh(self)

    def __getitem__(self, names: str | Sequence[str]) -> "Mesh":
        """The sub-mesh over ``names`` (any order) that contains this process's rank.

        Example::

            >>> mesh["tp", "dp"].axis_names
            ('tp', 'dp')
        """
        names = (names,) if isinstance(names, str) else tuple(names)
        for n in names:
            self.axis_index(n)
        if len(set(names)) != len(names):
            raise ValueError(f"sub-mesh axes must be distinct, got {names!r}")
        here = self.coordinate(runtime.rank()) if runtime.rank() in self._devices else dict.fromkeys(self._names, 0)
        return self._sub(names, here)

    def at(self, axis: str, index: int) -> "Mesh":
        """The sub-mesh over the other axes at position ``index`` of ``axis`` (a pipeline stage's
        ranks: ``mesh.at("pp", 1)``), its other coordinates this rank's.

        Its ranks hold values there; under :class:`vsf.simulate` every simulated rank can compute
        on it (each in the copy of its own pp coordinate). Under ``torchrun`` only the ranks at
        ``index`` may compute on it: elsewhere it is a value that names the ranks, without a
        DeviceMesh.

        Example::

            >>> mesh.at("pp", 1).devices          # (4, 5, 6, 7) on a (2, 2, 2) pp x dp x tp mesh
        """
        if not 0 <= index < self.axis_size(axis):
            raise ValueError(f"{axis} index {index} is outside the mesh's {axis} axis of size {self.axis_size(axis)}")
        here = self.coordinate(runtime.rank()) if runtime.rank() in self._devices else dict.fromkeys(self._names, 0)
        names = tuple(n for n in self._names if n != axis)
        coord = {**here, axis: index}
        if not names:  # a mesh of the one axis: one rank, kept under the axis's name
            sub = Mesh((1,), (axis,), device_type=self._device_type, devices=(self._devices[self._flat_index(coord)],))
            names = (axis,)
        else:
            sub = self._sub(names, coord, register=False)
        _AT[sub] = (self, axis)
        if sub in _DEVICE_MESHES:
            return sub
        if runtime.is_simulated():
            _register(sub, self._rolled(axis, index, names))
        elif here[axis] == index and names == (axis,):
            _register(sub, _compat.one_rank_device_mesh(self._device_type, runtime.world_size(), axis))
        elif here[axis] == index:
            self._sub(names, coord)
        return sub

    def _rolled(self, axis: str, index: int, names: tuple[str, ...]) -> DeviceMesh:
        """Under simulation, ``at(axis, index)``'s DeviceMesh: the copies over ``names`` of this
        mesh with ``axis`` rolled by ``index``, so every simulated rank sits in a copy at its own
        coordinates, and the DeviceMesh differs from the other coordinates' (DTensor compares
        DeviceMeshes by their ranks: equal ones would be taken for each other)."""
        grid = torch.tensor(self._devices, dtype=torch.int).reshape(self._sizes).roll(-index, self.axis_index(axis))
        big = tuple(n for n in self.device_axes if n in names and n != axis and self.axis_size(n) > 1)
        if not big:
            return _compat.one_rank_device_mesh(
                self._device_type, runtime.world_size(), names[0], rank_map=grid.flatten()
            )
        axes = self.device_axes
        with _compat.local_mode_disabled():
            root = DeviceMesh(self._device_type, grid.reshape([self.axis_size(a) for a in axes]), mesh_dim_names=axes)
        return root[big]

    def _sub(self, names: tuple[str, ...], here: dict[str, int], register: bool = True) -> "Mesh":
        sub_sizes = tuple(self.axis_size(n) for n in names)
        devices = []
        for idx in range(math.prod(sub_sizes)):
            coord = dict(here)
            for n, s in zip(reversed(names), reversed(sub_sizes)):
                idx, coord[n] = divmod(idx, s)
            devices.append(self._devices[self._flat_index(coord)])
        sub = Mesh(sub_sizes, names, device_type=self._device_type, devices=devices)
        if not register:
            return sub
        in_parent_order = tuple(n for n in self.device_axes if n in names and self.axis_size(n) > 1)
        if in_parent_order:
            _register(sub, self.device_mesh[in_parent_order])
        else:
            _register(sub, _compat.one_rank_device_mesh(self._device_type, runtime.world_size(), names[0]))
        return sub

    def _flat_index(self, coord: dict[str, int]) -> int:
        flat = 0
        for n, s in zip(self._names, self._sizes):
            flat = flat * s + coord[n]
        return flat

    def _key(self) -> tuple[Any, ...]:
        return (self._names, self._sizes, self._devices, self._device_type)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        extra = "" if self._devices == tuple(range(self.size)) else f", devices={self._devices!r}"
        return f"Mesh({self._sizes!r}, {self._names!r}, device_type={self._device_type!r}{extra})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self._sizes, self._names, self._device_type, self._devices))


def _rebuild(sizes: tuple[int, ...], names: tuple[str, ...], device_type: str, devices: tuple[int, ...]) -> Mesh:
    return Mesh(sizes, names, device_type=device_type, devices=devices)


# One DeviceMesh per Mesh value and process group (building one is collective and costly), and
# the way back from a DTensor's DeviceMesh to the Mesh it was built for.
_DEVICE_MESHES: dict[Mesh, DeviceMesh] = {}
_MESH_OF: dict[int, tuple[DeviceMesh, Mesh]] = {}


# the meshes Mesh.at made, each with the mesh and axis it was taken at: only their own ranks hold
# their values (a simulation's copies of them on the other coordinates are not memory a real run has)
_AT: dict[Mesh, tuple[Mesh, str]] = {}


def held_only_by_its_ranks(mesh: Mesh) -> bool:
    """Is ``mesh`` one coordinate of a bigger mesh (``Mesh.at``), whose values only its own ranks
    hold? Under simulation its DeviceMesh has copies elsewhere too; ``memory_report`` counts
    only its ranks.

    Example::

        >>> held_only_by_its_ranks(mesh.at("pp", 1)), held_only_by_its_ranks(mesh["dp"])
        (True, False)
    """
    return mesh in _AT


def group_across(mesh: Mesh) -> Any:
    """For a mesh ``Mesh.at(axis, i)`` made (a pipeline stage's ranks), the process group of ``axis``
    that joins its ranks to the ranks at the same other coordinates at the other positions of
    ``axis`` (the other stages); ``None`` for any other mesh, for an axis of one rank, and under
    :class:`vsf.simulate` (one process holds every position: there is nothing to join).

    Example::

        >>> dist.all_reduce(stage_sum, group=group_across(mesh.at("pp", here)))   # a sum over the stages
    """
    if mesh not in _AT or runtime.is_simulated():
        return None
    parent, axis = _AT[mesh]
    return parent.device_mesh.get_group(axis) if parent.axis_size(axis) > 1 else None


def _register(mesh: Mesh, dm: DeviceMesh) -> DeviceMesh:
    _DEVICE_MESHES.setdefault(mesh, dm)
    _MESH_OF.setdefault(id(dm), (dm, mesh))
    return _DEVICE_MESHES[mesh]


def _device_mesh(mesh: Mesh) -> DeviceMesh:
    if mesh in _DEVICE_MESHES:
        return _DEVICE_MESHES[mesh]
    runtime.ensure_world(mesh.device_type)
    world = runtime.world_size()
    if max(mesh.devices) >= world:
        raise ValueError(
            f"{mesh!r} uses rank {max(mesh.devices)} but the process group has {world} ranks; "
            f"run under `torchrun --nproc-per-node {mesh.size}` or inside `vsf.simulate({mesh.size})`"
        )
    axes = mesh.device_axes
    grid = torch.tensor(mesh.devices, dtype=torch.int).reshape([mesh.axis_size(a) for a in mesh._names if a in axes])
    with _compat.local_mode_disabled():
        dm = DeviceMesh(mesh.device_type, grid, mesh_dim_names=axes)
    return _register(mesh, dm)


def forget_meshes() -> None:
    """Drop every cached DeviceMesh (called when the process group they belong to is destroyed)."""
    _DEVICE_MESHES.clear()
    _MESH_OF.clear()
    # DTensor caches op shardings by value: an old, equal DeviceMesh would come back from there
    _compat.clear_sharding_caches()


runtime.on_stop(forget_meshes)


def mesh_of(dm: DeviceMesh) -> Mesh:
    """The :class:`Mesh` a DeviceMesh was built for (or an equivalent one for a foreign DeviceMesh)."""
    if id(dm) in _MESH_OF:
        return _MESH_OF[id(dm)][1]
    names = dm.mesh_dim_names or tuple(f"dim{i}" for i in range(dm.ndim))
    mesh = Mesh(tuple(dm.mesh.shape), names, device_type=dm.device_type, devices=dm.mesh.flatten().tolist())
    _register(mesh, dm)
    return mesh


def make_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], *, device_type: str | None = None) -> Mesh:
    """Build a named mesh over every rank of this run.

    ``device_type`` defaults to ``"cuda"`` when CUDA is available, else ``"cpu"``; the process
    group backend follows (NCCL / gloo). Under ``torchrun`` the default process group is
    initialised from the environment when none exists. The mesh must cover the whole world.

    Example::

        >>> with vsf.simulate(8):
        ...     mesh = vsf.make_mesh((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"))
    """
    device_type = device_type or runtime.default_device_type()
    mesh = Mesh(axis_shapes, axis_names, device_type=device_type)
    runtime.ensure_world(device_type)
    world = runtime.world_size()
    if mesh.size != world:
        raise ValueError(
            f"mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))} has {mesh.size} ranks but this run has "
            f"{world}; launch with `torchrun --nproc-per-node {mesh.size}` or wrap the code in "
            f"`with vsf.simulate({mesh.size}):`"
        )
    _ = mesh.device_mesh  # build the communicators now, on every rank together
    return mesh


_CURRENT: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("vsf_current_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Make ``mesh`` the current mesh, so a bare ``P(...)`` is accepted wherever a sharding is.

    Example::

        >>> with vsf.use_mesh(mesh):
        ...     x = vsf.device_put(torch.ones(8, 4), P("dp"))
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"use_mesh expects a vsf.Mesh, got {type(mesh).__name__}")
    token = _CURRENT.set(mesh)
    try:
        yield mesh
    finally:
        _CURRENT.reset(token)


def current_mesh() -> Mesh | None:
    """The mesh set by the innermost :func:`use_mesh`, or ``None``."""
    return _CURRENT.get()
