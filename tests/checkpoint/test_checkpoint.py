"""vsf.checkpoint: simulated ranks (tier 1) and plain tensors in one process, errors, the manager;
real processes (tier 3, ``multiprocess``) and damaged checkpoints; CUDA (tier 4, ``cuda``).

Under ``vsf.simulate`` DCP cannot run (its collectives are not SPMD), so vsf saves the gathered
full tensors from this one process and lays loaded ones out with ``device_put``; these tests
check that path against the same oracle as the real-process tests: values regenerated from key
paths.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex

import vsf
from vsf import P
from vsf.checkpoint import boxes as ckpt_boxes
from vsf.checkpoint.checksum import BLOCK
from vsf.checkpoint.storage import _PARALLEL_READ
from multiproc import WORKERS, results, torchrun

sys.path.insert(0, str(WORKERS))
import ckpt_common as cc  # noqa: E402  (the workers' module, under the name their pickled trees use)


def _save_a(path):
    with vsf.simulate(4):
        mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
        vsf.checkpoint.save(path, cc.build(mesh, "A", cc.real))


@pytest.fixture(scope="module")
def saved_a(tmp_path_factory):
    """The test tree in layout A, saved from 4 simulated ranks."""
    path = tmp_path_factory.mktemp("sim") / "a"
    _save_a(path)
    return path


# -- simulated ranks ----------------------------------------------------------------------------


def test_simulated_round_trip_as_saved(saved_a):
    with vsf.simulate(4):
        mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
        loaded = vsf.checkpoint.load(saved_a)
        assert cc.mismatches(loaded) == []
        assert cc.layouts(loaded) == cc.layouts(cc.build(mesh, "A", cc.abstract))


def test_simulated_reshard_to_fewer_ranks_and_to_one_process(saved_a):
    with vsf.simulate(2):
        target = cc.build(vsf.make_mesh((2,), ("x",)), "B", cc.abstract)
        loaded = vsf.checkpoint.load(saved_a, target)
        assert cc.mismatches(loaded) == [] and cc.layouts(loaded) == cc.layouts(target)
    assert cc.mismatches(vsf.checkpoint.load(saved_a, cc.build(None, "A", cc.abstract))) == []


def test_simulated_async_save_snapshots(tmp_path):
    with vsf.simulate(4):
        mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
        tree = cc.build(mesh, "A", cc.real)
        handle = vsf.checkpoint.save(tmp_path / "c", tree, blocking=False)
        for leaf in vsf.tree.leaves(tree):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                (leaf.to_local() if isinstance(leaf, torch.distributed.tensor.DTensor) else leaf).add_(
                    1.0
                )  # ragged DTensors have no ops
        handle.wait()
        assert handle.done() and "committed" in repr(handle)
        assert cc.mismatches(vsf.checkpoint.load(tmp_path / "c")) == []


def test_a_packed_leaf_comes_back_packed_as_saved_and_whole_onto_a_plain_layout(tmp_path):
    """A fused ``gate_up`` packed over tp (each rank its slice of gate and of up): loaded as saved
    it has its values and its packed layout; loaded onto a contiguous split, and into one process,
    its values."""
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    with vsf.simulate(4):
        mesh = vsf.make_mesh((2, 2), ("ep", "tp"))
        packed = vsf.NamedSharding(mesh, P("ep", vsf.packed("tp", 2), None))
        vsf.checkpoint.save(tmp_path / "c", {"gate_up": vsf.device_put(w, packed)})
        back = vsf.checkpoint.load(tmp_path / "c")["gate_up"]
        assert vsf.sharding.sharding_of(back) == packed
        torch.testing.assert_close(vsf.device_get(back), w, rtol=0, atol=0)
        plain = vsf.ShapeDtypeStruct(w.shape, w.dtype, sharding=vsf.NamedSharding(mesh, P("ep", "tp")))
        onto = vsf.checkpoint.load(tmp_path / "c", {"gate_up": plain})["gate_up"]
        assert vsf.sharding.sharding_of(onto) == plain.sharding
        torch.testing.assert_close(vsf.device_get(onto), w, rtol=0, atol=0)
    whole = vsf.checkpoint.load(tmp_path / "c", {"gate_up": vsf.ShapeDtypeStruct(w.shape, w.dtype)})["gate_up"]
    torch.testing.assert_close(whole, w, rtol=0, atol=0)


def test_planning_only_simulation_has_no_values_to_save(tmp_path):
    with vsf.simulate(4, compute=False):
        mesh = vsf.make_mesh((4,), ("x",))
        x = vsf.device_put(torch.zeros(8), vsf.NamedSharding(mesh, P("x")))
        with pytest.raises(RuntimeError, match="needs values"):
            vsf.checkpoint.save(tmp_path / "c", {"x": x})
    assert not (tmp_path / "c").exists()


# -- ShapeDtypeStruct and eval_shape ------------------------------------------------------------


def test_shape_dtype_struct_is_a_value(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    s = vsf.ShapeDtypeStruct((8, 6), torch.bfloat16, vsf.NamedSharding(mesh, P("dp", ("tp",))))
    namespace = {
        "ShapeDtypeStruct": vsf.ShapeDtypeStruct,
        "NamedSharding": vsf.NamedSharding,
        "Mesh": vsf.Mesh,
        "P": P,
        "torch": torch,
    }
    assert eval(repr(s), namespace) == s and hash(eval(repr(s), namespace)) == hash(s)
    assert (s.ndim, s.nbytes) == (2, 96)
    assert s != vsf.ShapeDtypeStruct((8, 6), torch.bfloat16)
    with pytest.raises(AttributeError, match="immutable"):
        s.shape = (1,)
    x = vsf.device_put(torch.zeros(8, 6, dtype=torch.bfloat16), s.sharding)
    assert vsf.ShapeDtypeStruct.like(x) == s and vsf.ShapeDtypeStruct.like(s) is s


@pytest.mark.parametrize(
    "args, error",
    [
        (((2, -1), torch.float32), ValueError),
        (((2,), "float32"), TypeError),
        (((2,), torch.float32, P("x")), TypeError),
    ],
)
def test_shape_dtype_struct_rejects_bad_fields(args, error):
    with pytest.raises(error, match="ShapeDtypeStruct"):
        vsf.ShapeDtypeStruct(*args)


def _adam_like_init(params: dict[str, torch.Tensor]) -> Any:
    return {
        "mu": vsf.tree.map(torch.zeros_like, params),
        "count": torch.zeros([], dtype=torch.int32),
        "col_sums": params["w"].sum(0),
        "gram": params["w"].T @ params["w"],
        "lr": 0.1,
    }


def test_eval_shape_matches_the_real_outputs_with_their_shardings(sim):
    sim(4)
    mesh = vsf.make_mesh((2, 2), ("dp", "tp"))
    params = vsf.device_put(
        {"w": torch.randn(8, 6), "b": torch.randn(6)},
        {"w": vsf.NamedSharding(mesh, P("dp", "tp")), "b": vsf.NamedSharding(mesh, P())},
    )
    expected = vsf.tree.map(
        lambda x: vsf.ShapeDtypeStruct.like(x) if isinstance(x, torch.Tensor) else x, _adam_like_init(params)
    )
    assert vsf.eval_shape(_adam_like_init, params) == expected
    abstract = vsf.tree.map(vsf.ShapeDtypeStruct.like, params)
    assert vsf.eval_shape(_adam_like_init, abstract) == expected
    assert expected["col_sums"].sharding.spec.unreduced == ("dp",)  # the oracle is not trivial


def test_eval_shape_allocates_nothing():
    huge = vsf.eval_shape(lambda n: {"x": torch.zeros(n, 1 << 30, dtype=torch.uint8), "n": n}, 1 << 10)  # 1 TiB
    assert huge == {"x": vsf.ShapeDtypeStruct((1 << 10, 1 << 30), torch.uint8), "n": 1 << 10}
    s = vsf.ShapeDtypeStruct((1 << 20, 1 << 20), torch.float32)
    assert vsf.eval_shape(lambda a: a @ a, s) == s


# -- plain tensors in one process ------------------------------------------------------------------


class Pair(NamedTuple):
    first: Any
    second: Any


@vsf.tree.register_dataclass
@dataclasses.dataclass
class Box:
    value: Any
    note: str


def test_plain_round_trip_of_every_leaf_kind(tmp_path):
    tree = {
        "pair": Pair(torch.arange(6).reshape(2, 3), Box(torch.tensor([1.5, -2.0], dtype=torch.float64), "n")),
        "scalars": [0, -(1 << 70), 2.5, float("inf"), True, "text", None],
        "a.b": torch.ones(2),
        "a": {"b": torch.zeros(3)},  # renders like "a.b" above: keys must still be told apart
        "empty": torch.zeros(0, 4),
    }
    vsf.checkpoint.save(tmp_path / "c", tree)
    back = vsf.checkpoint.load(tmp_path / "c")
    assert vsf.tree.structure(back) == vsf.tree.structure(tree)
    assert cc.mismatches(back, tree) == []
    assert math.isnan(vsf.checkpoint.load(_save(tmp_path / "nan", {"x": float("nan")}))["x"])


def _save(path, tree):
    vsf.checkpoint.save(path, tree)
    return path


def test_target_values_come_from_the_checkpoint(tmp_path):
    _save(tmp_path / "c", {"step": 100, "name": "run", "w": torch.ones(2)})
    back = vsf.checkpoint.load(tmp_path / "c", {"step": 0, "name": "", "w": vsf.ShapeDtypeStruct((2,), torch.float32)})
    assert back["step"] == 100 and back["name"] == "run" and torch.equal(back["w"], torch.ones(2))


@pytest.mark.parametrize(
    "target, message",
    [
        ({"w": vsf.ShapeDtypeStruct((2,), torch.float32)}, r"the checkpoint has a leaf at step that the target lacks"),
        (
            {"step": 0, "w": vsf.ShapeDtypeStruct((2,), torch.float32), "x": 1},
            r"the target has a leaf at x that the checkpoint lacks",
        ),
        (
            {"step": 0, "w": vsf.ShapeDtypeStruct((3,), torch.float32)},
            r"w: the checkpoint holds torch.float32 of shape \(2,\), but the target asks for torch.float32 of shape \(3,\)",
        ),
        ({"step": 0, "w": vsf.ShapeDtypeStruct((2,), torch.float16)}, r"w: .* but the target asks for torch.float16"),
        (
            {"step": vsf.ShapeDtypeStruct((), torch.int64), "w": torch.zeros(2)},
            r"step: the checkpoint holds a int there, but the target asks for a tensor",
        ),
        ({"step": 0, "w": 0.0}, r"w: the checkpoint holds a tensor there, but the target has a float"),
    ],
)
def test_target_mismatch_names_the_leaf(tmp_path, target, message):
    _save(tmp_path / "c", {"step": 100, "w": torch.ones(2)})
    with pytest.raises(ValueError, match=message):
        vsf.checkpoint.load(tmp_path / "c", target)


def test_nothing_is_written_into_a_live_target_when_loading_fails(tmp_path):
    _save(tmp_path / "c", {"w": torch.arange(1000.0)})
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    live = {"w": torch.full((1000,), 7.0)}
    with pytest.raises(vsf.checkpoint.CorruptCheckpointError, match=r"__0_0.distcp: .* fail their checksum.* leaves w"):
        vsf.checkpoint.load(tmp_path / "c", live)
    assert torch.equal(live["w"], torch.full((1000,), 7.0))


@pytest.mark.parametrize("blocks", [3, _PARALLEL_READ // BLOCK + 1])  # checked as read / on a helper thread
def test_leaves_of_many_blocks_load_exactly_and_damage_in_any_block_names_the_leaf(tmp_path, blocks):
    tree = {
        "small": torch.arange(5),
        "big": torch.randn(blocks * BLOCK // 4 + 1000),
        "after": torch.ones(3),
    }  # blocks + 1 blocks
    _save(tmp_path / "c", tree)
    assert cc.mismatches(vsf.checkpoint.load(tmp_path / "c"), tree) == []
    name, offset, length = cc.payload_of(tmp_path / "c", "big")
    assert length > blocks * BLOCK
    for i, where in enumerate([offset + 100, offset + BLOCK + 5, offset + length // 2, offset + length - 100]):
        damaged = Path(shutil.copytree(tmp_path / "c", tmp_path / f"d{i}"))
        cc.flip(damaged / name, where)
        with pytest.raises(
            vsf.checkpoint.CorruptCheckpointError,
            match=rf"{name}: bytes \d+\.\.\d+ fail their checksum.* leaves big \(found by rank 0\)$",
        ):
            vsf.checkpoint.load(damaged)


def test_bad_leaves_are_refused_before_anything_is_written(tmp_path, sim):
    with pytest.raises(TypeError, match=r"cannot save the leaf at \['opt'\]\[0\]: a object"):
        vsf.checkpoint.save(tmp_path / "c", {"opt": [object()]})
    sim(2)
    mesh = vsf.make_mesh((2,), ("x",))
    partial = vsf.device_put(torch.ones(4), vsf.NamedSharding(mesh, P()))
    partial = torch.distributed.tensor.DTensor.from_local(
        partial.to_local(), mesh.device_mesh, [torch.distributed.tensor.Partial()]
    )
    with pytest.raises(ValueError, match=r"g is an unreduced partial sum over \('x',\)"):
        vsf.checkpoint.save(tmp_path / "c", {"g": partial})
    assert not (tmp_path / "c").exists()


def test_existing_path_is_never_overwritten(tmp_path):
    _save(tmp_path / "c", {"w": torch.ones(2)})
    with pytest.raises(FileExistsError, match="never overwrites"):
        vsf.checkpoint.save(tmp_path / "c", {"w": torch.zeros(2)})
    assert torch.equal(vsf.checkpoint.load(tmp_path / "c")["w"], torch.ones(2))


def test_progress_is_shown_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    _save(tmp_path / "quiet", {"w": torch.ones(1000)})
    vsf.checkpoint.load(tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    vsf.checkpoint.save(tmp_path / "loud", {"w": torch.ones(1000)}, progress=True)
    vsf.checkpoint.load(tmp_path / "loud", progress=True)
    err = capsys.readouterr().err
    assert f"saving {tmp_path / 'loud'}: " in err and f"loading {tmp_path / 'loud'}: " in err and "KB at" in err


# -- CheckpointManager ------------------------------------------------------------------------------


def test_manager_lists_only_committed_numbered_steps(tmp_path):
    mngr = vsf.checkpoint.CheckpointManager(tmp_path, max_to_keep=2)
    assert mngr.all_steps() == [] and mngr.latest_step() is None
    with pytest.raises(vsf.checkpoint.NotACheckpointError, match="holds no committed checkpoint"):
        mngr.restore()
    for step in (1, 2):
        assert mngr.save(step, {"w": torch.full((2,), float(step))}, blocking=False)
    mngr.wait()
    shutil.copytree(tmp_path / "2", tmp_path / "7")
    (tmp_path / "7" / "COMMITTED").unlink()  # as an interrupted save leaves it
    shutil.copytree(tmp_path / "2", tmp_path / "notes")
    shutil.copytree(tmp_path / "2", tmp_path / ".3.tmp-abc")
    assert mngr.all_steps() == [1, 2] and mngr.latest_step() == 2
    assert torch.equal(mngr.restore()["w"], torch.full((2,), 2.0))
    assert mngr.save(3, {"w": torch.zeros(2)})
    assert mngr.all_steps() == [2, 3] and not (tmp_path / ".3.tmp-abc").exists()


@pytest.mark.parametrize("kwargs", [{"max_to_keep": 0}, {"save_interval_steps": 0}])
def test_manager_rejects_bad_settings(tmp_path, kwargs):
    with pytest.raises(ValueError):
        vsf.checkpoint.CheckpointManager(tmp_path, **kwargs)


# -- ragged leaves as DCP chunks ----------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((12, 4), P(vsf.ragged("dp", (1, 2)), "tp")),
        ((3, 4, 2), P(vsf.ragged("tp", (1, 3), dims=2))),
        (
            (2, 3, 5, 2),
            P(vsf.ragged("dp", (7, 0, 16, 7), dims=3), None, None, "tp"),
        ),  # partial rows at both ends, an empty rank
        ((6, 4), P(vsf.ragged("tp", (1, 1)), "dp")),
        ((0, 3), P(vsf.ragged("dp", (1, 2)))),
    ],
)
def test_ragged_boxes_hold_exactly_each_ranks_rows_in_order(shape, spec):
    """The boxes DCP gets for a rank, read from the global tensor in order, are its local tensor."""
    dp = len(spec.ragged.units) if spec.ragged.axis == "dp" else 2
    mesh = vsf.Mesh((dp, 2), ("dp", "tp"))
    s = vsf.NamedSharding(mesh, spec)
    ids = torch.arange(math.prod(shape)).reshape(shape)
    for rank in mesh.devices:
        local = s.index_view(ids)[s.index(shape, rank)]  # the layout's own definition of the shard
        boxes = ckpt_boxes.leaf_boxes(s, shape, rank)
        assert (
            len(boxes) <= 2 * spec.ragged.dims - 1 and all(math.prod(b.sizes) for b in boxes) or math.prod(shape) == 0
        )
        got = [ids[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))].flatten() for b in boxes]
        assert torch.equal(torch.cat(got) if got else local[:0].flatten(), local.flatten()), rank  # every row, in order
        for b, g in zip(boxes, got):
            assert torch.equal(local[b.local].flatten(), g), (rank, b)


@pytest.mark.parametrize(
    "shape, spec",
    [
        ((12,), P(vsf.packed("tp", 3))),  # q, k, v of 4, each split over tp
        ((4, 12), P("dp", vsf.packed("tp", 3))),
        ((2, 8, 3), P(None, vsf.packed("tp", 2), "dp")),  # gate_up of experts
        ((8, 4), P(vsf.packed("dp", 2), vsf.packed("tp", 2))),  # two packed dims
        ((0, 6), P(None, vsf.packed("tp", 3))),
        ((2, 8, 4), P("dp", vsf.balanced("tp"))),  # a sequence split balanced for causal attention
        ((8, 6), P(vsf.balanced("dp"), "tp")),
    ],
)
def test_packed_and_balanced_boxes_hold_exactly_each_ranks_pieces(shape, spec):
    """The boxes DCP gets for a rank of a packed or balanced leaf, read from the global tensor,
    are the parts of its local tensor they name, and together the whole local tensor once."""
    mesh = vsf.Mesh((2, 2), ("dp", "tp"))
    s = vsf.NamedSharding(mesh, spec)
    ids = torch.arange(math.prod(shape)).reshape(shape)
    for rank in mesh.devices:
        local = s.index_view(ids)[s.index(shape, rank)]  # the layout's own definition of the shard
        boxes = ckpt_boxes.leaf_boxes(s, shape, rank)
        if local.numel() == 0:  # one empty box, so that DCP records the leaf
            assert [b.sizes for b in boxes] == [shape]
            continue
        assert sum(math.prod(b.sizes) for b in boxes) == local.numel(), rank
        seen = torch.zeros(local.shape, dtype=torch.int64)
        for b in boxes:
            box = ids[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))]
            assert torch.equal(local[b.local], box), (rank, b)
            seen[b.local] += 1
        assert bool((seen == 1).all()), rank


# -- across real processes ---------------------------------------------------------------------
# vsf.checkpoint across real processes (tier 3), and what a damaged checkpoint does.
#
# This process saves the test tree whole; one 4-rank run loads it on mesh (dp=2, tp=2), saves the
# tree sharded there and checks async saves and resume; one
# 2-rank run loads it onto mesh (x=2) with other specs, saves its own, and dies mid-save (rank 1
# SIGKILLs itself). This process then loads both checkpoints whole (one process, no mesh) and
# damages copies of them. The oracle everywhere is the full values regenerated from key paths.


UNSHARDED = cc.build(None, "A", cc.abstract)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    vsf.checkpoint.save(out / "one", cc.oracle())  # whole tensors from this one process, for 4 ranks to load
    torchrun(WORKERS / "ckpt_world4.py", 4, str(out))
    with pytest.raises(RuntimeError) as killed:
        torchrun(WORKERS / "ckpt_world2.py", 2, str(out))
    return out, results(out / "ckpt_world4-0", 4), results(out / "ckpt_world2-0", 2), str(killed.value)


# -- 4 ranks, mesh (2, 2) -------------------------------------------------------------------


@pytest.mark.multiprocess
def test_load_as_saved_on_the_same_mesh(runs):
    _, r4, _, _ = runs
    assert [r["as_saved_mismatches"] for r in r4] == [[]] * 4
    assert all(r["as_saved_same_layout"] for r in r4)


@pytest.mark.multiprocess
def test_reshard_1_process_to_4_ranks(runs):
    _, r4, _, _ = runs
    assert [r["from_one_mismatches"] for r in r4] == [[]] * 4
    assert all(r["from_one_layout_as_target"] for r in r4)


@pytest.mark.multiprocess
def test_async_save_keeps_values_from_before_the_mutation(runs):
    _, r4, _, _ = runs
    assert all(r["async_mutated_differs"] for r in r4)
    assert [r["async_mismatches"] for r in r4] == [[]] * 4


@pytest.mark.multiprocess
def test_resume_is_bitwise_identical(runs):
    _, r4, _, _ = runs
    for r in r4:
        continued, resumed = r["resume_losses"]
        assert continued == resumed and len(set(continued)) == 3
        assert r["resume_params_equal"] and r["resume_layout_equal"]
        assert r["resume_saved_flags"] == [False, True]


@pytest.mark.multiprocess
def test_manager_interval_and_retention(runs):
    _, r4, _, _ = runs
    for r in r4:
        assert r["interval_saved"] == [False, True, True]
        assert r["steps_after_9"] == [6, 9]
        assert r["forced_saved"] and r["steps_after_forced_5"] == [5, 9] and r["latest_step"] == 9


@pytest.mark.multiprocess
def test_each_rank_wrote_only_its_own_shards_and_replicas_once(runs):
    """Every chunk DCP recorded holds only elements its writer holds (ragged leaves included: saved as
    they are), and the chunks of a leaf hold each element exactly once (replicas written once)."""
    out, _, _, _ = runs
    md = FileSystemReader(out / "a").read_metadata()
    mesh = vsf.Mesh((2, 2), ("dp", "tp"))
    checked = 0
    for prefix in ("params", "opt.mu", "opt.nu"):
        for name, (shape, _, spec, _) in cc.PARAMS.items():
            key = f"{prefix}.{name}"
            sharding = vsf.NamedSharding(mesh, spec)
            ids = torch.arange(math.prod(shape)).reshape(shape)  # element -> its flat index
            held = {
                rank: set(sharding.index_view(ids)[sharding.index(shape, rank)].flatten().tolist()) for rank in range(4)
            }
            written = []
            for chunk in md.state_dict_metadata[key].chunks:
                writer = int(md.storage_data[MetadataIndex(key, chunk.offsets)].relative_path.split("_")[2])
                elements = ids[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))].flatten().tolist()
                assert set(elements) <= held[writer], (key, chunk, writer)
                written += elements
                checked += 1
            assert sorted(written) == ids.flatten().tolist(), key
    assert checked > 60
    for key in ("opt.count", "meta.mask"):  # plain tensors: every rank holds them, one writes them
        assert len(md.state_dict_metadata[key].chunks) == 1


# -- 2 ranks, mesh (2,), other specs ----------------------------------------------------------


@pytest.mark.multiprocess
def test_reshard_4_ranks_to_2(runs):
    _, _, r2, _ = runs
    for r in r2:
        assert r["structs_mismatches"] == [] and r["structs_layout_as_target"]
        assert r["eval_shape_opt_is_struct"] and r["eval_shape_opt_equals_target"] and r["eval_shape_mismatches"] == []
        assert r["live_mismatches"] == [] and r["live_layout_as_target"] and r["live_untouched"]


@pytest.mark.multiprocess
def test_no_target_on_another_mesh_size_names_both(runs):
    _, _, r2, _ = runs
    message = r2[0]["no_target_error"]
    assert message.startswith("ValueError") and "{'dp': 2, 'tp': 2} (4 ranks)" in message and "2 rank(s)" in message
    assert f"and {3 * len(cc.PARAMS) - 4} more" in message  # every leaf of that mesh, counted


# -- 1 process, unsharded ---------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["a", "b", "async"])
def test_load_whole_in_one_process(runs, name):
    out, _, _, _ = runs
    loaded = vsf.checkpoint.load(out / name, UNSHARDED)
    assert cc.mismatches(loaded) == []
    assert all(type(x) is torch.Tensor for x in vsf.tree.leaves(loaded) if isinstance(x, torch.Tensor))


@pytest.mark.multiprocess
def test_dcp_alone_reads_the_ragged_leaves_whole(runs, tmp_path):
    """The checkpoint is plain DCP: DCP's own converter, which knows nothing of vsf, gets every
    ragged leaf whole, from the chunks each rank wrote."""
    out, _, _, _ = runs
    dcp_to_torch_save(out / "a", tmp_path / "a.pt")
    flat = torch.load(tmp_path / "a.pt", weights_only=True)
    expected = {vsf.tree.keystr(p): x for p, x in vsf.tree.leaves_with_path(cc.oracle())}
    ragged = [
        f"{prefix}.{name}"
        for prefix in ("params", "opt.mu", "opt.nu")
        for name, (*_, spec, _) in cc.PARAMS.items()
        if spec.ragged
    ]
    assert len(ragged) == 9
    for key in ragged:
        assert flat[key].dtype == expected[key].dtype and torch.equal(flat[key], expected[key]), key


# -- a rank killed mid-save -------------------------------------------------------------------


@pytest.mark.multiprocess
def test_killed_rank_leaves_previous_step_loadable_and_partial_one_ignored(runs):
    out, _, r2, failure = runs
    assert "exitcode  : -9" in failure  # rank 1 really died by SIGKILL
    assert [r["steps_before_kill"] for r in r2] == [[1], [1]]
    mngr = vsf.checkpoint.CheckpointManager(out / "run2")
    assert mngr.all_steps() == [1]
    assert cc.mismatches(mngr.restore(target=cc.build(None, "B", cc.abstract)), cc.oracle(step=1)) == []
    partial = [p for p in (out / "run2").iterdir() if p.name.startswith(".2.tmp-")]
    assert len(partial) == 1 and any(partial[0].iterdir())  # the kill came after files were started
    with pytest.raises(vsf.checkpoint.NotACheckpointError, match="no COMMITTED marker"):
        vsf.checkpoint.load(partial[0])
    with pytest.raises(vsf.checkpoint.NotACheckpointError):
        mngr.restore(2)
    mngr.save(2, cc.oracle(step=2))  # a new save of the same step clears the debris
    assert mngr.all_steps() == [1, 2] and not partial[0].exists()
    assert cc.mismatches(mngr.restore(2, UNSHARDED), cc.oracle(step=2)) == []


# -- damaged files ----------------------------------------------------------------------------


@pytest.fixture
def damaged(runs, tmp_path):
    """A fresh copy of checkpoint ``a`` to damage."""
    out, _, _, _ = runs
    return Path(shutil.copytree(out / "a", tmp_path / "a"))


@pytest.mark.multiprocess
def test_flipped_byte_names_file_and_leaf(damaged):
    name, offset, length = cc.payload_of(damaged, "opt.nu.w2")
    cc.flip(damaged / name, offset + length // 2)
    with pytest.raises(vsf.checkpoint.CorruptCheckpointError) as e:
        vsf.checkpoint.load(damaged, UNSHARDED)
    assert name in str(e.value) and "opt.nu.w2" in str(e.value) and "fail their checksum" in str(e.value)


@pytest.mark.multiprocess
def test_truncated_file_names_file(damaged):
    name, _, _ = cc.payload_of(damaged, "params.w1")
    data = (damaged / name).read_bytes()
    (damaged / name).write_bytes(data[: len(data) - 100])
    with pytest.raises(
        vsf.checkpoint.CorruptCheckpointError,
        match=rf"{name} has {len(data) - 100} bytes, but {len(data)} were written",
    ):
        vsf.checkpoint.load(damaged, UNSHARDED)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [".metadata", "tree.json"])
def test_damaged_metadata_files_are_named(damaged, name):
    cc.flip(damaged / name, (damaged / name).stat().st_size // 2)
    with pytest.raises(vsf.checkpoint.CorruptCheckpointError, match=rf"{name}.*(checksum|damaged)"):
        vsf.checkpoint.load(damaged, UNSHARDED)


@pytest.mark.multiprocess
def test_damaged_marker(damaged):
    marker = damaged / "COMMITTED"
    marker.write_text(marker.read_text().replace('"size": ', '"size": 1', 1))
    with pytest.raises(vsf.checkpoint.CorruptCheckpointError, match="commit marker is damaged"):
        vsf.checkpoint.load(damaged)


@pytest.mark.multiprocess
def test_unknown_format_version(damaged):
    marker = damaged / "COMMITTED"
    body = json.loads(marker.read_text())
    body["contents"]["format_version"] = 99
    body["crc32"] = zlib.crc32(json.dumps(body["contents"], sort_keys=True, separators=(",", ":")).encode())
    marker.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=f"format version 99.*reads version {vsf.checkpoint.FORMAT_VERSION} only"):
        vsf.checkpoint.load(damaged)


@pytest.mark.multiprocess
def test_missing_marker_or_path(damaged):
    (damaged / "COMMITTED").unlink()
    with pytest.raises(vsf.checkpoint.NotACheckpointError, match="no COMMITTED marker"):
        vsf.checkpoint.load(damaged)
    with pytest.raises(vsf.checkpoint.NotACheckpointError, match="does not exist"):
        vsf.checkpoint.load(damaged / "nope")


# -- on CUDA -----------------------------------------------------------------------------------
# Checkpoints on CUDA (tier 4): plain tensor leaves come back where the target says, not always on the CPU.
#
# One process, a one-rank CUDA mesh; skipped without a GPU.


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_plain_leaves_follow_the_live_target_else_the_meshes_device(tmp_path):
    mesh = vsf.make_mesh((1,), ("x",), device_type="cuda")
    tree = {
        "w": vsf.device_put(torch.randn(4, 3), vsf.NamedSharding(mesh, P("x"))),
        "b": torch.randn(3, device="cuda"),
        "step": 7,
    }
    vsf.checkpoint.save(tmp_path / "c", tree)
    as_saved = vsf.checkpoint.load(tmp_path / "c")
    assert as_saved["b"].device.type == "cuda" and as_saved["w"].to_local().device.type == "cuda"
    abstract = vsf.tree.map(lambda x: vsf.ShapeDtypeStruct.like(x) if isinstance(x, torch.Tensor) else x, tree)
    assert vsf.checkpoint.load(tmp_path / "c", abstract)["b"].device.type == "cuda"  # the target's mesh is on CUDA
    on_cpu = vsf.checkpoint.load(tmp_path / "c", dict(abstract, b=torch.zeros(3)))  # a live CPU tensor: the CPU
    assert on_cpu["b"].device.type == "cpu"
    for loaded in (as_saved, on_cpu):
        assert torch.equal(loaded["b"].cpu(), tree["b"].cpu()) and torch.equal(
            vsf.device_get(loaded["w"]).cpu(), vsf.device_get(tree["w"]).cpu()
        )
