"""Abstract values: a tensor's shape, dtype and sharding without its data.

:class:`ShapeDtypeStruct` says what a leaf looks like (JAX's class of the same name);
:func:`eval_shape` runs a function on such descriptions, allocating nothing, and describes what
it returns. Together they build targets for :func:`vsf.checkpoint.load`, e.g. the optimizer
state a restored run will need::

    >>> with vsf.simulate(4):
    ...     mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    ...     w = vsf.ShapeDtypeStruct((8, 4), torch.float32, vsf.NamedSharding(mesh, P("dp", "tp")))
    ...     vsf.eval_shape(lambda p: {"mu": torch.zeros_like(p), "count": torch.zeros([])}, w)["mu"]
    ShapeDtypeStruct(shape=(8, 4), dtype=torch.float32, sharding=NamedSharding(mesh=Mesh((2, 2), ('dp', 'tp'), device_type='cpu'), spec=P('dp', 'tp')))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat, runtime, tree
from vsf.sharding.named import NamedSharding, sharding_of
from vsf.sharding.put import local_device

__all__ = ["ShapeDtypeStruct", "empty", "eval_shape"]


class ShapeDtypeStruct:
    """The shape, dtype and (optional) sharding of a tensor: immutable, hashable, ``repr`` round-trips.

    ``sharding=None`` means a plain tensor held whole by this process; a :class:`vsf.NamedSharding`
    means a DTensor laid out as it says.

    Example::

        >>> s = vsf.ShapeDtypeStruct((8, 4), torch.bfloat16)
        >>> s.ndim, s.nbytes
        (2, 64)
        >>> vsf.ShapeDtypeStruct.like(torch.zeros(3)) == vsf.ShapeDtypeStruct((3,), torch.float32)
        True
    """

    __slots__ = ("_shape", "_dtype", "_sharding")
    _shape: tuple[int, ...]
    _dtype: torch.dtype
    _sharding: NamedSharding | None

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, sharding: NamedSharding | None = None) -> None:
        shape = tuple(shape)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise ValueError(f"ShapeDtypeStruct shape must be non-negative integers, got {shape!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"ShapeDtypeStruct dtype must be a torch.dtype, got {dtype!r} ({type(dtype).__name__})")
        if sharding is not None:
            if not isinstance(sharding, NamedSharding):
                raise TypeError(f"ShapeDtypeStruct sharding must be a vsf.NamedSharding or None, got {sharding!r}")
            sharding.check(shape)
        for slot, value in zip(self.__slots__, (shape, dtype, sharding)):
            object.__setattr__(self, slot, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ShapeDtypeStruct is immutable")

    @classmethod
    def like(cls, x: "torch.Tensor | ShapeDtypeStruct") -> "ShapeDtypeStruct":
        """The description of a live tensor or DTensor (its sharding from :func:`vsf.sharding.sharding_of`)."""
        if isinstance(x, ShapeDtypeStruct):
            return x
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"ShapeDtypeStruct.like expects a tensor or ShapeDtypeStruct, got {type(x).__name__}")
        return cls(tuple(x.shape), x.dtype, sharding_of(x))

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def sharding(self) -> NamedSharding | None:
        return self._sharding

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (global) value."""
        return math.prod(self._shape) * self._dtype.itemsize

    def _key(self) -> tuple[Any, ...]:
        return (self._shape, self._dtype, self._sharding)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShapeDtypeStruct) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"ShapeDtypeStruct(shape={self._shape!r}, dtype={self._dtype}, sharding={self._sharding!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ShapeDtypeStruct, self._key())


def eval_shape(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Describe ``fn(*args, **kwargs)`` without computing or allocating it.

    Inputs may be tensors, DTensors or :class:`ShapeDtypeStruct` s (other leaves pass through).
    ``fn`` runs on fake tensors (shapes and dtypes only); DTensor inputs keep their placements,
    so DTensor's own sharding propagation decides the output shardings. Tensor outputs come back
    as ``ShapeDtypeStruct`` s, other outputs unchanged.

    Example::

        >>> state = vsf.eval_shape(tx.init, params)     # no optimizer memory allocated
        >>> state = vsf.checkpoint.load("ckpt/step_100", target=state)
    """
    structs = tree.map(_describe, (args, kwargs))
    with _compat.local_mode_disabled(), _compat.fake_mode():
        fake_args, fake_kwargs = tree.map(lambda x: empty(x) if isinstance(x, ShapeDtypeStruct) else x, structs)
        out = fn(*fake_args, **fake_kwargs)
    return tree.map(lambda x: ShapeDtypeStruct.like(x) if isinstance(x, torch.Tensor) else x, out)


def _describe(x: Any) -> Any:
    """``ShapeDtypeStruct.like(x)`` for tensors (building its mesh's communicators now), else ``x``."""
    if not isinstance(x, (torch.Tensor, ShapeDtypeStruct)):
        return x
    s = ShapeDtypeStruct.like(x)
    if s.sharding is not None:
        _ = s.sharding.mesh.device_mesh  # its communicators, built now
    return s


def empty(s: ShapeDtypeStruct) -> torch.Tensor:
    """An uninitialised tensor as ``s`` describes: plain, or a DTensor holding this rank's shard.

    Inside ``FakeTensorMode`` the result is fake (no memory). Call it on every rank of the mesh.

    Example::

        >>> buf = vsf.abstract.empty(vsf.ShapeDtypeStruct((8, 4), torch.float32, sharding))
    """
    if s.sharding is None:
        return torch.empty(s.shape, dtype=s.dtype)
    mesh = s.sharding.mesh
    device = local_device(mesh.device_type)
    rank = runtime.rank() if runtime.rank() in mesh.devices else mesh.devices[0]
    local = torch.empty(s.sharding.shard_shape(s.shape, rank), dtype=s.dtype, device=device)
    full = torch.empty(s.shape, dtype=s.dtype, device="meta")
    return DTensor.from_local(
        local, mesh.device_mesh, s.sharding.placements, run_check=False, shape=full.shape, stride=full.stride()
    )
