"""vsf.optim on simulated ranks and real gloo processes (tier 3, ``multiprocess``): ZeRO stages 1-3 and DP x TP against torch.optim on one device,
one reduction per gradient, the global norm over shards, and per-rank memory against ZeRO's formulas."""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch
from test_optim import MASK, TOL, _clip_grad_norm_, _grads, _params, run_torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

import vsf
from vsf import P, optim
from vsf.sharding import NamedSharding

STEPS = 20


def _comms(cm: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in cm.get_comm_counts().items()}


class Layout(NamedTuple):
    mesh: tuple[tuple[int, ...], tuple[str, ...]]
    params: dict  # spec per param (before ZeRO)
    grads: str  # how gradients arrive: "partial" over dp, "replicated", or "zero" (already in stage-2 layout)


LAYOUTS = {
    "dp4": Layout(((4,), ("dp",)), {"w": P(), "b": P(), "e": P()}, "partial"),
    "dp2xtp2": Layout(((2, 2), ("dp", "tp")), {"w": P(None, "tp"), "b": P(), "e": P("tp")}, "partial"),
    "dp2xtp2-replicated-grads": Layout(
        ((2, 2), ("dp", "tp")), {"w": P(None, "tp"), "b": P(), "e": P("tp")}, "replicated"
    ),
    # FSDP x TP: no unsharded dim left to take dp, so ZeRO goes minor on a sharded dim (P(("fsdp", "dp"), "tp"),
    # against the mesh order: _StridedShard)
    "dp2xfsdp2xtp2": Layout(
        ((2, 2, 2), ("dp", "fsdp", "tp")), {"w": P("fsdp", "tp"), "b": P("tp"), "e": P("fsdp", "tp")}, "partial"
    ),
}


def _place_grads(g: dict, mesh: vsf.Mesh, layout: Layout, zero: optim.ZeroLayout, stage: int) -> dict:
    if layout.grads == "zero" or stage == 2:
        return vsf.device_put(g, zero.grads)
    unreduced = ("dp",) if layout.grads == "partial" else ()
    return vsf.device_put(g, {k: NamedSharding(mesh, P(*layout.params[k], unreduced=unreduced)) for k in g})


def run_sharded(
    tx, params, grads, layout: Layout, stage: int, *, zero_axes=("dp",)
) -> tuple[dict, object, optim.ZeroLayout]:
    mesh = vsf.make_mesh(*layout.mesh)
    placed = vsf.device_put(params, {k: NamedSharding(mesh, s) for k, s in layout.params.items()})
    zero = optim.zero_layout(tx, placed, zero_axes=zero_axes, stage=stage)
    placed = vsf.device_put(placed, zero.params)
    stx = optim.sharded(tx, zero_axes=zero_axes, stage=stage)
    state = stx.init(placed)
    for g in grads:
        updates, state = stx.update(_place_grads(g, mesh, layout, zero, stage), state, placed)
        placed = optim.apply_updates(placed, updates)
    return placed, state, zero


def _placements_match(tree_, shardings) -> bool:
    leaves = vsf.tree.leaves(tree_)
    return all(
        isinstance(x, DTensor) and tuple(x.placements) == s.placements
        for x, s in zip(leaves, vsf.tree.leaves(shardings))
    )


OPTIMIZERS = {
    "sgd-nesterov-wd": (
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda: optim.sgd(0.1, 0.9, True, 1e-2),
        None,
    ),
    "adam-wd": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1), lambda: optim.adam(1e-2, weight_decay=0.1), None),
    "adamw-mask": (
        torch.optim.AdamW,
        dict(lr=1e-2, weight_decay=0.1),
        lambda: optim.adamw(1e-2, weight_decay=0.1, mask=MASK),
        MASK,
    ),
}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_optimizers_zero2_match_torch(sim, opt):
    sim(4)
    cls, kwargs, make, mask = OPTIMIZERS[opt]
    params, tx = _params(), make()
    grads = _grads(params, STEPS)
    got, state, zero = run_sharded(tx, params, grads, LAYOUTS["dp4"], stage=2)
    assert _placements_match(state, zero.state)
    want = run_torch(cls, kwargs, params, grads, mask=mask)
    full = vsf.device_get(got)
    for k in params:
        torch.testing.assert_close(full[k], want[k], **TOL)


