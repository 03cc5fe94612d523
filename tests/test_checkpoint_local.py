"""vsf.checkpoint in one process: simulated ranks (tier 1) and plain tensors; errors; the manager.

Under ``vsf.simulate`` DCP cannot run (its collectives are not SPMD), so vsf saves the gathered
full tensors from this one process and lays loaded ones out with ``device_put``; these tests
check that path against the same oracle as the real-process tests: values regenerated from key
paths.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import vsf
from multiproc import WORKERS
from vsf import P
from vsf.checkpoint import ragged
from vsf.checkpoint.checksum import BLOCK
from vsf.checkpoint.storage import _PARALLEL_READ

sys.path.insert(0, str(WORKERS))
import ckpt_common as cc  # noqa: E402


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
                (leaf.to_local() if isinstance(leaf, torch.distributed.tensor.DTensor) else leaf).add_(1.0)  # ragged DTensors have no ops
        handle.wait()
        assert handle.done() and "committed" in repr(handle)
        assert cc.mismatches(vsf.checkpoint.load(tmp_path / "c")) == []


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
    namespace = {"ShapeDtypeStruct": vsf.ShapeDtypeStruct, "NamedSharding": vsf.NamedSharding, "Mesh": vsf.Mesh, "P": P, "torch": torch}
    assert eval(repr(s), namespace) == s and hash(eval(repr(s), namespace)) == hash(s)
    assert (s.ndim, s.nbytes) == (2, 96)
    assert s != vsf.ShapeDtypeStruct((8, 6), torch.bfloat16)
    with pytest.raises(AttributeError, match="immutable"):
        s.shape = (1,)
    x = vsf.device_put(torch.zeros(8, 6, dtype=torch.bfloat16), s.sharding)
    assert vsf.ShapeDtypeStruct.like(x) == s and vsf.ShapeDtypeStruct.like(s) is s


@pytest.mark.parametrize(
    "args, error",
    [(((2, -1), torch.float32), ValueError), (((2,), "float32"), TypeError), (((2,), torch.float32, P("x")), TypeError)],
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
    expected = vsf.tree.map(lambda x: vsf.ShapeDtypeStruct.like(x) if isinstance(x, torch.Tensor) else x, _adam_like_init(params))
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
        ({"step": 0, "w": vsf.ShapeDtypeStruct((2,), torch.float32), "x": 1}, r"the target has a leaf at x that the checkpoint lacks"),
        ({"step": 0, "w": vsf.ShapeDtypeStruct((3,), torch.float32)}, r"w: the checkpoint holds torch.float32 of shape \(2,\), but the target asks for torch.float32 of shape \(3,\)"),
        ({"step": 0, "w": vsf.ShapeDtypeStruct((2,), torch.float16)}, r"w: .* but the target asks for torch.float16"),
        ({"step": vsf.ShapeDtypeStruct((), torch.int64), "w": torch.zeros(2)}, r"step: the checkpoint holds a int there, but the target asks for a tensor"),
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
    tree = {"small": torch.arange(5), "big": torch.randn(blocks * BLOCK // 4 + 1000), "after": torch.ones(3)}  # blocks + 1 blocks
    _save(tmp_path / "c", tree)
    assert cc.mismatches(vsf.checkpoint.load(tmp_path / "c"), tree) == []
    name, offset, length = cc.payload_of(tmp_path / "c", "big")
    assert length > blocks * BLOCK
    for i, where in enumerate([offset + 100, offset + BLOCK + 5, offset + length // 2, offset + length - 100]):
        damaged = Path(shutil.copytree(tmp_path / "c", tmp_path / f"d{i}"))
        cc.flip(damaged / name, where)
        with pytest.raises(vsf.checkpoint.CorruptCheckpointError, match=rf"{name}: bytes \d+\.\.\d+ fail their checksum.* leaves big \(found by rank 0\)$"):
            vsf.checkpoint.load(damaged)


def test_bad_leaves_are_refused_before_anything_is_written(tmp_path, sim):
    with pytest.raises(TypeError, match=r"cannot save the leaf at \['opt'\]\[0\]: a object"):
        vsf.checkpoint.save(tmp_path / "c", {"opt": [object()]})
    sim(2)
    mesh = vsf.make_mesh((2,), ("x",))
    partial = vsf.device_put(torch.ones(4), vsf.NamedSharding(mesh, P()))
    partial = torch.distributed.tensor.DTensor.from_local(partial.to_local(), mesh.device_mesh, [torch.distributed.tensor.Partial()])
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
        ((2, 3, 5, 2), P(vsf.ragged("dp", (7, 0, 16, 7), dims=3), None, None, "tp")),  # partial rows at both ends, an empty rank
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
        boxes = ragged.boxes(s, shape, rank)
        assert len(boxes) <= 2 * spec.ragged.dims - 1 and all(math.prod(b.sizes) for b in boxes) or math.prod(shape) == 0
        got = [ids[tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))].flatten() for b in boxes]
        assert torch.equal(torch.cat(got) if got else local[:0].flatten(), local.flatten()), rank  # every row, in order
        for b, g in zip(boxes, got):
            assert torch.equal(local[b.rows[0] : b.rows[1]].flatten(), g), (rank, b)
