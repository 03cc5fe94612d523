"""A first look at vsf: a 5D mesh of 8 simulated ranks, a params pytree placed by rules.

Run: python examples/demo.py
"""

import torch

import vsf
from vsf import P


def main() -> None:
    torch.manual_seed(0)
    params = {
        "embed.weight": torch.randn(32, 16),
        "blocks.0.attn.qkv.weight": torch.randn(48, 16),
        "blocks.0.mlp.fc2.weight": torch.randn(16, 64),
        "blocks.0.mlp.fc2.bias": torch.randn(16),
    }
    with vsf.simulate(8):
        mesh = vsf.make_mesh((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"))
        print(f"mesh: {mesh.shape} ({mesh.size} simulated ranks)\n")
        specs = vsf.sharding.match(
            params,
            [
                (r".*attn\.qkv\.weight", P("tp", "fsdp")),
                (r".*mlp\.fc2\.weight", P("fsdp", "tp")),
                (r"embed\.weight", P(("dp", "fsdp"))),
                (r".*", P()),
            ],
        )
        placed = vsf.device_put(params, vsf.NamedSharding.tree(mesh, specs))
        for name, x in placed.items():
            s = vsf.sharding.sharding_of(x)
            print(
                f"{name:28s} {vsf.typeof(x):24s} spec={specs[name]!r:22s} rank0 shard {tuple(s.shard_shape(x.shape, 0))}"
            )
        print()
        print(vsf.debug.visualize_sharding(placed["blocks.0.attn.qkv.weight"]))
        back = vsf.device_get(placed)
        assert all(torch.equal(back[k], params[k]) for k in params)
        print("\ndevice_get(device_put(params)) == params: exact")


if __name__ == "__main__":
    main()
