"""``vsf.random.normal`` vs ``torch.randn`` on one process: the cost of sharding-invariant bits.

Both draw the same number of float32 normals (100M; 4M with ``--quick``) into a plain tensor,
interleaved in the same run after a warm-up; the time is the median over repetitions. vsf's
draw is Philox-4x32-10 in int64 tensor ops (four samples per counter, chunks of 64K counters),
then ``sqrt(2) * erfinv(u)``; torch's is its CPU generator's own kernel. Eagerly, each chunk's
rounds run in place on six buffers kept for the whole draw and write the words straight into
element order, so a chunk allocates one temporary (fresh memory cost as much as the ops, more
under load); with ``vsf.config.compile_random`` the Philox chunk and its interleaving are one
``torch.compile`` d kernel writing into a kept buffer (compiled before timing), and the float
steps run eagerly as before (so both give the same bits). A ratio above 1 means vsf is slower.

Each row runs both sides at one ``torch.set_num_threads`` count: torch's, then 1. vsf's eager
chunks go to that many worker threads (:mod:`vsf.random.workers`); ``torch.randn``'s CPU kernel
is serial (one generator state) at any count. "cores busy" is the process's CPU time over the
wall time: 1.0 is one core kept busy, less means the machine's load took the rest.

Measured 2026-12-01 on the shared 2-CPU machine, 100M, load average 3-5: at 2 threads eager
2.65 (3.43 s vs 1.30 s) and compiled 1.38 with 0.4 cores busy on both sides (the machine was
full: the workers had no second core to use); at 1 thread eager 2.10 (1.02 s vs 0.49 s),
compiled 1.20, one core busy each. In earlier runs the same day at 1 thread eager measured
1.90-2.75, compiled 1.20-1.56, and at 2 threads with 1.7 cores busy compiled 0.80. The eager
floor is Philox's ~94 int64 ops per chunk (~65% of a chunk's time) plus ``erfinv`` (~25%).
Run::

    python -m benchmarks.bench_random [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import vsf

TARGET = 2.0


def _timed(fn) -> tuple[float, float]:
    """``fn()``'s wall time and the CPU time of the whole process meanwhile (every thread's)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench_normal(n: int, reps: int, compiled: bool, threads: int) -> dict:
    """One row: ``vsf.random.normal`` and ``torch.randn`` of ``n`` float32, interleaved, with
    ``torch.set_num_threads(threads)`` for both (put back after)."""
    key = vsf.random.key(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    vsf.config.compile_random = compiled
    try:
        start = time.perf_counter()
        vsf.random.normal(key, (n // 100,))  # warm-up (and the one-off compile)
        warm = time.perf_counter() - start
        torch.randn(n // 100)
        ours, theirs = [], []
        for _ in range(reps):  # interleaved, so both see the same machine load
            ours.append(_timed(lambda: vsf.random.normal(key, (n,))))
            theirs.append(_timed(lambda: torch.randn(n)))
    finally:
        vsf.config.compile_random = False
        torch.set_num_threads(before)
    (vsf_t, vsf_cpu), (ref_t, ref_cpu) = ([statistics.median(x) for x in zip(*times)] for times in (ours, theirs))
    ratio = vsf_t / ref_t
    how = f"compile_random (compiled once in {warm:.0f} s)" if compiled else "eager"
    cores = f"{threads} thread{'s' if threads > 1 else ''}, cores busy vsf {vsf_cpu / vsf_t:.1f} / torch {ref_cpu / ref_t:.1f}"
    return {
        "name": f"normal, {n / 1e6:.0f}M float32 vs torch.randn, {how}, {cores}",
        "vsf": vsf_t,
        "ref": ref_t,
        "unit": "s",
        "ratio": ratio,
        "target": f"<= {TARGET}",
        "met": ratio <= TARGET,
    }


def run(quick: bool) -> list[dict]:
    """Rows of the suite's table (see ``benchmarks``); ``ref``: ``torch.randn`` of the same size.
    Eager and compiled, at torch's thread count and at one thread."""
    n, reps = (4_000_000, 3) if quick else (100_000_000, 5)
    counts = sorted({torch.get_num_threads(), 1}, reverse=True)
    return [bench_normal(n, reps, compiled, threads) for threads in counts for compiled in (False, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4M samples instead of 100M")
    args = parser.parse_args()
    print(f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    for row in run(args.quick):
        print(
            f"{row['name']}: vsf {row['vsf']:.3f} s, torch {row['ref']:.3f} s, ratio {row['ratio']:.2f} (target {row['target']})"
        )
    print(f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
