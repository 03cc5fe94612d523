"""Simulated steps recorded once and replayed as plain tensor code.

Under :func:`vsf.simulate` a jitted step runs its plan (:func:`vsf.jit.lower.execute`) on
``LocalTensor`` s: ``LocalTensorMode`` runs every op once per simulated rank and computes each
collective from all ranks' buffers, at a cost of Python bookkeeping per op (flattening its
arguments, per-rank RNG states, wrapping the results) many times that of the op itself.

The program a plan lowers to does not depend on the values it computes (a real run traces it once
with ``make_fx`` and reuses the trace), so :class:`Replayed` records the second call (a program called once is not worth it): a dispatch
mode just below ``LocalTensorMode`` sees every plain op it runs, one rank's tensors at a time, the
collectives' own arithmetic on the ranks' buffers included, and writes those that compute from
the ranks' input shards into a :class:`Program` (the ops in order, over slots of values). Later
calls with inputs laid out alike run that program with no mode on the dispatch stack: the same ops in the same order on the same values, so the same bits. A program the
record cannot replay faithfully (it draws random numbers, which an attention kernel without
dropout does not; it reads a computed value into Python, or needs autograd) keeps running under
``LocalTensorMode``; :attr:`Replayed.why_not` says why. So does a call made while another
dispatch mode watches the ops (``CommDebugMode`` counting collectives): it sees the program's
collectives, which a replay computes as plain arithmetic.

Example::

    >>> program = Replayed(lambda xs: execute(plan, xs))
    >>> outs = program(local_inputs)      # first call: runs under LocalTensorMode
    >>> outs = program(local_inputs)      # second call: the same, recorded
    >>> outs = program(local_inputs)      # later calls: the recorded plain ops
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vsf import _compat
from vsf.jit.classify import draws_random

__all__ = ["Program", "Replayed"]

_Signature = tuple[Any, ...]


class Replayed:
    """``run`` (a function of a list of local tensors, ``LocalTensor`` s under simulation, returning
    such a list), recorded on its second call with inputs laid out alike (shapes, strides, dtypes,
    aliasing: a program called once is not worth the recording) and replayed as plain tensor code
    on the calls after it."""

    def __init__(self, run: Callable[[list[torch.Tensor]], list[torch.Tensor]]) -> None:
        self.run = run
        self.program: Program | None = None
        self.why_not: str | None = None
        self._signature: tuple[tuple[int, ...], _Signature] | None = None  # of the last call: its ranks and inputs
        self._outputs: list[bool] = []  # per output: a LocalTensor (one value per rank) or a plain tensor

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        mode = _compat.active_local_mode()
        if mode is None or self.why_not is not None or _needs_autograd(inputs) or _compat.other_dispatch_modes():
            return self.run(list(inputs))
        ranks = sorted(mode.ranks)
        flat = _flat_inputs(inputs, ranks)
        signature = (tuple(ranks), _signature_of(flat))
        if signature != self._signature:  # a program run once is not worth recording: the second call records
            self._signature, self.program = signature, None
            return self.run(list(inputs))
        if self.program is None:
            return self._record(inputs, flat, ranks)
        with _compat.dispatch_modes_off():
            out = iter(self.program(flat))
            return [
                _compat.make_local({r: next(out) for r in ranks}) if local else next(out) for local in self._outputs
            ]

    def _record(self, inputs: Sequence[torch.Tensor], flat: list[torch.Tensor], ranks: list[int]) -> list[torch.Tensor]:
        recorder = _Recorder(flat)
        with _compat.below_local_mode(recorder):
            outs = self.run(list(inputs))
        if recorder.why_not is None and _needs_autograd(outs):
            recorder.why_not = "its results need autograd"
        if recorder.why_not is not None:
            self.why_not, self.program = recorder.why_not, None
            return outs
        self.program = recorder.finish([t for o in outs for t in _rank_values(o, ranks)])
        self._outputs = [_compat.is_local_tensor(o) for o in outs]
        return outs


def _needs_autograd(ts: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _rank_values(t: torch.Tensor, ranks: list[int]) -> list[torch.Tensor]:
    """Every rank's value of ``t`` (one value for a plain tensor, which every rank shares)."""
    if not _compat.is_local_tensor(t):
        return [t]
    shards = _compat.local_shards(t, ranks[0])
    return [shards[r] for r in ranks]