@pytest.mark.parametrize(
    "layout,stage",
    [
        ("dp4", 1),
        ("dp4", 3),
        ("dp2xtp2", 1),
        ("dp2xtp2", 3),
        ("dp2xtp2-replicated-grads", 2),
        ("dp2xfsdp2xtp2", 1),
        ("dp2xfsdp2xtp2", 3),
    ],
)
def test_clip_adamw_zero_stages_match_torch(sim, layout, stage):
    sim(math.prod(LAYOUTS[layout].mesh[0]))
    params = _params()
    grads = _grads(params, STEPS)
    tx = optim.chain(optim.clip_by_global_norm(5.0), optim.adamw(1e-2, weight_decay=0.1, mask=MASK))
    got, state, zero = run_sharded(tx, params, grads, LAYOUTS[layout], stage)
    assert _placements_match(state, zero.state)
    assert _placements_match(got, zero.params)
    want = run_torch(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), params, grads, mask=MASK, clip=5.0)
    full = vsf.device_get(got)
    for k in params:
        torch.testing.assert_close(full[k], want[k], **TOL)


def test_uneven_zero_shards_match_torch(sim):
    sim(4)
    params = {"w": torch.randn(6, 3), "b": torch.randn(5)}  # no dim divides by 4
    grads = _grads(params, STEPS)
    tx = optim.adamw(1e-2, weight_decay=0.1)
    layout = Layout(((4,), ("dp",)), {"w": P(), "b": P()}, "partial")
    with pytest.raises(
        ValueError, match=r"cannot shard b \(shape \(5,\), P\(\)\) over zero_axes \('dp',\).*uneven=True"
    ):
        run_sharded(tx, params, grads, layout, stage=1)
    mesh = vsf.make_mesh((4,), ("dp",))
    placed = vsf.device_put(params, NamedSharding(mesh, P()))
    state = optim.init_sharded(tx, placed, zero_axes=("dp",), uneven=True)
    assert [s.data.shape[0] for s in vsf.debug.shards(state.mu["b"])] == [2, 2, 1, 0]
    for g in grads:
        updates, state = tx.update(vsf.device_put(g, NamedSharding(mesh, P(unreduced=("dp",)))), state, placed)
        placed = optim.apply_updates(placed, updates)
    want = run_torch(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), params, grads)
    full = vsf.device_get(placed)
    for k in params:
        torch.testing.assert_close(full[k], want[k], **TOL)


