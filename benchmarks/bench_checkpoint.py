"""vsf.checkpoint against calling DCP directly on the same flattened state dict.

Rows (``ratio = ref_s / vsf_s``, so higher is better; targets in brackets):

* ``checkpoint save``  — ``vsf.checkpoint.save`` vs ``dcp.save`` of the same flat dict [>= 0.9];
* ``checkpoint load``  — ``vsf.checkpoint.load`` (checksums verified) vs ``dcp.load`` into fresh
  tensors allocated the same way [>= 0.9];
* ``async save block`` — how long ``save(blocking=False)`` blocks the caller vs a blocking save
  [>= 5, i.e. blocks for <= 20% of a blocking save].

One process, plain CPU tensors, files under ``--dir`` (default: a temporary directory); the
median of several alternating runs. Run: ``python -m benchmarks.bench_checkpoint [--quick]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import vsf
from vsf.checkpoint import leaves

__all__ = ["run"]

TARGETS = {"checkpoint save": 0.9, "checkpoint load": 0.9, "async save block": 5.0}   # ratio >= target


def _tree(total_bytes: int) -> dict:
    """A model-like tree: a few large matrices, many small vectors, a step counter."""
    big = total_bytes // 8 // 4  # 8 float32 matrices hold nearly everything
    return {
        "params": {f"layer{i}": {"w": torch.randn(big // 1024, 1024), "b": torch.randn(1024)} for i in range(8)},
        "step": 1000,
    }


def _median_pair(vsf_fn: Callable[[Path], float], ref_fn: Callable[[Path], float], root: Path, repeats: int) -> tuple[float, float]:
    vsf_times, ref_times = [], []
    for i in range(repeats):
        for fn, times, name in ((vsf_fn, vsf_times, "vsf"), (ref_fn, ref_times, "ref"))[:: 1 if i % 2 == 0 else -1]:
            times.append(fn(root / f"{name}{i}"))
    return statistics.median(vsf_times), statistics.median(ref_times)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(quick: bool = False, directory: str | None = None) -> list[dict]:
    """Measure and return rows of the suite's table (see ``benchmarks``), ``ratio = ref / vsf``."""
    total = (64 if quick else 512) << 20
    repeats = 3 if quick else 5
    tree = _tree(total)
    _, _, state = leaves.flatten(tree)  # the flat dict vsf hands to DCP
    target = vsf.tree.map(lambda x: vsf.ShapeDtypeStruct.like(x) if isinstance(x, torch.Tensor) else x, tree)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=directory))
    try:
        rows = []
        save_vsf, save_ref = _median_pair(
            lambda p: _timed(lambda: vsf.checkpoint.save(p / "c", tree)),
            lambda p: _timed(lambda: dcp.save(state, checkpoint_id=p / "c")),
            root / "save", repeats,
        )
        rows.append(_row("checkpoint save", save_vsf, save_ref))
        vsf.checkpoint.save(root / "vsf", tree)
        dcp.save(state, checkpoint_id=root / "ref")

        def dcp_load() -> None:
            fresh = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in state.items()}
            dcp.load(fresh, checkpoint_id=root / "ref")

        load_vsf, load_ref = _median_pair(
            lambda _: _timed(lambda: vsf.checkpoint.load(root / "vsf", target)), lambda _: _timed(dcp_load), root / "load", repeats
        )
        rows.append(_row("checkpoint load", load_vsf, load_ref))

        def async_block(p: Path) -> float:
            start = time.perf_counter()
            handle = vsf.checkpoint.save(p / "c", tree, blocking=False)
            blocked = time.perf_counter() - start
            handle.wait()
            return blocked

        block_async, block_sync = _median_pair(async_block, lambda p: _timed(lambda: vsf.checkpoint.save(p / "c", tree)), root / "async", repeats)
        rows.append(_row("async save block", block_async, block_sync))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _row(name: str, vsf_s: float, ref_s: float) -> dict:
    ratio = ref_s / vsf_s
    return {"name": name, "vsf": vsf_s, "ref": ref_s, "unit": "s", "ratio": ratio, "target": f">= {TARGETS[name]}", "met": ratio >= TARGETS[name]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MB instead of 512 MB, fewer repeats")
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary directory)")
    args = parser.parse_args()
    print(f"{'name':<18} {'vsf_s':>8} {'ref_s':>8} {'ratio':>7}  target")
    for r in run(args.quick, args.dir):
        print(f"{r['name']:<18} {r['vsf']:8.3f} {r['ref']:8.3f} {r['ratio']:7.2f}  {r['target']}")


if __name__ == "__main__":
    main()
