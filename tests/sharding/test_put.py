"""``device_put`` / ``device_get``: every rank holds what vsf's layout says, on simulated ranks and
on 4 real gloo processes (tier 3, marked ``multiprocess``).

The oracle (tests/layout_oracle.py) cuts each rank's piece by hand with ``torch.chunk``; the
round trip ``device_get(device_put(x))`` uses DTensor's own ``full_tensor``, so it checks that
DTensor reads vsf's pieces the same way (``_StridedShard`` and unreduced specs included).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import event, given, settings, strategies as st
from torch.distributed.tensor import DTensor

import vsf
from vsf import P
from layout_oracle import entry_axes, expected_shard

MESHES = {
    "1d": ((4,), ("x",)),
    "2d": ((3, 2), ("tp", "dp")),
    "5d": ((1, 2, 2, 1, 2), ("pp", "dp", "fsdp", "cp", "tp")),
}
DTYPES = (torch.float32, torch.int64, torch.bfloat16)


class Pair(NamedTuple):
    mu: Any
    nu: Any


class Leaf(NamedTuple):
    """A generated tensor leaf: its value and the spec entries / unreduced axes it is placed with."""

    full: torch.Tensor
    entries: tuple
    unreduced: tuple


def _against_mesh_order(axes: tuple[str, ...], sizes, names) -> bool:
    big = [a for a in axes if sizes[names.index(a)] > 1]
    return big != sorted(big, key=names.index)


@st.composite
def leaves(draw, sizes, names):
    """A tensor (uneven dims allowed where DTensor can hold them) and a random spec for it."""
    rank = draw(st.integers(0, 3) if draw(st.booleans()) else st.integers(1, 3))
    owner = {a: draw(st.sampled_from([None, "unreduced", *range(rank), *range(rank)])) for a in names}
    order = draw(st.permutations(names))
    entries, shape = [], []
    for dim in range(rank):
        axes = tuple(a for a in order if owner[a] == dim)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        ways = math.prod(sizes[names.index(a)] for a in axes)
        if _against_mesh_order(axes, sizes, names):
            shape.append(ways * draw(st.integers(1, 2)))
        else:
            empty = draw(st.integers(0, 9)) == 0
            shape.append(0 if empty else draw(st.integers(1, ways * 2 + 1)))
    unreduced = tuple(a for a in names if owner[a] == "unreduced")
    dtype = draw(st.sampled_from(DTYPES))
    full = torch.arange(math.prod(shape)).reshape(shape).to(dtype)  # every element distinct
    return Leaf(full, tuple(entries), unreduced)


def pytrees(sizes, names):
    def nodes(children):
        keys = st.sampled_from(["w", "b", "blocks", "opt", "mu"])
        return st.one_of(
            st.dictionaries(keys, children, max_size=3),
            st.lists(children, max_size=3),
            st.builds(Pair, children, children),
        )

    return st.recursive(st.one_of(leaves(sizes, names), st.none()), nodes, max_leaves=6)


def _is_leaf(x):
    return isinstance(x, Leaf)


def _check_shards(placed: DTensor, leaf: Leaf, sizes, names) -> None:
    shards = vsf.debug.shards(placed)
    assert [s.rank for s in shards] == list(range(math.prod(sizes)))
    for s in shards:
        want = expected_shard(leaf.full, sizes, names, leaf.entries, s.rank, leaf.unreduced)
        assert s.data.dtype == leaf.full.dtype
        assert s.data.shape == want.shape and torch.equal(s.data, want), (s.rank, leaf.entries)
        reduced = expected_shard(leaf.full, sizes, names, leaf.entries, s.rank)
        assert torch.equal(leaf.full[s.index], reduced), (s.rank, s.index)


def _mesh_and(strategy):
    """A mesh name drawn from MESHES, and a value drawn from ``strategy(sizes, names)`` for it."""
    return st.sampled_from(sorted(MESHES)).flatmap(lambda k: st.tuples(st.just(k), strategy(*MESHES[k])))


@settings(max_examples=50)
@given(_mesh_and(pytrees), st.booleans())
def test_device_put_holds_hand_sliced_shards_and_round_trips(case, bare_specs):
    mesh_name, spec_tree = case
    sizes, names = MESHES[mesh_name]
    values = vsf.tree.map(lambda l: l.full, spec_tree, is_leaf=_is_leaf)
    with vsf.simulate(math.prod(sizes)):
        mesh = vsf.make_mesh(sizes, names)
        specs = vsf.tree.map(lambda l: P(*l.entries, unreduced=l.unreduced), spec_tree, is_leaf=_is_leaf)
        if bare_specs:
            with vsf.use_mesh(mesh):
                placed = vsf.device_put(values, specs)
        else:
            placed = vsf.device_put(values, vsf.NamedSharding.tree(mesh, specs))
        assert vsf.tree.structure(placed) == vsf.tree.structure(values)
        for leaf, x in zip(vsf.tree.leaves(spec_tree, is_leaf=_is_leaf), vsf.tree.leaves(placed)):
            assert isinstance(x, DTensor) and tuple(x.shape) == tuple(leaf.full.shape)
            _check_shards(x, leaf, sizes, names)
            want = vsf.NamedSharding(mesh, P(*leaf.entries, unreduced=leaf.unreduced))
            got = vsf.sharding.sharding_of(x)
            assert got.devices_indices_map(x.shape) == want.devices_indices_map(x.shape)
            assert got.spec.unreduced == tuple(a for a in want.spec.unreduced if mesh.axis_size(a) > 1)
        back = vsf.device_get(placed)
    assert vsf.tree.structure(back) == vsf.tree.structure(values)
    for a, b in zip(vsf.tree.leaves(back), vsf.tree.leaves(values)):
        assert type(a) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)


def _two_specs(sizes, names):
    """One tensor placed one way, then re-placed another way (same shape)."""

    def second(first: Leaf):
        return (
            leaves(sizes, names)
            .filter(lambda l: l.full.ndim == first.full.ndim)
            .map(lambda l: (first, l.entries, l.unreduced))
        )

    return leaves(sizes, names).flatmap(second)


@settings(max_examples=40)
@given(_mesh_and(_two_specs))
def test_device_put_of_a_dtensor_redistributes_to_the_new_layout(case):
    mesh_name, (first, entries, unreduced) = case
    sizes, names = MESHES[mesh_name]
    target = Leaf(first.full, entries, unreduced)
    fits = all(
        not _against_mesh_order(entry_axes(e), sizes, names)
        or first.full.shape[d] % math.prod(sizes[names.index(a)] for a in entry_axes(e)) == 0
        for d, e in enumerate(entries)
    )
    with vsf.simulate(math.prod(sizes)):
        mesh = vsf.make_mesh(sizes, names)
        x = vsf.device_put(first.full, vsf.NamedSharding(mesh, P(*first.entries, unreduced=first.unreduced)))
        s = vsf.NamedSharding(mesh, P(*entries, unreduced=unreduced))
        gains_unreduced = any(mesh.axis_size(a) > 1 and a not in first.unreduced for a in unreduced)
        event(f"refused={not fits or gains_unreduced}")
        if not fits or gains_unreduced:
            with pytest.raises(ValueError, match="<root>"):
                vsf.device_put(x, s)
            return
        y = vsf.device_put(x, s)
        _check_shards(y, target, sizes, names)
        assert torch.equal(vsf.device_get(y), first.full)


# -- bad input: each error names the leaf's key path, the spec, the dim, the axes and sizes ----------

TREE = {"params": {"w": torch.zeros(8, 6), "b": torch.zeros(6)}, "opt": [torch.zeros(4, 4), 3], "step": None}


@pytest.fixture
def mesh(sim):
    sim(4)
    return vsf.make_mesh((2, 2), ("dp", "tp"))


def _error(mesh, shardings, *, error=ValueError, use_mesh=True):
    with pytest.raises(error) as e:
        if use_mesh:
            with vsf.use_mesh(mesh):
                vsf.device_put(TREE, shardings)
        else:
            vsf.device_put(TREE, shardings)
    return str(e.value)


def _specs(**overrides):
    specs = {"params": {"w": P("dp", "tp"), "b": P()}, "opt": [P(), P()], "step": None}
    for path, spec in overrides.items():
        node, key = (specs["params"], path) if path in ("w", "b") else (specs["opt"], int(path[-1]))
        node[key] = spec
    return specs


def _assert_parts(msg, *parts):
    for part in parts:
        assert part in msg, (part, msg)


def test_unknown_axis(mesh):
    msg = _error(mesh, _specs(w=P("dp", "ep")))
    _assert_parts(msg, "params.w", "(8, 6)", "P('dp', 'ep')", "'ep'", "{'dp': 2, 'tp': 2}")


def test_spec_longer_than_rank(mesh):
    msg = _error(mesh, _specs(b=P(None, "tp")))
    _assert_parts(msg, "params.b", "P(None, 'tp') has 2 entries but the tensor has rank 1 (shape (6,))")


def test_uneven_split_against_mesh_order(mesh):
    msg = _error(mesh, _specs(w=P(None, ("tp", "dp"))))
    _assert_parts(msg, "params.w", "(8, 6)", "P(None, ('tp', 'dp'))", "dim 1 of size 6", "4 ways", "tp=2, dp=2")


def test_shardings_not_a_prefix(mesh):
    msg = _error(mesh, {"params": {"w": P()}, "opt": P(), "step": None})
    _assert_parts(msg, "shardings is not a prefix of the value tree at params", "keys ['b', 'w']", "keys ['w']")
    msg = _error(mesh, {"params": P(), "opt": [P(), [P()]], "step": None})
    _assert_parts(msg, "at ['opt'][1]", "leaf 3", "list")


def test_non_tensor_leaf_with_a_non_trivial_spec(mesh):
    msg = _error(mesh, _specs(opt1=P("dp")), error=TypeError)
    _assert_parts(msg, "['opt'][1]", "int", "P('dp')")


def test_unconstrained_is_refused(mesh):
    msg = _error(mesh, _specs(w=P("dp", P.UNCONSTRAINED)))
    _assert_parts(msg, "params.w", "P.UNCONSTRAINED (dim 1)", "with_sharding_constraint")


def test_bare_spec_needs_a_current_mesh(mesh):
    msg = _error(mesh, _specs(), use_mesh=False)
    _assert_parts(msg, "['opt'][0]", "needs a current mesh", "vsf.use_mesh(mesh)", "vsf.NamedSharding(mesh, P())")


def test_wrong_sharding_type(mesh):
    msg = _error(mesh, _specs(w=("dp", "tp")))
    _assert_parts(msg, "at params.w", "leaf tensor[8, 6]", "single entry", "tuple ('dp', 'tp')")


def test_cannot_make_a_placed_value_unreduced(mesh):
    x = vsf.device_put({"g": torch.ones(4)}, vsf.NamedSharding(mesh, P("dp")))
    with pytest.raises(ValueError) as e:
        vsf.device_put(x, vsf.NamedSharding(mesh, P("dp", unreduced="tp")))
    _assert_parts(str(e.value), "g", "DTensor of shape (4,)", "cannot make a reduced value unreduced over ('tp',)")


def test_trivial_specs_and_none_leave_non_tensors_alone(mesh):
    with vsf.use_mesh(mesh):
        out = vsf.device_put(
            {"n": 3, "s": "x", "t": torch.ones(2), "u": torch.ones(2)}, {"n": P(), "s": None, "t": P(), "u": None}
        )
    assert out["n"] == 3 and out["s"] == "x"
    assert isinstance(out["t"], DTensor) and type(out["u"]) is not DTensor


def test_a_replicated_nan_is_read(mesh):
    """A diverged run's loss: a replicated value holding NaN (and inf) is read, NaN at its
    positions (the ranks' copies compared NaN equal to NaN; torch's own reconcile refused them)."""
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    loss = vsf.jit(lambda v: v * 2)(vsf.device_put(x, vsf.NamedSharding(mesh, P())))
    got = vsf.device_get(loss)
    assert torch.equal(got.isnan(), torch.tensor([False, True, False, False]))
    assert got[0] == 2 and got[2] == float("inf") and got[3] == -4


def test_replicas_that_differ_are_an_error(mesh):
    """Ranks holding different values of a value claimed replicated are named, NaN or not."""
    from vsf import _compat

    with pytest.raises(ValueError, match="simulated ranks 0 and 2 hold different values"):
        _compat.reconcile(
            _compat.make_local(
                {
                    0: torch.tensor([float("nan")]),
                    1: torch.tensor([float("nan")]),
                    2: torch.tensor([0.0]),
                    3: torch.tensor([0.0]),
                }
            )
        )


# -- on 4 real gloo processes ------------------------------------------------------------------
# Tier 3: device_put / device_get on 4 real gloo processes under torchrun (a 2x2 mesh).
#
# The worker (tests/workers/put_worker.py) runs once for the module; each test reads what the
# ranks reported. Hand-computed expectations: rank = 2 dp + tp.

NPROC = 4


@pytest.fixture(scope="module")
def ranks(world):
    return world("put_worker.py")


def _leaf(report, name):
    (leaf,) = [leaf for leaf in report["leaves"] if leaf["name"] == name]
    return leaf


@pytest.mark.world("put_worker.py")
@pytest.mark.multiprocess
def test_world_and_mesh_coordinates(ranks):
    for r, rep in enumerate(ranks):
        assert (rep["rank"], rep["world"], rep["backend"]) == (r, NPROC, "gloo")
        assert rep["coordinate"] == {"dp": r // 2, "tp": r % 2}


@pytest.mark.world("put_worker.py")
@pytest.mark.multiprocess
def test_sub_meshes_hold_this_rank(ranks):
    for r, rep in enumerate(ranks):
        assert rep["sub_tp_devices"] == [2 * (r // 2), 2 * (r // 2) + 1]  # this rank's row of the tp axis
        assert rep["sub_tp_dp_devices"] == [0, 2, 1, 3]  # (tp, dp) order: tp major
        assert rep["sub_mesh_local"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]][r % 2]
        assert rep["sub_mesh_round_trip"]


@pytest.mark.world("put_worker.py")
@pytest.mark.multiprocess
def test_every_local_shard_matches_hand_slicing(ranks):
    for rep in ranks:
        assert len(rep["leaves"]) == 18
        bad = [
            (leaf["name"], leaf["spec"], leaf["local_shape"], leaf["expected_shape"])
            for leaf in rep["leaves"]
            if not leaf["local_ok"]
        ]
        assert not bad, (rep["rank"], bad)
        assert all(leaf["shard_rank"] == rep["rank"] for leaf in rep["leaves"])


@pytest.mark.world("put_worker.py")
@pytest.mark.multiprocess
def test_uneven_and_strided_indices_by_hand(ranks):
    rows_dp = [[0, 3], [3, 5]]  # 5 rows over dp: 3 | 2
    rows_dp_tp = [[0, 2], [2, 3], [3, 4], [4, 5]]  # 5 rows over (dp, tp): 2, 1, 1, 1
    for r, rep in enumerate(ranks):
        dp, tp = r // 2, r % 2
        assert _leaf(rep, "uneven_rows")["index"] == [rows_dp[dp], [0, 3]]
        assert _leaf(rep, "uneven_multi_axis")["index"] == [rows_dp_tp[r]]
        block = tp * 2 + dp  # (tp, dp): tp major
        assert _leaf(rep, "strided")["index"] == [[2 * block, 2 * block + 2], [0, 2]]
        assert _leaf(rep, "strided")["typeof"] == "f32[8@(tp,dp),2]"
        assert _leaf(rep, "unreduced")["typeof"] == "f32[4,6@tp]{U:dp}"
        assert _leaf(rep, "empty_dim")["local_shape"] == [0, 2]


@pytest.mark.world("put_worker.py")
@pytest.mark.multiprocess
def test_round_trip_is_exact(ranks):
    for rep in ranks:
        assert rep["round_trip"] and all(rep["round_trip"].values()), rep["round_trip"]
        assert rep["round_trip_structure"]
        assert rep["resharded"]["local_ok"] and rep["resharded_round_trip"]


@pytest.mark.world("put_worker.py")
@pytest.mark.multiprocess
def test_mesh_of_the_wrong_size_is_a_clear_error(ranks):
    for rep in ranks:
        msg = rep["wrong_size_error"]
        assert msg is not None
        for part in ("{'x': 2}", "has 2 ranks", "this run has 4", "torchrun --nproc-per-node 2"):
            assert part in msg, (part, msg)


def test_device_get_is_not_changed_by_a_later_donated_step():
    """On a real (one-rank) process group, a gathered value keeps what it held when gathered: a
    jitted step that donates the params writes their buffers in place, and DTensor's
    ``full_tensor()`` of a value whole on this rank is a view of its local tensor (device_get
    returned it: two steps doubling the params changed what it had returned to their 4x)."""
    import torch.distributed as dist

    from vsf import _compat

    _compat.init_fake_process_group(1)
    try:
        mesh = vsf.make_mesh((1,), ("dp",))
        p = vsf.device_put(
            {"w": torch.ones(4), "b": torch.arange(4.0)}, vsf.NamedSharding.tree(mesh, {"w": P(), "b": P("dp")})
        )
        step = vsf.jit(lambda p: {k: v * 2 for k, v in p.items()}, donate_argnums=(0,))
        before = vsf.device_get(p)
        p = step(step(p))
        torch.testing.assert_close(before["w"], torch.ones(4))  # replicated
        torch.testing.assert_close(before["b"], torch.arange(4.0))  # split over a one-rank axis
        torch.testing.assert_close(vsf.device_get(p), {"w": torch.ones(4) * 4, "b": torch.arange(4.0) * 4})
    finally:
        dist.destroy_process_group()
