"""The peak of heap memory one call uses, measured: for the real-process memory tests and the
benchmarks' memory rows.

Example::

    >>> peak_heap_bytes(lambda: torch.ones(2**20)) >= 4 * 2**20   # the tensor's buffer
    True
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (f, ctypes.c_size_t)
        for f in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _in_use() -> Callable[[], int]:
    """A reader of the heap bytes in use now: glibc's ``mallinfo2`` (every thread's allocations),
    heap chunks in use plus mmapped chunks (large tensors)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError) as e:
        raise RuntimeError(
            f"the peak-memory reading needs glibc 2.33+ (mallinfo2, Linux); this C library has none: {e}"
        ) from e
    mallinfo2.restype = _MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


def peak_heap_bytes(step: Callable[[], object]) -> int:
    """The peak of heap bytes in use during one call of ``step`` beyond those in use before it,
    read after each aten op ``step`` dispatches. Not the profiler's memory events: they drop a
    free made on another thread (gloo's worker threads free a finished collective's buffers)."""
    in_use = _in_use()

    class Sampler(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.peak = in_use()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, in_use())
            return out

    start = in_use()
    with Sampler() as sampler:
        step()
    return sampler.peak - start
