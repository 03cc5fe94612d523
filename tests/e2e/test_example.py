"""examples/train_gpt.py end to end, run the way a user runs it (as a script, and under the launcher).

* 8 ranks simulated in one process train a small GPT for 50 steps: the loss falls, and every
  step's loss equals (fp tolerance) the same run in one plain process (one rank, no simulation).
* Sequences split over ``cp`` (4 simulated ranks, ``--cp 2`` with dp and with tp) give the
  one-process losses too.
* Two pipeline stages (``--pp 2`` with ``--dp 2``, with ``--tp 2`` and with ``--cp 2``, 4 simulated
  ranks, 1F1B and GPipe over 4 microbatches) give the losses of ``--pp 1`` in one process.
* The same run on 2 real gloo processes, started with ``python -m vsf.launch``, is killed with
  SIGKILL once a checkpoint is committed; ``--resume`` continues from that checkpoint, repeats
  the steps the killed run took after it bit for bit, and ends with the uninterrupted losses.

The simulated run takes most of the time (every op runs once per simulated rank), so it and the
one-process run start in the background when the module starts and overlap with the
multi-process test: CI has 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import vsf

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"
sys.path.insert(0, str(EXAMPLE.parent))
import train_gpt  # noqa: E402

STEPS = 50
SMALL = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "16", "--steps", str(STEPS)]
PIPE_STEPS = 10
PIPE = ["--layers", "2", "--dim", "32", "--heads", "2", "--seq", "16", "--batch", "16", "--steps", str(PIPE_STEPS)]
# the example imports this checkout's vsf, whatever the environment has installed
ENV = dict(
    os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
)


def example_command(*args: str, nproc: int | None = None) -> list[str]:
    """``python examples/train_gpt.py ARGS``, or under ``python -m vsf.launch -n NPROC``."""
    return [sys.executable, *(["-m", "vsf.launch", "-n", str(nproc)] if nproc else []), str(EXAMPLE), *args]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so
    killing the launcher's process group would miss them)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.extend(children)
        todo.extend(children)
    return found


def metrics(out: Path) -> list[dict]:
    """Every line the runs writing to ``out`` logged, in order."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