def test_each_gradient_is_reduced_once_and_each_update_gathered_once(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    specs = {"w": P(None, "tp"), "b": P(), "e": P("tp")}
    params = vsf.device_put(_params(), {k: NamedSharding(mesh, s) for k, s in specs.items()})
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    stx = optim.sharded(tx, zero_axes=("dp",))
    state = stx.init(params)
    grads = vsf.device_put(
        {k: torch.randn_like(v) for k, v in _params().items()},
        {k: NamedSharding(mesh, P(*s, unreduced=("dp",))) for k, s in specs.items()},
    )
    with CommDebugMode() as cm:
        updates, new_state = stx.update(grads, state, params)
    # one reduce-scatter per leaf (Partial over dp -> state sharded over dp); the global norm:
    # one all-reduce per mesh axis; nothing per use.
    assert _comms(cm) == {"reduce_scatter_tensor": 3, "all_reduce": 2}
    with CommDebugMode() as cm:
        optim.apply_updates(params, updates)
    assert _comms(cm) == {"all_gather_into_tensor": 3}
    # the plain chain on the same state: the same numbers, each gradient reduced where a
    # transform needs it (clipping all-reduces the partial sums; Adam slices them to its shards)
    with CommDebugMode() as cm:
        plain, _ = tx.update(grads, state, params)
    assert _comms(cm) == {"all_reduce": 3 + 2}
    got, want = vsf.device_get(plain), vsf.device_get(updates)
    for k in want:
        torch.testing.assert_close(got[k], want[k], **TOL)


def test_clip_by_global_norm_on_sharded_grads_equals_unsharded(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    full = {"a": torch.randn(8, 6), "b": torch.randn(5), "c": torch.randn(4, 4), "d": torch.randn(3)}
    specs = {"a": P("dp", "tp"), "b": P("tp"), "c": P(None, "dp", unreduced=("tp",)), "d": P()}  # b uneven, c partial
    grads = vsf.device_put(full, {k: NamedSharding(mesh, s) for k, s in specs.items()})
    want = {k: v.clone() for k, v in full.items()}
    _clip_grad_norm_(list(want.values()), 1.0)
    with CommDebugMode() as cm:
        got, _ = optim.clip_by_global_norm(1.0).update(grads, optim.EmptyState())
    assert _comms(cm) == {"all_reduce": 3}  # c's partial sum over tp, then one per mesh axis for the norm
    gathered = vsf.device_get(got)
    for k in full:
        torch.testing.assert_close(gathered[k], want[k], rtol=1e-6, atol=1e-7)


MEMORY_LAYOUTS = {  # mesh, param specs, model-parallel degree M (ways each param is split before ZeRO)
    "dp4": (((4,), ("dp",)), {"w": P(), "b": P(), "e": P()}, 1),
    "dp2xfsdp2xtp2": (
        ((2, 2, 2), ("dp", "fsdp", "tp")),
        {"w": P("fsdp", "tp"), "b": P(("fsdp", "tp")), "e": P("tp", "fsdp")},
        4,
    ),
}


@pytest.mark.parametrize("layout", list(MEMORY_LAYOUTS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_per_rank_matches_zero_formulas(sim, layout, stage):
    (shape, names), specs, m = MEMORY_LAYOUTS[layout]
    n = shape[names.index("dp")]
    sim(math.prod(shape))
    mesh = vsf.make_mesh(shape, names)
    full = {"w": torch.randn(64, 32), "b": torch.randn(32), "e": torch.randn(16, 8)}
    params = vsf.device_put(full, {k: NamedSharding(mesh, s) for k, s in specs.items()})
    count_p = sum(v.numel() for v in full.values())
    tx = optim.adamw(1e-3)
    zero_axes = ("dp",) if stage else ()
    layout = optim.zero_layout(tx, params, zero_axes=zero_axes, stage=max(stage, 1))
    params = vsf.device_put(params, layout.params)
    grads = vsf.device_put({k: torch.ones_like(v) for k, v in full.items()}, layout.grads)
    state = optim.init_sharded(tx, params, zero_axes=zero_axes, stage=max(stage, 1))
    report = vsf.debug.memory_report({"params": params, "grads": grads, "state": state})
    # fp32: params 4P + grads 4P + Adam's mu, nu 8P (16P) over the M model-parallel ranks, and what
    # each stage shards divided by N (dp) too, plus the replicated int32 step count (4 bytes).
    per = count_p // m
    expected = {0: 16 * per, 1: 8 * per + 8 * per // n, 2: 4 * per + 12 * per // n, 3: 16 * per // n}[stage] + 4
    assert report == {r: expected for r in range(math.prod(shape))}


def test_state_shardings_rule(sim):
    sim(8)
    mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    meta = {k: torch.empty(s, device="meta") for k, s in {"a": (6, 8), "b": (8, 6), "c": (12, 4), "s": ()}.items()}
    specs = {"a": P(), "b": P(None, "tp"), "c": P("dp"), "s": P()}
    inner = optim.masked(optim.adam(), {"a": True, "b": True, "c": True, "s": False})
    tx = optim.chain(optim.clip_by_global_norm(1.0), optim.multi_steps(inner, 2))
    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    plain = optim.state_shardings(tx, meta, {k: shard(s) for k, s in specs.items()})
    assert plain[1].acc_grads == {k: shard(s) for k, s in specs.items()}
    assert (
        plain[1].inner_state.inner_state.mu["b"] == shard(P(None, "tp"))
        and plain[1].inner_state.inner_state.mu["s"] is None
    )
    assert plain[1].mini_step == shard(P()) and plain[1].inner_state.inner_state.count == shard(P())
    with pytest.raises(ValueError, match=r"cannot shard s \(shape \(\), P\(\)\).*unsharded dims: none"):
        optim.zero_layout(tx, meta, {k: shard(s) for k, s in specs.items()}, zero_axes=("dp",), uneven=True)
    del meta["s"], specs["s"]
    tx = optim.chain(
        optim.clip_by_global_norm(1.0),
        optim.multi_steps(optim.masked(optim.adam(), {"a": True, "b": True, "c": True}), 2),
    )
    zero = optim.state_shardings(tx, meta, {k: shard(s) for k, s in specs.items()}, zero_axes=("dp", "fsdp"))
    # first dim the param does not shard whose size divides by dp*fsdp = 4; axes it uses already are skipped
    want = {"a": shard(P(None, ("dp", "fsdp"))), "b": shard(P(("dp", "fsdp"), "tp")), "c": shard(P("dp", "fsdp"))}
    assert zero[1].inner_state.inner_state.mu == want == zero[1].acc_grads
    layout = optim.zero_layout(tx, meta, {k: shard(s) for k, s in specs.items()}, zero_axes=("fsdp",), stage=2)
    assert (
        layout.params["c"] == shard(P("dp"))
        and layout.grads["c"] == shard(P("dp", "fsdp")) == layout.state[1].acc_grads["c"]
    )


def test_zero_axes_go_minor_on_a_sharded_dim_when_no_unsharded_dim_divides(sim):
    sim(8)
    mesh = vsf.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    shapes = {"w": (8, 12), "b": (12,), "v": (8, 3), "u": (6, 4)}
    specs = {"w": P("fsdp", "tp"), "b": P("tp"), "v": P("fsdp"), "u": P("tp", "fsdp")}
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    got = optim.state_shardings(optim.adam(), meta, {k: NamedSharding(mesh, specs[k]) for k in meta}, zero_axes=("dp",))
    # w: 8 rows / fsdp = 4 local rows, even over dp; b: 12 / tp = 6 local; v: dim 1 (3) is free but odd, so
    # dim 0 (8 / fsdp = 4); u: 6 / tp = 3 local rows are odd, so dim 1 (4 / fsdp = 2)
    want = {"w": P(("fsdp", "dp"), "tp"), "b": P(("tp", "dp")), "v": P(("fsdp", "dp")), "u": P("tp", ("fsdp", "dp"))}
    assert got.mu == {k: NamedSharding(mesh, s) for k, s in want.items()}
    # each rank's state shard is a slice of its param shard: rank 1 (dp=0, fsdp=0, tp=1) holds rows 0:2 of
    # w's rows 0:4 at columns 6:12; rank 4 (dp=1, fsdp=0, tp=0) rows 2:4 at columns 0:6
    assert got.mu["w"].index(shapes["w"], 1) == (slice(0, 2), slice(6, 12))
    assert got.mu["w"].index(shapes["w"], 4) == (slice(2, 4), slice(0, 6))
    # 6 rows: 3 per fsdp rank, odd; 3 columns, odd
    with pytest.raises(
        ValueError,
        match=r"cannot shard o \(shape \(6, 3\), P\('fsdp'\)\) over zero_axes \('dp',\) \(dp=2, 2 ways\): .*"
        r"unsharded dims: dim 1 = 3; sharded dims: dim 0 = 6/2 over \('fsdp',\)",
    ):
        optim.state_shardings(
            optim.adam(),
            {"o": torch.empty(6, 3, device="meta")},
            {"o": NamedSharding(mesh, P("fsdp"))},
            zero_axes=("dp",),
        )


def test_zero_errors(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    tx = optim.adamw(1e-3)
    params = vsf.device_put({"w": torch.randn(4, 4)}, NamedSharding(mesh, P()))
    with pytest.raises(
        ValueError, match=r"zero_axes names 'fsdp', which is not an axis of the mesh \{'dp': 2, 'tp': 2\}"
    ):
        optim.init_sharded(tx, params, zero_axes=("fsdp",))
    with pytest.raises(TypeError, match=r"init_sharded needs DTensor params .* v is a \w*Tensor"):
        optim.init_sharded(tx, {"w": params["w"], "v": torch.ones(4)}, zero_axes=("dp",))
    other = vsf.make_mesh((4,), ("dp",))
    with pytest.raises(ValueError, match="params live on more than one mesh: w on .* x on"):
        optim.init_sharded(tx, {"w": params["w"], "x": vsf.device_put(torch.ones(4), NamedSharding(other, P()))})
    with pytest.raises(ValueError, match=r"stage 3 shards the params over \('dp',\) too, but w is laid out as P\(\)"):
        optim.init_sharded(tx, params, zero_axes=("dp",), stage=3)
    with pytest.raises(ValueError, match="ZeRO stage must be 1, 2 or 3, got 4"):
        optim.state_shardings(tx, params, zero_axes=("dp",), stage=4)

    odd = optim.GradientTransformation(lambda p: {"table": torch.zeros(3, 3)}, lambda u, s, p=None: (u, s))
    with pytest.raises(
        ValueError, match=r"state leaf table \(shape \(3, 3\)\) is neither a scalar nor shaped like a param"
    ):
        optim.state_shardings(odd, params)
    full_init = optim.GradientTransformation(
        lambda p: {k: torch.zeros(v.shape) for k, v in p.items()}, lambda u, s, p=None: (u, s)
    )
    with pytest.raises(ValueError, match=r"init made state leaf w as a plain tensor, expected P\('dp'\)"):
        optim.init_sharded(full_init, params, zero_axes=("dp",))


def test_grads_that_are_dtensors_need_dtensor_state(sim):
    sim(4)
    mesh = vsf.make_mesh((4,), ("dp",))
    params = {"w": torch.randn(4, 4)}
    tx = optim.adam()
    state = tx.init(params)
    grads = vsf.device_put(params, NamedSharding(mesh, P("dp")))
    with pytest.raises(ValueError, match="updates leaf w is a DTensor but what it lines up with .* is a plain tensor"):
        tx.update(grads, state)


def test_multi_steps_with_zero_state_matches_hand_accumulation(sim):
    sim(4)
    mesh = vsf.make_mesh((4,), ("dp",))
    params = _params()
    grads = _grads(params, 6)
    tx = optim.multi_steps(optim.adam(1e-2), every_k=3)
    placed = vsf.device_put(params, NamedSharding(mesh, P()))
    state = optim.init_sharded(tx, placed, zero_axes=("dp",))
    for g in grads:
        updates, state = tx.update(vsf.device_put(g, NamedSharding(mesh, P(unreduced=("dp",)))), state, placed)
        placed = optim.apply_updates(placed, updates)
    assert vsf.typeof(state.acc_grads["w"]) == "f32[16@dp,8]" and vsf.typeof(state.mini_step) == "i32[]"
    means = [{n: sum(grads[i + j][n] for j in range(3)) / 3 for n in params} for i in (0, 3)]
    want = run_torch(torch.optim.Adam, dict(lr=1e-2), params, means)
    full = vsf.device_get(placed)
    for k in params:
        torch.testing.assert_close(full[k], want[k], rtol=1e-5, atol=1e-6)


# -- in real gloo processes --------------------------------------------------------------------
# vsf.optim in real gloo processes (tier 3): ZeRO stage 2 under torchrun equals torch.optim on one device.

NPROC = 2


@pytest.fixture(scope="module")
def ranks(world):
    return world("optim_zero.py", nproc=NPROC)


@pytest.mark.world("optim_zero.py", nproc=NPROC)
@pytest.mark.multiprocess
def test_zero2_under_torchrun_matches_torch(ranks):
    torch.manual_seed(0)  # the worker's seed and draw order
    params = {"w": torch.randn(8, 6), "b": torch.randn(5), "e": torch.randn(4, 4)}
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(5)]
    want = run_torch(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), params, grads, mask=MASK, clip=1.0)
    for r in ranks:
        for k in params:
            torch.testing.assert_close(torch.tensor(r["params"][k]), want[k], **TOL)


@pytest.mark.world("optim_zero.py", nproc=NPROC)
@pytest.mark.multiprocess
def test_each_rank_holds_only_its_state_shard(ranks):
    # mu and nu for w (8x6), b (5, split 3 + 2), e (4x4) over 2 ranks, plus the int32 count
    expected = [4 * 2 * (24 + 3 + 8) + 4, 4 * 2 * (24 + 2 + 8) + 4]
    assert [r["bytes"] for r in ranks] == [{str(i): expected[i]} for i in range(NPROC)]
    assert [len(r["mu_b_local"]) for r in ranks] == [3, 2]
