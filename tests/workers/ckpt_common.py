"""The trees the checkpoint tests save and load, and their oracle: full values regenerated from names.

Every tensor leaf's full value is a pure function of its key path (seeded generator), so any
process can rebuild what was saved and compare bit for bit. Layout "A" is on a (dp=2, tp=2) mesh,
layout "B" on a 1D mesh of 2 ranks (axis "x"); ``mesh=None`` means plain whole tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import FileSystemReader

import vsf
from vsf import P


class Adam(NamedTuple):
    mu: Any
    nu: Any
    count: Any


@vsf.tree.register_dataclass
@dataclasses.dataclass
class Meta:
    lr: float
    name: str
    mask: Any


# key path -> (shape, dtype, spec on layout A, spec on layout B)
PARAMS = {
    "w1": ((8, 6), torch.float32, P("dp", "tp"), P(None, "x")),
    "w2": ((6, 10), torch.float32, P(None, ("dp", "tp")), P("x")),
    "emb": ((8, 4), torch.bfloat16, P(("tp", "dp")), P()),
    "b": ((5,), torch.float32, P("tp"), P("x")),
    "scale": ((), torch.float32, P(), P()),
    "ids": ((6,), torch.int64, P("dp"), P(vsf.ragged("x", (2, 1)))),  # Shard -> ragged
    "tiny": ((3, 2), torch.float32, P(("dp", "tp")), P("x")),  # rank 3 holds no rows in layout A
    # ragged leaves: saved as they are, loaded with other units / as Shard / whole
    "rows": ((12, 4), torch.float32, P(vsf.ragged("dp", (1, 2)), "tp"), P(vsf.ragged("x", (3, 1)))),
    "cube": ((3, 4, 2), torch.float32, P(vsf.ragged("tp", (1, 3), dims=2)), P("x")),  # rows 3..12 of 3x4: 2 boxes
    "lone": ((4, 3), torch.bfloat16, P(vsf.ragged("dp", (0, 1))), P(vsf.ragged("x", (1, 1)))),  # dp=0 holds nothing
    # a fused qkv weight packed over tp (each rank a slice of q, k and v), loaded packed in 2 or plain
    "qkv": ((4, 12), torch.float32, P("dp", vsf.packed("tp", 3)), P(None, vsf.packed("x", 2))),
    # a sequence split balanced (each rank an early and a late chunk), loaded balanced over x or plain
    "seq": ((8, 2), torch.float32, P(vsf.balanced("tp"), "dp"), P(vsf.balanced("x"))),
}


def full(path: str, shape: tuple[int, ...], dtype: torch.dtype, step: int = 0) -> torch.Tensor:
    """The full value of the leaf at ``path`` (a pure function of the path; floats shifted by ``step``).

    Under ``vsf.simulate`` it is one plain tensor, the same for every simulated rank.
    """
    g = torch.Generator().manual_seed(zlib.crc32(path.encode()))
    with vsf._compat.local_mode_disabled():
        if dtype == torch.int64:
            return torch.randint(-1000, 1000, shape, generator=g)
        if dtype == torch.bool:
            return torch.rand(shape, generator=g) > 0.5
        return (torch.randn(shape, generator=g) + step).to(dtype)


def _params(prefix: str, mesh: vsf.Mesh | None, layout: str, make: Any) -> dict[str, Any]:
    out = {}
    for name, (shape, dtype, spec_a, spec_b) in PARAMS.items():
        spec = spec_a if layout == "A" else spec_b
        sharding = vsf.NamedSharding(mesh, spec) if mesh is not None else None
        out[name] = make(f"{prefix}.{name}", shape, dtype, sharding)
    return out


def build(mesh: vsf.Mesh | None, layout: str, make: Any) -> dict[str, Any]:
    """The test tree, each tensor leaf made by ``make(path, shape, dtype, sharding)``."""
    return {
        "params": _params("params", mesh, layout, make),
        "opt": Adam(
            _params("opt.mu", mesh, layout, make),
            _params("opt.nu", mesh, layout, make),
            make("opt.count", (), torch.int32, None),
        ),
        "meta": Meta(0.125, "run-1", make("meta.mask", (4,), torch.bool, None)),
        "step": 100,
        "flags": [True, None, "x", 2.5],
    }


def real(
    path: str, shape: tuple[int, ...], dtype: torch.dtype, sharding: vsf.NamedSharding | None, step: int = 0
) -> torch.Tensor:
    value = full(path, shape, dtype, step)
    return vsf.device_put(value, sharding) if sharding is not None else value


def abstract(
    path: str, shape: tuple[int, ...], dtype: torch.dtype, sharding: vsf.NamedSharding | None
) -> vsf.ShapeDtypeStruct:
    return vsf.ShapeDtypeStruct(shape, dtype, sharding)


def oracle(step: int = 0) -> dict[str, Any]:
    """The full values of the test tree (floats shifted by ``step``)."""
    return build(None, "A", lambda path, shape, dtype, _: full(path, shape, dtype, step))


def mismatches(loaded: Any, expected: Any | None = None) -> list[str]:
    """Key paths whose loaded value differs (bit for bit, dtype included) from the oracle; [] if all equal."""
    expected = oracle() if expected is None else expected
    got = vsf.tree.leaves_with_path(vsf.device_get(loaded))
    want = vsf.tree.leaves_with_path(expected)
    if vsf.tree.structure(loaded) != vsf.tree.structure(expected):
        return [f"<structure {vsf.tree.structure(loaded)}>"]
    bad = []
    for (path, a), (_, b) in zip(got, want):
        same = (
            type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            if isinstance(b, torch.Tensor)
            else type(a) is type(b) and a == b
        )
        if not same:
            bad.append(vsf.tree.keystr(path))
    return bad


def layouts(tree: Any) -> dict[str, str | None]:
    """Key path -> repr of the sharding of each tensor or ShapeDtypeStruct leaf ("None" when plain)."""
    return {
        vsf.tree.keystr(p): repr(vsf.ShapeDtypeStruct.like(x).sharding)
        if isinstance(x, (torch.Tensor, vsf.ShapeDtypeStruct))
        else None
        for p, x in vsf.tree.leaves_with_path(tree)
    }


def payload_of(path: Path, key: str) -> tuple[str, int, int]:
    """(file, offset, length) of the first chunk DCP stored for ``key`` (DCP's own metadata)."""
    md = FileSystemReader(path).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == key)
    return info.relative_path, info.offset, info.length