class Background:
    """The example running in a subprocess; :meth:`wait` returns its stdout (raising on failure)."""

    def __init__(self, out: Path, *args: str) -> None:
        self.out = out
        self.log = (out / "stdout.txt").open("w")
        self.proc = subprocess.Popen(
            example_command(*args, "--out", str(out)), stdout=self.log, stderr=subprocess.PIPE, text=True, env=ENV
        )

    def wait(self) -> str:
        _, err = self.proc.communicate(timeout=900)
        self.log.close()
        if self.proc.returncode:
            raise RuntimeError(f"the example failed ({self.proc.returncode}):\n{err[-4000:]}")
        return (self.out / "stdout.txt").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        self.log.close()


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    """The one-process run and the 8-rank simulated run of the small config, started now."""
    runs = {
        "one": Background(tmp_path_factory.mktemp("one_process"), *SMALL, "--save-every", str(STEPS)),
        "sim8": Background(
            tmp_path_factory.mktemp("simulate_8"), *SMALL, "--simulate", "8", "--save-every", str(STEPS), "--print-plan"
        ),
        "cp2": Background(
            tmp_path_factory.mktemp("cp_2"), *SMALL, "--simulate", "4", "--cp", "2", "--save-every", str(STEPS)
        ),
        "cp2tp2": Background(
            tmp_path_factory.mktemp("cp_2_tp_2"),
            *SMALL,
            "--simulate",
            "4",
            "--cp",
            "2",
            "--tp",
            "2",
            "--save-every",
            str(STEPS),
        ),
        "pp1": Background(tmp_path_factory.mktemp("pp_1"), *PIPE, "--save-every", str(PIPE_STEPS)),
        "pp2dp2": Background(
            tmp_path_factory.mktemp("pp_2_dp_2"),
            *PIPE,
            "--simulate",
            "4",
            "--pp",
            "2",
            "--dp",
            "2",
            "--save-every",
            str(PIPE_STEPS // 2),
        ),
        "pp2tp2": Background(
            tmp_path_factory.mktemp("pp_2_tp_2"),
            *PIPE,
            "--simulate",
            "4",
            "--pp",
            "2",
            "--tp",
            "2",
            "--schedule",
            "gpipe",
        ),
        "pp2cp2": Background(tmp_path_factory.mktemp("pp_2_cp_2"), *PIPE, "--simulate", "4", "--pp", "2", "--cp", "2"),
    }
    yield runs
    for run in runs.values():
        run.stop()


@pytest.fixture(scope="module")
def one_process(background) -> list[float]:
    """The losses of the small config in one plain process (a mesh of one rank)."""
    background["one"].wait()
    return [m["loss"] for m in metrics(background["one"].out)]


@pytest.mark.multiprocess
def test_killed_two_process_run_resumes_with_the_same_losses(background, one_process, tmp_path):
    args = [*SMALL, "--out", str(tmp_path), "--save-every", "10"]
    run = subprocess.Popen(
        example_command(*args, nproc=2), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV
    )
    mngr = vsf.checkpoint.CheckpointManager(tmp_path / "ckpt")
    deadline = time.monotonic() + 300
    while run.poll() is None and not mngr.all_steps() and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in [run.pid, *descendants(run.pid)]:  # the launcher, torchrun and both ranks, mid-run
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _, err = run.communicate()
    assert run.returncode == -signal.SIGKILL, (
        f"the run ended before it could be killed ({run.returncode}):\n{err[-3000:]}"
    )
    committed = mngr.latest_step()
    killed = {m["step"]: m["loss"] for m in metrics(tmp_path)}
    assert committed is not None and committed <= max(killed) + 1 < STEPS

    done = subprocess.run(
        example_command(*args, "--resume", nproc=2), capture_output=True, text=True, timeout=600, env=ENV
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resumed from {tmp_path / 'ckpt' / str(committed)}" in done.stdout
    logged = metrics(tmp_path)[len(killed) :]
    assert [m["step"] for m in logged] == list(range(committed, STEPS))
    resumed = {m["step"]: m["loss"] for m in logged}
    # the steps both runs took after the checkpoint: the same program on the same state and data
    assert {s: resumed[s] for s in killed if s >= committed} == {s: killed[s] for s in killed if s >= committed}
    # and the whole run, killed then resumed, is the uninterrupted one-process run
    combined = [killed[s] if s < committed else resumed[s] for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(combined), torch.tensor(one_process), rtol=1e-5, atol=0)
    # ZeRO over dp: each rank holds all params (4 bytes each), half of Adam's two moments, and the step count
    n = sum(p.numel() for p in train_gpt.GPT(train_gpt.config(train_gpt.parse_args(SMALL))).parameters())
    per_rank = f"{(4 * n + 2 * 4 * n // 2 + 4) / 1024:,.1f} KiB"
    assert f"params + optimizer state per rank: 0: {per_rank}, 1: {per_rank}\n" in done.stdout
    assert (tmp_path / "loss.png").exists() == _has_matplotlib()


def test_eight_simulated_ranks_learn_and_match_one_process(background, one_process):
    out = background["sim8"].wait()
    losses = [m["loss"] for m in metrics(background["sim8"].out)]
    assert len(losses) == STEPS
    # the model learns (the first losses are about log(vocab) = 2.77)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3
    # every step equals the one-process run up to the reduction order of the sharded sums
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_process), rtol=1e-5, atol=0)
    assert "mesh pp=1 x dp=2 x fsdp=2 x cp=1 x tp=2 (8 ranks, cpu, simulated)" in out
    # the plan communicates over every axis that splits something, never over pp or cp
    sends = re.search(r"each step sends per rank \(from the plan\): (.*);", out).group(1)
    assert sorted(part.split()[0] for part in sends.split(", ")) == ["dp", "fsdp", "tp"]
    memory = re.search(r"params \+ optimizer state per rank: (.*)\n", out).group(1)
    assert [int(part.split(":")[0]) for part in memory.split(", ")] == list(range(8))
    assert f"steps [{STEPS}]" in out
    # --print-plan printed the plan: one line per collective the summary counts
    planned = int(re.search(r"; (\d+) collectives \(", out).group(1))
    assert len(re.findall(r"^\s+(?:all_reduce|all_gather|reduce_scatter|all_to_all) over \w+: ", out, re.M)) == planned


@pytest.mark.parametrize(
    "run, mesh", [("cp2", "dp=2 x fsdp=1 x cp=2 x tp=1"), ("cp2tp2", "dp=1 x fsdp=1 x cp=2 x tp=2")]
)
def test_sequences_split_over_cp_train_like_one_process(background, one_process, run, mesh):
    out = background[run].wait()
    assert f"mesh pp=1 x {mesh} (4 ranks, cpu, simulated)" in out
    losses = [m["loss"] for m in metrics(background[run].out)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_process), rtol=1e-5, atol=0)
    sends = re.search(r"each step sends per rank \(from the plan\): (.*);", out).group(1)
    assert "cp " in sends


@pytest.mark.parametrize(
    "run, mesh, schedule",
    [
        ("pp2dp2", "pp=2 x dp=2 x fsdp=1 x cp=1 x tp=1", "1f1b"),
        ("pp2tp2", "pp=2 x dp=1 x fsdp=1 x cp=1 x tp=2", "gpipe"),
        (
            "pp2cp2",
            "pp=2 x dp=1 x fsdp=1 x cp=2 x tp=1",
            "1f1b",
        ),  # each sequence split over cp inside the stages, and between them
    ],
)
def test_two_pipeline_stages_train_like_one_process(background, run, mesh, schedule):
    background["pp1"].wait()
    want = [m["loss"] for m in metrics(background["pp1"].out)]
    out = background[run].wait()
    assert f"mesh {mesh} (4 ranks, cpu, simulated)" in out
    losses = [m["loss"] for m in metrics(background[run].out)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0)
    # the summary: each stage's ranks, what they hold, and the schedule's bubble ((p-1)/(m+p-1) = 20%)
    assert re.search(
        r"stage 0 \(ranks \[0, 1\]\): params \+ optimizer state [\d.]+ KiB per rank; " + schedule + r" bubble 20\.0%",
        out,
    )
    assert re.search(r"stage 1 \(ranks \[2, 3\]\): params \+ optimizer state [\d.]+ KiB per rank", out)


