"""Threads whose torch ops run single-threaded, sharing out the chunks of an eager fill.

An eager fill (:func:`vsf.random.bits.fill`) is about a hundred elementwise ops per chunk of 64K
counters. On the calling thread each is an OpenMP parallel region of torch's intra-op threads,
whose threads spin at its barrier waiting for each other: on a machine busier than its cores
(measured on 2 CPUs at load ~8-12) one descheduled thread holds up every region, and a 20M-sample
``normal`` took 17-119 s against 0.4-0.9 s for ``torch.randn`` (with ``OMP_WAIT_POLICY=passive``
1.1-1.5 s; with one intra-op thread 0.9-5 s). Here each worker thread sets its own OpenMP thread
count to 1 (OpenMP keeps it per thread), so its ops are plain loops with no barrier, and the
workers take whole chunks from a shared queue: a descheduled worker delays only its own chunk.
A fill uses ``torch.get_num_threads()`` workers (as many as torch's own ops would), so a
many-core machine spreads the chunks over all of them.

``torch.set_num_threads(1)`` on a worker also sets the count that threads started later begin
with (a process-wide value); the thread that starts the workers sets it back to its own count
once they are up, so nothing outside the workers changes. After a ``fork`` the child starts its
own workers (the parent's do not exist there).

Example::

    >>> squares = [0] * 8
    >>> def work(take):
    ...     for i in take:
    ...         squares[i] = i * i
    >>> run(work, range(8), threads=2)
    >>> squares[:4]
    [0, 1, 4, 9]
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

__all__ = ["run"]

T = TypeVar("T")
_Job = tuple[Callable[[], None], "_Done"]


class _Done:
    """Where a job reports back: an event, and the exception it raised, if any."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None


class _Shared(Iterator[T]):
    """An iterator several threads take from (each item goes to exactly one of them)."""

    def __init__(self, items: Iterable[T]) -> None:
        self._items = iter(items)
        self._lock = threading.Lock()

    def __next__(self) -> T:
        with self._lock:
            return next(self._items)


class _Pool:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.size = 0
        self.lock = threading.Lock()

    def grow(self, threads: int) -> None:
        """Start workers until there are ``threads``; back on the caller's thread, set the
        process-wide thread count back to the caller's."""
        with self.lock:
            if self.size >= threads:
                return
            mine = torch.get_num_threads()
            ready = threading.Barrier(threads - self.size + 1)
            for i in range(self.size, threads):
                threading.Thread(target=_serve, args=(self.jobs, ready), name=f"vsf-random-{i}", daemon=True).start()
            ready.wait()
            torch.set_num_threads(mine)
            self.size = threads


def _serve(jobs: queue.SimpleQueue[_Job], ready: threading.Barrier) -> None:
    torch.get_num_threads()  # torch sets a thread's count on its first use: first, so that it cannot undo the next line
    torch.set_num_threads(1)
    ready.wait()
    while True:
        job, done = jobs.get()
        try:
            job()
        except BaseException as e:  # handed to the caller, which raises it
            done.error = e
        finally:
            done.event.set()


_pool = _Pool()


def _after_fork() -> None:
    global _pool
    _pool = _Pool()


os.register_at_fork(after_in_child=_after_fork)


def run(work: Callable[[Iterator[T]], None], items: Iterable[T], threads: int) -> None:
    """``work(take)`` on ``threads`` workers at once, each taking items from one shared
    iterator ``take`` over ``items`` until none are left; returns when all are done and raises
    the first exception one of them raised. The workers run with the caller's inference mode.

    Example::

        >>> out = torch.empty(6)
        >>> def work(take):
        ...     for i in take:
        ...         out[i] = i
        >>> run(work, range(6), threads=3)
        >>> out.tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    _pool.grow(threads)
    take, inference = _Shared(items), torch.is_inference_mode_enabled()

    def job() -> None:
        with torch.inference_mode(inference):
            work(take)

    dones = [_Done() for _ in range(threads)]
    for done in dones:
        _pool.jobs.put((job, done))
    for done in dones:
        done.event.wait()
    for done in dones:
        if done.error is not None:
            raise done.error
