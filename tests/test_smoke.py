import torch

import vsf
from vsf import P


def test_put_get_round_trip_5d(sim):
    sim(8)
    mesh = vsf.make_mesh((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp"))
    x = torch.randn(8, 5)
    d = vsf.device_put(x, vsf.NamedSharding(mesh, P(("tp", "dp"), "fsdp")))
    assert torch.equal(vsf.device_get(d), x)
