"""Checkpoints on CUDA (tier 4): plain tensor leaves come back where the target says, not always on the CPU.

One process, a one-rank CUDA mesh; skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

import vsf
from vsf import P

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_plain_leaves_follow_the_live_target_else_the_meshes_device(tmp_path):
    mesh = vsf.make_mesh((1,), ("x",), device_type="cuda")
    tree = {"w": vsf.device_put(torch.randn(4, 3), vsf.NamedSharding(mesh, P("x"))), "b": torch.randn(3, device="cuda"), "step": 7}
    vsf.checkpoint.save(tmp_path / "c", tree)
    as_saved = vsf.checkpoint.load(tmp_path / "c")
    assert as_saved["b"].device.type == "cuda" and as_saved["w"].to_local().device.type == "cuda"
    abstract = vsf.tree.map(lambda x: vsf.ShapeDtypeStruct.like(x) if isinstance(x, torch.Tensor) else x, tree)
    assert vsf.checkpoint.load(tmp_path / "c", abstract)["b"].device.type == "cuda"  # the target's mesh is on CUDA
    on_cpu = vsf.checkpoint.load(tmp_path / "c", dict(abstract, b=torch.zeros(3)))  # a live CPU tensor: the CPU
    assert on_cpu["b"].device.type == "cpu"
    for loaded in (as_saved, on_cpu):
        assert torch.equal(loaded["b"].cpu(), tree["b"].cpu()) and torch.equal(vsf.device_get(loaded["w"]).cpu(), vsf.device_get(tree["w"]).cpu())
