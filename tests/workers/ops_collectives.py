"""Tier-3 worker: vsf.ops on real gloo processes, checked against the oracles of ops_oracles.py.

Run as ``torchrun --nproc-per-node 4 ops_collectives.py OUT_DIR [cpu|cuda]``; each rank writes
``OUT_DIR/rank{r}.json`` with, per case, whether its value and gradient match the oracle, and,
on cpu (gloo), per ragged all-gather, the bytes it handed to gloo and the bytes its sockets
wrote. ``cuda`` runs the cases over NCCL (one GPU per rank).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import vsf
from vsf import _compat
from ops_oracles import check_on_rank, collective_cases, payload_bytes

ROW = 64  # float32 elements per row in the byte measurements


def written_bytes() -> int:
    """Bytes this process has written through write-like syscalls (its gloo sockets included)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["wchar"])


class SplitRecorder:
    """Wraps the functional ``all_to_all_single`` vsf's ragged exchange runs on and adds up the
    bytes each call sends to other ranks."""

    def __init__(self) -> None:
        self.sent = 0
        self._call = _compat.functional_collectives.all_to_all_single

    def __call__(self, input, output_split_sizes, input_split_sizes, group, *args, **kwargs):
        me = dist.get_rank(group)
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        self.sent += sum(s for j, s in enumerate(input_split_sizes) if j != me) * row_bytes
        return self._call(input, output_split_sizes, input_split_sizes, group, *args, **kwargs)


def check_cases(rank: int, device: str) -> dict[str, dict[str, bool]]:
    mesh = vsf.make_mesh((2, 2), ("a", "b"), device_type=device)
    with vsf.use_mesh(mesh):
        return {case.name: check_on_rank(case, mesh, rank, device) for case in collective_cases(mesh.axis_size("b"))}


def measure_bytes(rank: int) -> list[dict]:
    line = vsf.make_mesh((4,), ("x",), device_type="cpu")
    me = line.coordinate(rank)["x"]
    recorder = SplitRecorder()
    _compat.functional_collectives.all_to_all_single = recorder
    out = []
    try:
        for sizes in [(1000, 2000, 0, 3000), (2500, 2500, 2500, 2500), (0, 0, 10000, 0)]:
            x = torch.full((sizes[me], ROW), float(me))
            handed_before = recorder.sent
            dist.barrier()
            before = written_bytes()
            y = vsf.ops.all_gather_v(x, "x", sizes, mesh=line)
            wire = written_bytes() - before
            full = torch.cat([torch.full((s, ROW), float(i)) for i, s in enumerate(sizes)])
            out.append(
                {
                    "sizes": sizes,
                    "payload": payload_bytes(sizes, me, ROW * 4),
                    "handed": recorder.sent - handed_before,
                    "wire": wire,
                    "correct": torch.equal(y, full),
                }
            )
    finally:
        _compat.functional_collectives.all_to_all_single = recorder._call
    return out


def check_shard_map(device: str) -> dict[str, bool]:
    """A Megatron MLP through ``vsf.shard_map`` (psum over ``b``): its value and its weights'
    gradients against torch autograd on the full tensors (the same on every rank: same seed)."""
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(8, 4), torch.randn(4, 6), torch.randn(6, 4)
    full = [t.clone().requires_grad_() for t in (x, w1, w2)]
    want = torch.relu(full[0] @ full[1]) @ full[2]
    want.pow(2).sum().backward()
    mesh = vsf.make_mesh((2, 2), ("a", "b"), device_type=device)
    specs = (vsf.P("a"), vsf.P(None, "b"), vsf.P("b"))
    mlp = vsf.shard_map(
        lambda x, w1, w2: vsf.ops.psum(torch.relu(x @ w1) @ w2, "b"), mesh=mesh, in_specs=specs, out_specs=vsf.P("a")
    )
    placed = vsf.device_put((x, w1, w2), tuple(vsf.NamedSharding(mesh, s) for s in specs))
    y = mlp(*placed)
    grads = vsf.grad(lambda p: mlp(*p).pow(2).sum())(placed)
    return {
        "value": torch.allclose(vsf.device_get(y).cpu(), want.detach(), atol=1e-5),
        "grad": all(torch.allclose(vsf.device_get(g).cpu(), t.grad, atol=1e-5) for g, t in zip(grads, full)),
    }


def main(out_dir: str, device: str) -> None:
    rank = int(os.environ["RANK"])
    report = {
        "cases": check_cases(rank, device),
        "shard_map": check_shard_map(device),
        "bytes": measure_bytes(rank) if device == "cpu" else [],
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