def _flat_inputs(inputs: Sequence[torch.Tensor], ranks: list[int]) -> list[torch.Tensor]:
    return [v for t in inputs for v in _rank_values(t, ranks)]


def _signature_of(flat: list[torch.Tensor]) -> _Signature:
    """What the recorded program assumed of its inputs: each tensor's layout and which earlier
    input (if any) shares its storage (an op's output layout follows its inputs')."""
    storages: dict[int, int] = {}
    out = []
    for i, t in enumerate(flat):
        ptr = t.untyped_storage().data_ptr()
        out.append(
            (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, storages.setdefault(ptr, i) if ptr else i)
        )
    return tuple(out)


def _real(out: Any) -> bool:
    """Does an op's result hold plain tensors with memory (not fake or meta ones, which only
    planning code makes)?"""
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    return bool(outs) and all(type(o) in _PLAIN and o.device.type != "meta" for o in outs)


def _is_metadata(func: Any) -> bool:
    """Does ``func`` read only a tensor's layout (``sym_size``, ``sym_stride``, ``is_contiguous`` ...)?"""
    name = getattr(func, "__name__", "").split(".")[0]
    return name.startswith("sym_") or name in _LAYOUT_QUERIES


_LAYOUT_QUERIES = frozenset(
    {
        "dim",
        "size",
        "stride",
        "storage_offset",
        "numel",
        "is_contiguous",
        "is_strides_like_format",
        "is_non_overlapping_and_dense",
    }
)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Slot(int):
    """An argument of a recorded op: the value in this slot of the program's environment."""


@dataclasses.dataclass
class Program:
    """A recorded program: ops over an environment of slots. The inputs fill the first slots,
    the constants theirs; each op reads its tensor arguments from slots and writes its tensor
    results to slots, and a value's slot is emptied after the op that reads it last.

    Example::

        >>> outs = program(inputs)      # plain tensors in, plain tensors out
    """

    n_inputs: int
    constants: dict[int, torch.Tensor]
    ops: list[
        tuple[Any, tuple[Any, ...], dict[str, Any], Any, tuple[int, ...]]
    ]  # (func, args, kwargs, result slots, slots to empty)
    outputs: list[int]
    size: int

    def __len__(self) -> int:
        return len(self.ops)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        env: list[Any] = [*inputs, *[None] * (self.size - self.n_inputs)]
        for i, c in self.constants.items():
            env[i] = c
        for func, args, kwargs, out, done in self.ops:
            result = func(*[_read(a, env) for a in args], **{k: _read(v, env) for k, v in kwargs.items()})
            if type(out) is _Slot:
                env[out] = result
            else:
                for i, slot in out:
                    env[slot] = result[i]
            for i in done:
                env[i] = None
        return [env[i] for i in self.outputs]


def _read(a: Any, env: list[Any]) -> Any:
    if type(a) is _Slot:
        return env[a]
    if type(a) is list:
        return [env[x] if type(x) is _Slot else x for x in a]
    return a


