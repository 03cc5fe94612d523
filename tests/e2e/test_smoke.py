"""The README's demo runs and prints what a reader should see (a 5D mesh of 8 simulated ranks)."""

from __future__ import annotations

import runpy
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def test_demo_output(capsys):
    runpy.run_path(str(DEMO), run_name="__main__")
    out = capsys.readouterr().out
    assert "mesh: {'pp': 1, 'dp': 2, 'fsdp': 2, 'cp': 1, 'tp': 2} (8 simulated ranks)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("embed", "blocks"))}
    # name: (typeof, rank 0's shard shape), by hand from the demo's rules
    want = {
        "embed.weight": ("f32[32@(dp,fsdp),16]", "(8, 16)"),
        "blocks.0.attn.qkv.weight": ("f32[48@tp,16@fsdp]", "(24, 8)"),
        "blocks.0.mlp.fc2.weight": ("f32[16@fsdp,64@tp]", "(8, 32)"),
        "blocks.0.mlp.fc2.bias": ("f32[16]", "(16,)"),
    }
    for name, (typ, shard) in want.items():
        assert rows[name][1] == typ, rows[name]
        assert " ".join(rows[name]).endswith(f"rank0 shard {shard}"), rows[name]
    # qkv: rows over tp (ranks with tp=0 hold 0:24), columns over fsdp; rank = 4 dp + 2 fsdp + tp
    assert "[0:24] │ 0,4  │ 2,6  │" in out and "[24:48] │ 1,5  │ 3,7  │" in out
    assert "device_get(device_put(params)) == params: exact" in out