def test_a_pipelined_run_resumed_halfway_continues_its_loss_curve(background, tmp_path):
    background["pp2dp2"].wait()
    whole = metrics(background["pp2dp2"].out)
    half = PIPE_STEPS // 2
    shutil.copytree(background["pp2dp2"].out / "ckpt", tmp_path / "ckpt")
    shutil.rmtree(tmp_path / "ckpt" / str(PIPE_STEPS))  # as if the run had stopped after step `half`
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in whole[:half]))
    args = [
        *PIPE,
        "--simulate",
        "4",
        "--pp",
        "2",
        "--dp",
        "2",
        "--save-every",
        str(half),
        "--out",
        str(tmp_path),
        "--resume",
    ]
    done = subprocess.run(example_command(*args), capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resumed from {tmp_path / 'ckpt' / str(half)}" in done.stdout
    # the resumed steps are the uninterrupted run's, to the bit: the same program on the same state and data
    assert [(m["step"], m["loss"]) for m in metrics(tmp_path)[half:]] == [(m["step"], m["loss"]) for m in whole[half:]]


def test_mesh_shape_from_the_number_of_ranks():
    assert train_gpt.mesh_shape(1) == {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 1}
    assert train_gpt.mesh_shape(2) == {"pp": 1, "dp": 2, "fsdp": 1, "cp": 1, "tp": 1}
    assert train_gpt.mesh_shape(8) == {"pp": 1, "dp": 2, "fsdp": 2, "cp": 1, "tp": 2}
    assert train_gpt.mesh_shape(16) == {"pp": 1, "dp": 4, "fsdp": 2, "cp": 1, "tp": 2}
    assert train_gpt.mesh_shape(12) == {"pp": 1, "dp": 6, "fsdp": 2, "cp": 1, "tp": 1}
    assert train_gpt.mesh_shape(8, tp=1) == {"pp": 1, "dp": 4, "fsdp": 2, "cp": 1, "tp": 1}
    assert train_gpt.mesh_shape(8, dp=1, fsdp=4) == {"pp": 1, "dp": 1, "fsdp": 4, "cp": 1, "tp": 2}
    with pytest.raises(ValueError, match="must divide 8"):
        train_gpt.mesh_shape(8, dp=3)
    with pytest.raises(ValueError, match="there are 8 ranks"):
        train_gpt.mesh_shape(8, dp=2, fsdp=1, tp=2)
    assert train_gpt.mesh_shape(8, cp=2) == {"pp": 1, "dp": 2, "fsdp": 2, "cp": 2, "tp": 1}
    assert train_gpt.mesh_shape(4, cp=2, tp=2) == {"pp": 1, "dp": 1, "fsdp": 1, "cp": 2, "tp": 2}
    with pytest.raises(ValueError, match="cp=3"):
        train_gpt.mesh_shape(8, cp=3)
    assert train_gpt.mesh_shape(8, pp=2, tp=2) == {"pp": 2, "dp": 2, "fsdp": 1, "cp": 1, "tp": 2}


def test_unfit_pipelines_and_uneven_sequence_splits_are_refused(capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--pp", "3", "--layers", "2"])
    assert "--pp 3 must be between 1 and --layers 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--cp", "3", "--seq", "32"])
    assert "must be a positive divisor of --seq 32" in capsys.readouterr().err


def test_progress_is_a_bar_on_a_terminal_and_lines_otherwise():
    class Stream(list):
        def __init__(self, tty: bool) -> None:
            super().__init__()
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

        def write(self, s: str) -> None:
            self.append(s)

        def flush(self) -> None:
            pass

    for tty in (True, False):
        stream = Stream(tty)
        rep = train_gpt.Reporter(total=6, tokens_per_step=100, every=3, enabled=True, stream=stream)
        for step in range(6):
            rep.step(step, loss=2.0 - step / 10, seconds=0.5)
        text = "".join(stream)
        if tty:
            assert text.count("\r") == 6 and "6/6  loss 1.5000  200 tok/s" in text and text.endswith("\n")
        else:
            assert text.splitlines() == ["step     3/6  loss 1.8000  200 tok/s", "step     6/6  loss 1.5000  200 tok/s"]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_the_summary_says_when_matplotlib_is_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 2.0}\n')
    assert "matplotlib is not installed" in train_gpt.plot_losses(
        tmp_path / "metrics.jsonl", tmp_path / "loss.png", 0.5
    )
    assert not (tmp_path / "loss.png").exists()
