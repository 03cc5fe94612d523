"""vsf.checkpoint against calling DCP directly on the same flattened state dict, and its checksum against zlib's.

Rows (``ratio = ref_s / vsf_s``, so higher is better; targets in brackets):

* ``checkpoint save``  — ``vsf.checkpoint.save`` vs ``dcp.save`` of the same flat dict [>= 0.9];
* ``checkpoint load``  — ``vsf.checkpoint.load`` (every block checked) vs ``dcp.load`` into
  fresh tensors allocated the same way [>= 0.9];
* ``async save block`` — how long ``save(blocking=False)`` blocks the caller vs a blocking save
  [>= 5, i.e. blocks for <= 20% of a blocking save];
* ``checksum vs crc32`` / ``checksum vs adler32`` — :func:`vsf.checkpoint.checksum.checksums`
  vs ``zlib.crc32`` / ``zlib.adler32`` over the same 1 MiB blocks of the tree's bytes, in this
  thread [informative: why the file format uses it];
* ``hf load RSS growth`` — ``vsf.checkpoint.load`` of a Hugging Face safetensors directory (the
  tree's params written by ``vsf.checkpoint.save_hf`` in 4 files) into shards over every rank of
  :data:`HF_PROCS` real gloo processes: the most any process's resident memory grew while loading
  (sampled every 2 ms) against the whole checkpoint's size [``ref / vsf >= 0.75 * HF_PROCS``: a
  process holds its share, not the whole, plus about two slices in flight in safetensors' reader].

One process, plain CPU tensors, files under ``--dir`` (default: a temporary directory). Each
pair of calls runs back to back, in alternating order; a row's times are medians and its ratio
is the median of the per-pair ratios, which drifts less with the load of a shared machine. The
``cpu`` column is the same ratio of the CPU time this process used (all its threads): on a
machine whose cores other processes keep busy, wall times stretch by however much CPU the
scheduler grants, and the CPU ratio is the steadier measure of the work each side does. The
load average is printed before and after. Run: ``python -m benchmarks.bench_checkpoint [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import vsf
from vsf import P, launch
from vsf.checkpoint import leaves
from vsf.checkpoint.checksum import BLOCK, checksums

__all__ = ["run"]

HF_PROCS = 2
TARGETS = {
    "checkpoint save": 0.9,
    "checkpoint load": 0.9,
    "async save block": 5.0,
    "checksum vs crc32": None,
    "checksum vs adler32": None,
    "hf load RSS growth": 0.75 * HF_PROCS,
}  # ratio >= target


def _shapes(total_bytes: int) -> dict:
    """The params' shapes: 8 float32 matrices holding nearly everything, and 8 vectors."""
    big = total_bytes // 8 // 4
    return {f"layer{i}": {"w": (big // 1024, 1024), "b": (1024,)} for i in range(8)}


def _tree(total_bytes: int) -> dict:
    """A model-like tree: a few large matrices, many small vectors, a step counter."""
    return {
        "params": vsf.tree.map(lambda s: torch.randn(s), _shapes(total_bytes), is_leaf=lambda x: isinstance(x, tuple)),
        "step": 1000,
    }


Timing = tuple[float, float]  # (wall seconds, CPU seconds of this process, all threads)


def _pairs(
    name: str, vsf_fn: Callable[[Path], Timing], ref_fn: Callable[[Path], Timing], root: Path, repeats: int
) -> dict:
    """A row from ``repeats`` back-to-back pairs of timed calls, alternating which goes first."""
    vsf_t: list[Timing] = []
    ref_t: list[Timing] = []
    for i in range(repeats):
        for fn, times, tag in ((vsf_fn, vsf_t, "vsf"), (ref_fn, ref_t, "ref"))[:: 1 if i % 2 == 0 else -1]:
            times.append(fn(root / f"{name.replace(' ', '_')}_{tag}{i}"))
    ratio, target = statistics.median(r[0] / v[0] for v, r in zip(vsf_t, ref_t)), TARGETS[name]
    return {
        "name": name,
        "vsf": statistics.median(w for w, _ in vsf_t),
        "ref": statistics.median(w for w, _ in ref_t),
        "unit": "s",
        "ratio": ratio,
        "cpu_ratio": statistics.median(r[1] / v[1] for v, r in zip(vsf_t, ref_t)),
        "target": "none set" if target is None else f">= {target}",
        "met": None if target is None else ratio >= target,
    }


def _timed(fn: Callable[[], object]) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def run(quick: bool = False, directory: str | None = None) -> list[dict]:
    """Measure and return rows of the suite's table (see ``benchmarks``), ``ratio = ref / vsf``,
    plus ``cpu_ratio``."""
    total = (64 if quick else 512) << 20
    repeats = 3 if quick else 7
    tree = _tree(total)
    _, _, state = leaves.flatten(tree)  # the flat dict vsf hands to DCP
    target = vsf.tree.map(lambda x: vsf.ShapeDtypeStruct.like(x) if isinstance(x, torch.Tensor) else x, tree)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=directory))
    try:
        rows = [
            _pairs(
                "checkpoint save",
                lambda p: _timed(lambda: vsf.checkpoint.save(p, tree)),
                lambda p: _timed(lambda: dcp.save(state, checkpoint_id=p)),
                root,
                repeats,
            )
        ]
        vsf.checkpoint.save(root / "vsf", tree)
        dcp.save(state, checkpoint_id=root / "ref")

        def dcp_load() -> None:
            fresh = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in state.items()}
            dcp.load(fresh, checkpoint_id=root / "ref")

        rows.append(
            _pairs(
                "checkpoint load",
                lambda _: _timed(lambda: vsf.checkpoint.load(root / "vsf", target)),
                lambda _: _timed(dcp_load),
                root,
                repeats,
            )
        )

        def async_block(p: Path) -> Timing:
            wall, cpu = time.perf_counter(), time.process_time()
            handle = vsf.checkpoint.save(p, tree, blocking=False)
            blocked = time.perf_counter() - wall, time.process_time() - cpu  # (the writer thread's CPU too)
            handle.wait()
            return blocked

        rows.append(
            _pairs(
                "async save block", async_block, lambda p: _timed(lambda: vsf.checkpoint.save(p, tree)), root, repeats
            )
        )
        data = memoryview(torch.cat([x.reshape(-1).view(torch.uint8) for x in state.values()]).numpy())
        blocks = [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]
        for name, zlib_sum in (("checksum vs crc32", zlib.crc32), ("checksum vs adler32", zlib.adler32)):
            rows.append(
                _pairs(
                    name,
                    lambda _: _timed(lambda: [checksums(b) for b in blocks]),
                    lambda _, f=zlib_sum: _timed(lambda: [f(b) for b in blocks]),
                    root,
                    repeats,
                )
            )
        del data, blocks, state
        vsf.checkpoint.save_hf(root / "hf", tree["params"], max_shard_bytes=total // 4)
        rows.append(_hf_memory(root / "hf", total, quick))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _rss() -> int:
    """This process's resident bytes (anonymous and file-backed)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hf_memory(directory: Path, total: int, quick: bool) -> dict:
    """The ``hf load RSS growth`` row: :func:`_hf_worker` on :data:`HF_PROCS` processes."""
    out = directory.parent / "rss"
    out.mkdir()
    launch.run(
        Path(__file__).resolve(),
        HF_PROCS,
        "--hf-worker",
        str(directory),
        str(out),
        *(["--quick"] if quick else []),
        timeout=1800,
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(HF_PROCS)]
    grew = max(r["peak"] - r["before"] for r in ranks)
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    target = TARGETS["hf load RSS growth"]
    return {
        "name": "hf load RSS growth",
        "vsf": grew,
        "ref": size,
        "unit": "B",
        "ratio": size / grew,
        "cpu_ratio": float("nan"),
        "target": f">= {target:g} ({HF_PROCS} procs)",
        "met": size / grew >= target,
        "ranks": ranks,
    }


def _hf_worker(directory: str, out: str, quick: bool) -> None:
    """One of :data:`HF_PROCS` ranks: load the checkpoint split over every rank, sampling this
    process's resident memory, and write ``{before, peak, after, held}`` (bytes) for its rank
    (after loading one small tensor first: what the first load runs once is not the load's)."""
    total = (64 if quick else 512) << 20
    mesh = vsf.make_mesh((HF_PROCS,), ("fsdp",))
    target = vsf.tree.map(
        lambda s: vsf.ShapeDtypeStruct(s, torch.float32, vsf.NamedSharding(mesh, P("fsdp"))),
        _shapes(total),
        is_leaf=lambda x: isinstance(x, tuple),
    )
    vsf.checkpoint.load(
        directory, {"layer0": {"b": target["layer0"]["b"]}}
    )  # code run once (imports, DTensor's caches) is not the load's
    gc.collect()
    before = peak = _rss()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.002):
            peak = max(peak, _rss())

    sampler = threading.Thread(target=sample)
    sampler.start()
    params = vsf.checkpoint.load(directory, target)
    done.set()
    sampler.join()
    after = _rss()
    held = sum(x.to_local().nbytes for x in vsf.tree.leaves(params))
    rank = vsf.runtime.rank()
    Path(out, f"rank{rank}.json").write_text(
        json.dumps({"before": before, "peak": max(peak, after), "after": after, "held": held})
    )


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MB instead of 512 MB, fewer repeats")
    parser.add_argument("--dir", default=None, help="where to write (default: the system's temporary directory)")
    parser.add_argument("--hf-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        _hf_worker(*args.hf_worker, args.quick)
        return
    print(f"before: {_load()}")
    rows = run(args.quick, args.dir)
    print(f"after:  {_load()}")
    print(f"{'name':<20} {'vsf_s':>8} {'ref_s':>8} {'ratio':>7} {'cpu':>6}  target")
    for r in rows:
        if r["unit"] == "B":
            print(
                f"{r['name']:<20} {r['vsf'] / 2**20:6.1f}Mi {r['ref'] / 2**20:6.1f}Mi {r['ratio']:7.2f} {'-':>6}  {r['target']}"
            )
            for k, rank in enumerate(r["ranks"]):
                print(
                    f"  rank {k}: resident {rank['before'] / 2**20:.1f} MiB before, {rank['peak'] / 2**20:.1f} at most while loading, "
                    f"{rank['after'] / 2**20:.1f} after; its shards {rank['held'] / 2**20:.1f} MiB"
                )
        else:
            print(
                f"{r['name']:<20} {r['vsf']:8.3f} {r['ref']:8.3f} {r['ratio']:7.2f} {r['cpu_ratio']:6.2f}  {r['target']}"
            )


if __name__ == "__main__":
    main()