class _Recorder(_compat.dispatch_mode_base()):  # type: ignore[misc]
    """A dispatch mode that writes every plain op computing from ``inputs`` into a :class:`Program`.

    Tensors are known by identity (weakly: a freed tensor's id may come back). A factory's result
    is the program's (each replay makes it anew); an op whose tensors are all neither inputs nor
    made by the program (a copy of an RNG state, a mesh's bookkeeping) is not written: its result,
    where the program uses it, is a constant of the program. ``why_not`` is set at the first op
    that a replay would not reproduce."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.why_not: str | None = None
        self._slots: dict[int, tuple[weakref.ref[torch.Tensor], _Slot]] = {}
        self._constants: dict[int, tuple[torch.Tensor, _Slot]] = {}
        self._ops: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []
        self._size = len(inputs)
        for i, t in reversed(
            list(enumerate(inputs))
        ):  # (an input given twice is read from its first slot: the signature checks it)
            self._slots[id(t)] = (weakref.ref(t), _Slot(i))
        self._n_inputs = len(inputs)

    def _new(self) -> _Slot:
        self._size += 1
        return _Slot(self._size - 1)

    def _slot(self, t: torch.Tensor) -> _Slot | None:
        known = self._slots.get(id(t))
        return known[1] if known is not None and known[0]() is t else None

    def _arg(self, t: torch.Tensor) -> _Slot:
        slot = self._slot(t)
        if slot is not None:
            return slot
        if id(t) not in self._constants:  # held, so that its id stays its own
            self._constants[id(t)] = (t, self._new())
        return self._constants[id(t)][1]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        tensors = list(_tensors(args, kwargs))
        if any(isinstance(t, DTensor) or _compat.is_local_tensor(t) for t in tensors):
            return NotImplemented  # the subclass runs it; the plain ops it runs come back here
        out = func(*args, **kwargs)
        if self.why_not is None:
            self.why_not = self._write(func, args, kwargs, tensors, out)
        return out

    def _write(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor], out: Any
    ) -> str | None:
        """Write ``func``'s call into the program if it computes from the inputs; why not, if a
        replay would not reproduce it."""
        if draws_random(func, args, kwargs):
            return f"it draws random numbers ({func})"
        schema = _compat.op_schema(func)
        written = list(_written(schema, args, kwargs)) if schema is not None and schema.is_mutable else []
        if any(id(w) in self._constants for w in written):
            return f"it writes a constant of the program ({func})"
        if not any(self._slot(t) is not None for t in tensors) and (tensors or not _real(out)):
            return None  # computes from constants only (or makes a fake or meta tensor): where the program uses its result, a constant
        if any(self._slot(w) is None for w in written):
            return f"it writes a tensor the program did not make ({func})"
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if any(isinstance(o, (bool, int, float, complex)) for o in outs):
            return None if _is_metadata(func) else f"its Python code reads a computed value ({func})"
        if any(type(t) not in _PLAIN for t in tensors):
            return f"it runs {func} on a {next(type(t).__name__ for t in tensors if type(t) not in _PLAIN)}"
        call_args, call_kwargs = _map_args(args, self._arg), {k: _map_arg(v, self._arg) for k, v in kwargs.items()}
        if isinstance(out, torch.Tensor):
            slot: Any = self._new()
            self._slots[id(out)] = (weakref.ref(out), slot)
        else:
            slot = []
            for i, o in enumerate(outs):
                if isinstance(o, torch.Tensor):
                    slot.append((i, self._new()))
                    self._slots[id(o)] = (weakref.ref(o), slot[-1][1])
        self._ops.append((func, call_args, call_kwargs, slot))
        return None

    def finish(self, outputs: list[torch.Tensor]) -> Program:
        """The recorded program, returning ``outputs`` (flat, every rank's values in turn), without
        the ops whose results nothing reads (an op that writes its arguments is kept)."""
        wanted = [self._arg(t) for t in outputs]
        live = set(wanted)
        ops = []
        for func, args, kwargs, out in reversed(self._ops):
            written = [s for _, s in out] if type(out) is list else [out]
            schema = _compat.op_schema(func)
            if not live.intersection(written) and not (schema is not None and schema.is_mutable):
                continue
            reads = [x for a in (*args, *kwargs.values()) for x in (a if type(a) is list else [a]) if type(x) is _Slot]
            done = tuple(sorted({x for x in reads if x not in live and x not in wanted}))
            live.update(reads)
            ops.append((func, args, kwargs, out, done))
        ops.reverse()
        constants = {slot: t for t, slot in self._constants.values() if slot in live}
        return Program(self._n_inputs, constants, ops, wanted, self._size)


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among an aten op's arguments (a ``Tensor[]`` argument's too)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _map_arg(a: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(a, torch.Tensor):
        return fn(a)
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        return [fn(x) if isinstance(x, torch.Tensor) else x for x in a]
    if isinstance(a, list):
        return tuple(a)  # (a program's list arguments hold slots; a shape list is passed as a tuple)
    return a


def _map_args(args: tuple[Any, ...], fn: Callable[[torch.Tensor], Any]) -> tuple[Any, ...]:
    return tuple(_map_arg(a, fn) for a in args)


def _written(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors an op call writes (its mutable arguments)."""
    for i, s in enumerate(schema.arguments):
        if s.alias_info is not None and s.alias_info.is_write:
            a = args[i] if i < len(args) else kwargs.get(s.name)
            if isinstance(a, torch.Tensor):
                yield a
            elif isinstance(a, (list, tuple)):
                yield from (x for x in a if isinstance(x, torch.Tensor))