def flip(path: Path, offset: int) -> None:
    """Flip the lowest bit of the byte at ``offset`` of the file ``path``."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def error_of(fn: Any) -> str | None:
    """``"Type: message"`` of what ``fn()`` raises, or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def results_dir(out: Path) -> Path:
    """Where this worker run writes ``rank{r}.json``: ``OUT/<script>-<torchrun restart count>``."""
    return out / f"{Path(sys.argv[0]).stem}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def write_result(out: Path, result: dict[str, Any]) -> None:
    where = results_dir(out)
    where.mkdir(parents=True, exist_ok=True)
    (where / f"rank{vsf.runtime.rank()}.json").write_text(json.dumps(result, indent=1))


def out_dir() -> Path:
    """The directory named by the first command-line argument."""
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    return out


# -- a tiny model trained with hand-written SGD + momentum on DTensors, updated in place ------


def model_state(mesh: vsf.Mesh) -> dict[str, Any]:
    params = {
        "w1": vsf.device_put(full("model.w1", (8, 16), torch.float32), vsf.NamedSharding(mesh, P(None, "tp"))),
        "w2": vsf.device_put(full("model.w2", (16, 4), torch.float32), vsf.NamedSharding(mesh, P("tp", None))),
    }
    return {"params": params, "momentum": vsf.tree.map(torch.zeros_like, params), "step": 0}


def train(state: dict[str, Any], mesh: vsf.Mesh, steps: int) -> list[str]:
    """Run ``steps`` steps in place on ``state``; the losses as exact hex floats."""
    losses = []
    for _ in range(steps):
        step = state["step"]
        x = vsf.device_put(full(f"data.x{step}", (8, 8), torch.float32), vsf.NamedSharding(mesh, P("dp")))
        t = vsf.device_put(full(f"data.t{step}", (8, 4), torch.float32), vsf.NamedSharding(mesh, P("dp")))
        params = {k: v.detach().requires_grad_() for k, v in state["params"].items()}
        loss = ((torch.relu(x @ params["w1"]) @ params["w2"] - t) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for (name, p), g in zip(state["params"].items(), grads):
                m = state["momentum"][name]
                m.mul_(0.9).add_(g.redistribute(p.device_mesh, p.placements))
                p.sub_(0.01 * m)
        losses.append(loss.full_tensor().item().hex())
        state["step"] = step + 1
    return losses
