"""Tier-3 worker: run by ``torchrun --nproc-per-node 4`` (see tests/sharding/test_put.py).

A user-style script on a 2x2 gloo mesh: place a pytree with random specs (the same seed on every
rank, so all ranks agree), check this rank's local pieces against hand slicing, gather it back,
re-place a placed value, place on a sub-mesh, and try a mesh of the wrong size. Each rank writes
what it saw to ``OUT_DIR/rank{r}.json``; the test asserts on it.

Usage: put_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the layout oracle

import vsf  # noqa: E402
from layout_oracle import expected_shard  # noqa: E402
from vsf import P  # noqa: E402

SIZES, NAMES = (2, 2), ("dp", "tp")


class Moments(NamedTuple):
    mu: Any
    nu: Any


# Fixed cases the test checks by hand, then random ones: (shape, entries, unreduced, dtype).
FIXED = {
    "uneven_rows": ((5, 3), ("dp",), (), torch.float32),  # 3 | 2 rows over dp
    "uneven_multi_axis": ((5,), (("dp", "tp"),), (), torch.float32),  # 2, 1, 1, 1 rows
    "strided": ((8, 2), (("tp", "dp"),), (), torch.float32),  # tp major, against mesh order
    "unreduced": ((4, 6), (None, "tp"), ("dp",), torch.float32),
    "empty_dim": ((0, 4), ("tp", "dp"), (), torch.int64),
    "bf16_2d": ((6, 7), ("tp", "dp"), (), torch.bfloat16),
}


def random_case(rng: random.Random) -> tuple[tuple[int, ...], tuple[Any, ...], tuple[str, ...], torch.dtype]:
    rank = rng.randint(1, 3)
    owner = {a: rng.choice([None, "unreduced", *range(rank)]) for a in NAMES}
    order = rng.sample(NAMES, len(NAMES))
    entries, shape = [], []
    for dim in range(rank):
        axes = tuple(a for a in order if owner[a] == dim)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        against = len(axes) == 2 and axes != NAMES
        shape.append(4 * rng.randint(1, 2) if against else rng.randint(1, 7))
    unreduced = tuple(a for a in NAMES if owner[a] == "unreduced")
    return tuple(shape), tuple(entries), unreduced, rng.choice([torch.float32, torch.int64, torch.float64])


def make_full(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(math.prod(shape)).reshape(shape).to(dtype)


def check_leaf(name: str, x: Any, full: torch.Tensor, entries: tuple, unreduced: tuple, rank: int) -> dict[str, Any]:
    local = x.to_local()
    want = expected_shard(full, SIZES, NAMES, entries, rank, unreduced)
    (shard,) = vsf.debug.shards(x)
    return {
        "name": name,
        "spec": repr(P(*entries, unreduced=unreduced)),
        "typeof": vsf.typeof(x),
        "local_shape": list(local.shape),
        "expected_shape": list(want.shape),
        "local_ok": bool(local.shape == want.shape and torch.equal(local, want)),
        "shard_rank": shard.rank,
        "index": [[s.start, s.stop] for s in shard.index],
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    mesh = vsf.make_mesh(SIZES, NAMES)  # initialises gloo from torchrun's environment
    rank = dist.get_rank()
    report: dict[str, Any] = {
        "rank": rank,
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "coordinate": mesh.coordinate(rank),
        "sub_tp_devices": list(mesh["tp"].devices),
        "sub_tp_dp_devices": list(mesh["tp", "dp"].devices),
    }

    rng = random.Random(1234)
    cases = dict(FIXED)
    cases.update({f"random_{i}": random_case(rng) for i in range(12)})
    fulls = {k: make_full(shape, dtype) for k, (shape, _, _, dtype) in cases.items()}
    names = sorted(cases)
    values = {
        "fixed": {k: fulls[k] for k in FIXED},
        "rand": [fulls[k] for k in names if k.startswith("random")],
        "moments": Moments(fulls["random_0"], None),
    }
    spec_of = {k: P(*entries, unreduced=unreduced) for k, (_, entries, unreduced, _) in cases.items()}
    shardings = vsf.NamedSharding.tree(
        mesh,
        {
            "fixed": {k: spec_of[k] for k in FIXED},
            "rand": [spec_of[k] for k in names if k.startswith("random")],
            "moments": Moments(spec_of["random_0"], None),
        },
    )
    placed = vsf.device_put(values, shardings)
    leaves = vsf.tree.leaves(placed["fixed"]) + vsf.tree.leaves(placed["rand"])
    flat_names = sorted(FIXED) + [k for k in names if k.startswith("random")]  # dict leaves: sorted keys
    report["leaves"] = [check_leaf(k, x, fulls[k], cases[k][1], cases[k][2], rank) for k, x in zip(flat_names, leaves)]
    back = vsf.device_get(placed)
    report["round_trip"] = {
        k: bool(torch.equal(b, fulls[k]) and b.dtype == fulls[k].dtype)
        for k, b in zip(flat_names, vsf.tree.leaves(back["fixed"]) + vsf.tree.leaves(back["rand"]))
    }
    report["round_trip_structure"] = vsf.tree.structure(back) == vsf.tree.structure(values)

    # Re-placing a placed value redistributes it (strided -> sharded the other way).
    moved = vsf.device_put(placed["fixed"]["strided"], vsf.NamedSharding(mesh, P(None, "tp")))
    report["resharded"] = check_leaf("strided->P(None,'tp')", moved, fulls["strided"], (None, "tp"), (), rank)
    report["resharded_round_trip"] = bool(torch.equal(vsf.device_get(moved), fulls["strided"]))

    # A sub-mesh holds this rank; placing on it splits over that sub-mesh only.
    sub = mesh["tp"]
    on_sub = vsf.device_put(torch.arange(6.0), vsf.NamedSharding(sub, P("tp")))
    report["sub_mesh_local"] = on_sub.to_local().tolist()
    report["sub_mesh_round_trip"] = bool(torch.equal(vsf.device_get(on_sub), torch.arange(6.0)))

    try:
        vsf.make_mesh((2,), ("x",))
        report["wrong_size_error"] = None
    except ValueError as e:
        report["wrong_size_error"] = str(e)

    (out_dir / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
