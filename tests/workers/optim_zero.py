"""Worker for tests/optim/test_optim_sharded.py: chain(clip, adamw) with ZeRO stage 2 over every rank (gloo).

Every rank builds the same params and gradients from one seed; gradients arrive as unreduced
partial sums (each rank holds its share), are reduce-scattered into the state's layout by the
update, and the updated params are gathered back. Each rank writes its final params (gathered),
the bytes it holds, and its shard of one state leaf to ``out_dir/rank{r}.json``.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

import vsf
from vsf import P, optim

STEPS = 5


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    params = {"w": torch.randn(8, 6), "b": torch.randn(5), "e": torch.randn(4, 4)}
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(STEPS)]
    mesh = vsf.make_mesh((int(os.environ["WORLD_SIZE"]),), ("dp",))
    tx = optim.chain(
        optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1, mask={"w": True, "b": False, "e": True})
    )
    placed = vsf.device_put(params, vsf.NamedSharding(mesh, P()))
    tx = optim.sharded(tx, zero_axes=("dp",), stage=2, uneven=True)
    state = tx.init(placed)
    share = 1.0 / dist.get_world_size()
    for g in grads:  # each rank's partial sum is an equal share of the full gradient
        partial = {
            k: DTensor.from_local(v * share, mesh.device_mesh, [Partial()], run_check=False) for k, v in g.items()
        }
        updates, state = tx.update(partial, state, placed)
        placed = optim.apply_updates(placed, updates)
    out = {
        "params": {k: v.tolist() for k, v in vsf.device_get(placed).items()},
        "bytes": vsf.debug.memory_report(state),
        "mu_b_local": state[1].mu["b"].to_local().tolist(),
    }
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
