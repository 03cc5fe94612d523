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

Measured 2026-12-01 on the shared 2-CPU machine, ``OMP_NUM_THREADS=1``, 100M: eager 2.49
(3.39 s vs 1.36 s), compiled 1.42 (2.45 s vs 1.72 s) at load average 7-9; the code before this
change, run right before at load 10-11, gave 4.52 and 2.56 (README: 3.34 and 2.38 at load 6.2);
a later run at load 8-9 gave 2.75 and 1.66.
The eager floor is Philox's ~94 int64 ops per chunk (~30 ns a counter here, 70% of the time)
plus ``erfinv`` (~2 ns a sample). Run::

    python -m benchmarks.bench_random [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import vsf

TARGET = 2.0


def _median(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_normal(n: int, reps: int, compiled: bool) -> dict:
    key = vsf.random.key(0)
    vsf.config.compile_random = compiled
    start = time.perf_counter()
    vsf.random.normal(key, (n // 100,))  # warm-up (and the one-off compile)
    warm = time.perf_counter() - start
    torch.randn(n // 100)
    ours, theirs = [], []
    for _ in range(reps):  # interleaved, so both see the same machine load
        ours.append(_median(lambda: vsf.random.normal(key, (n,)), 1))
        theirs.append(_median(lambda: torch.randn(n), 1))
    vsf.config.compile_random = False
    vsf_t, ref_t = statistics.median(ours), statistics.median(theirs)
    ratio = vsf_t / ref_t
    how = f"compile_random (compiled once in {warm:.0f} s)" if compiled else "eager"
    return {"name": f"normal, {n / 1e6:.0f}M float32 vs torch.randn, {how}", "vsf": vsf_t, "ref": ref_t, "unit": "s", "ratio": ratio, "target": f"<= {TARGET}", "met": ratio <= TARGET}


def run(quick: bool) -> list[dict]:
    """Rows of the suite's table (see ``benchmarks``); ``ref``: ``torch.randn`` of the same size."""
    n, reps = (4_000_000, 3) if quick else (100_000_000, 5)
    return [bench_normal(n, reps, compiled=False), bench_normal(n, reps, compiled=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4M samples instead of 100M")
    args = parser.parse_args()
    for row in run(args.quick):
        print(f"{row['name']}: vsf {row['vsf']:.3f} s, torch {row['ref']:.3f} s, ratio {row['ratio']:.2f} (target {row['target']})")


if __name__ == "__main__":
    main()
