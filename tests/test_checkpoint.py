"""vsf.checkpoint across real processes (tier 3), and what a damaged checkpoint does.

This process saves the test tree whole; one 4-rank run loads it on mesh (dp=2, tp=2), saves the
tree sharded there and checks async saves and resume; one
2-rank run loads it onto mesh (x=2) with other specs, saves its own, and dies mid-save (rank 1
SIGKILLs itself). This process then loads both checkpoints whole (one process, no mesh) and
damages copies of them. The oracle everywhere is the full values regenerated from key paths.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex

import vsf
from multiproc import WORKERS, results, torchrun

sys.path.insert(0, str(WORKERS))
import ckpt_common as cc  # noqa: E402  (the workers' module, under the name their pickled trees use)

pytestmark = pytest.mark.multiprocess

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


def test_load_as_saved_on_the_same_mesh(runs):
    _, r4, _, _ = runs
    assert [r["as_saved_mismatches"] for r in r4] == [[]] * 4
    assert all(r["as_saved_same_layout"] for r in r4)


def test_reshard_1_process_to_4_ranks(runs):
    _, r4, _, _ = runs
    assert [r["from_one_mismatches"] for r in r4] == [[]] * 4
    assert all(r["from_one_layout_as_target"] for r in r4)


def test_async_save_keeps_values_from_before_the_mutation(runs):
    _, r4, _, _ = runs
    assert all(r["async_mutated_differs"] for r in r4)
    assert [r["async_mismatches"] for r in r4] == [[]] * 4


def test_resume_is_bitwise_identical(runs):
    _, r4, _, _ = runs
    for r in r4:
        continued, resumed = r["resume_losses"]
        assert continued == resumed and len(set(continued)) == 3
        assert r["resume_params_equal"] and r["resume_layout_equal"]
        assert r["resume_saved_flags"] == [False, True]


def test_manager_interval_and_retention(runs):
    _, r4, _, _ = runs
    for r in r4:
        assert r["interval_saved"] == [False, True, True]
        assert r["steps_after_9"] == [6, 9]
        assert r["forced_saved"] and r["steps_after_forced_5"] == [5, 9] and r["latest_step"] == 9


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
            held = {rank: set(sharding.index_view(ids)[sharding.index(shape, rank)].flatten().tolist()) for rank in range(4)}
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


def test_reshard_4_ranks_to_2(runs):
    _, _, r2, _ = runs
    for r in r2:
        assert r["structs_mismatches"] == [] and r["structs_layout_as_target"]
        assert r["eval_shape_opt_is_struct"] and r["eval_shape_opt_equals_target"] and r["eval_shape_mismatches"] == []
        assert r["live_mismatches"] == [] and r["live_layout_as_target"] and r["live_untouched"]


def test_no_target_on_another_mesh_size_names_both(runs):
    _, _, r2, _ = runs
    message = r2[0]["no_target_error"]
    assert message.startswith("ValueError") and "{'dp': 2, 'tp': 2} (4 ranks)" in message and "2 rank(s)" in message
    assert f"and {3 * len(cc.PARAMS) - 4} more" in message  # every leaf of that mesh, counted


# -- 1 process, unsharded ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "b", "async"])
def test_load_whole_in_one_process(runs, name):
    out, _, _, _ = runs
    loaded = vsf.checkpoint.load(out / name, UNSHARDED)
    assert cc.mismatches(loaded) == []
    assert all(type(x) is torch.Tensor for x in vsf.tree.leaves(loaded) if isinstance(x, torch.Tensor))


def test_dcp_alone_reads_the_ragged_leaves_whole(runs, tmp_path):
    """The checkpoint is plain DCP: DCP's own converter, which knows nothing of vsf, gets every
    ragged leaf whole, from the chunks each rank wrote."""
    out, _, _, _ = runs
    dcp_to_torch_save(out / "a", tmp_path / "a.pt")
    flat = torch.load(tmp_path / "a.pt", weights_only=True)
    expected = {vsf.tree.keystr(p): x for p, x in vsf.tree.leaves_with_path(cc.oracle())}
    ragged = [f"{prefix}.{name}" for prefix in ("params", "opt.mu", "opt.nu") for name, (*_, spec, _) in cc.PARAMS.items() if spec.ragged]
    assert len(ragged) == 9
    for key in ragged:
        assert flat[key].dtype == expected[key].dtype and torch.equal(flat[key], expected[key]), key


# -- a rank killed mid-save -------------------------------------------------------------------


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


def test_flipped_byte_names_file_and_leaf(damaged):
    name, offset, length = cc.payload_of(damaged, "opt.nu.w2")
    cc.flip(damaged / name, offset + length // 2)
    with pytest.raises(vsf.checkpoint.CorruptCheckpointError) as e:
        vsf.checkpoint.load(damaged, UNSHARDED)
    assert name in str(e.value) and "opt.nu.w2" in str(e.value) and "fail their checksum" in str(e.value)


def test_truncated_file_names_file(damaged):
    name, _, _ = cc.payload_of(damaged, "params.w1")
    data = (damaged / name).read_bytes()
    (damaged / name).write_bytes(data[: len(data) - 100])
    with pytest.raises(vsf.checkpoint.CorruptCheckpointError, match=rf"{name} has {len(data) - 100} bytes, but {len(data)} were written"):
        vsf.checkpoint.load(damaged, UNSHARDED)


@pytest.mark.parametrize("name", [".metadata", "tree.json"])
def test_damaged_metadata_files_are_named(damaged, name):
    cc.flip(damaged / name, (damaged / name).stat().st_size // 2)
    with pytest.raises(vsf.checkpoint.CorruptCheckpointError, match=rf"{name}.*(checksum|damaged)"):
        vsf.checkpoint.load(damaged, UNSHARDED)


def test_damaged_marker(damaged):
    marker = damaged / "COMMITTED"
    marker.write_text(marker.read_text().replace('"size": ', '"size": 1', 1))
    with pytest.raises(vsf.checkpoint.CorruptCheckpointError, match="commit marker is damaged"):
        vsf.checkpoint.load(damaged)


def test_unknown_format_version(damaged):
    marker = damaged / "COMMITTED"
    body = json.loads(marker.read_text())
    body["contents"]["format_version"] = 99
    body["crc32"] = zlib.crc32(json.dumps(body["contents"], sort_keys=True, separators=(",", ":")).encode())
    marker.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=f"format version 99.*reads version {vsf.checkpoint.FORMAT_VERSION} only"):
        vsf.checkpoint.load(damaged)


def test_missing_marker_or_path(damaged):
    (damaged / "COMMITTED").unlink()
    with pytest.raises(vsf.checkpoint.NotACheckpointError, match="no COMMITTED marker"):
        vsf.checkpoint.load(damaged)
    with pytest.raises(vsf.checkpoint.NotACheckpointError, match="does not exist"):
        vsf.checkpoint.load(damaged / "nope")
