"""The balanced layout of a sequence dim (``vsf.balanced("cp")``): rank ``i`` of ``n`` holds
chunks ``i`` and ``2n-1-i`` of ``2n``. Oracle: the chunks written out by hand from positions,
and the original tensor after a round trip."""

from __future__ import annotations

import pickle

import pytest
import torch

import vsf
from vsf import P
from vsf import _compat
from torch.distributed.tensor import Shard

from vsf.sharding.named import BalancedPlacement


def test_the_spec_entry_is_an_immutable_value():
    b = vsf.balanced("cp")
    assert b == vsf.BalancedShard("cp") and hash(b) == hash(vsf.BalancedShard("cp")) and b != vsf.balanced("dp")
    assert eval(repr(b), {"BalancedShard": vsf.BalancedShard}) == b
    spec = P("dp", b)
    assert pickle.loads(pickle.dumps(spec)) == spec and repr(spec) == "P('dp', BalancedShard('cp'))"
    assert spec.axes == ("dp", "cp")
    with pytest.raises(AttributeError):
        b.axis = "dp"
    with pytest.raises(ValueError, match="'cp' is used twice"):
        P("cp", b)


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_holds_chunks_i_and_2n_minus_1_minus_i_and_the_round_trip_gives_the_original(sim, n):
    seq = 4 * n  # chunks of 2 positions
    x = torch.arange(2 * seq).view(2, seq)
    sim(2 * n)
    mesh = vsf.make_mesh((2, n), ("dp", "cp"))
    s = vsf.NamedSharding(mesh, P("dp", vsf.balanced("cp")))
    placed = vsf.device_put({"tokens": x}, s)["tokens"]
    assert tuple(placed.placements) == (Shard(0), BalancedPlacement(1))
    assert vsf.typeof(placed) == f"i64[2@dp,{seq}@cp~bal]"
    shards = _compat.local_shards(placed.to_local(), 0)
    for rank, local in shards.items():
        row, i = divmod(rank, n)
        chunk = lambda c: list(range(2 * c, 2 * c + 2))  # noqa: E731
        want = [row * seq + p for p in chunk(i) + chunk(2 * n - 1 - i)]
        assert local.reshape(-1).tolist() == want, rank
    whole = vsf.device_get(placed)
    assert type(whole) is torch.Tensor  # a plain tensor, not one per simulated rank
    torch.testing.assert_close(whole, x, rtol=0, atol=0)
    back = vsf.device_put(placed, vsf.NamedSharding(mesh, P(None, "cp")))  # to a contiguous split and back
    torch.testing.assert_close(vsf.device_get(back), x, rtol=0, atol=0)


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused_naming_the_leaf(sim):
    sim(4)
    mesh = vsf.make_mesh((4,), ("cp",))
    with pytest.raises(ValueError, match=r"device_put of positions.*dim 1 .*size 12 .*2 \* cp=4 = 8 equal chunks"):
        vsf.device_put({"positions": torch.zeros(1, 12)}, vsf.NamedSharding(mesh, P(None, vsf.balanced("cp"))))
