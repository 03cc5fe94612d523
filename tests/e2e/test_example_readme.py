"""The README's code works as written: its Python runs, its commands name flags that exist, and
CI runs exactly its test command."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "examples"))
import train_gpt  # noqa: E402


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands() -> list[list[str]]:
    """Every command of the README's bash blocks, continuation lines joined, split at ``&&``."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            out.extend(shlex.split(part) for part in line.split("&&") if part.strip())
    return out


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_snippets_run(index):
    code = blocks("python")[index]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "readme"})
    # every `print(...)  # expected` comment that states a literal value is what it printed
    for expected in re.findall(r"print\(.*\)\s+# (\S+\[[^\s]*\])", code):
        assert expected in out.getvalue().splitlines(), (expected, out.getvalue())


def test_the_two_setup_commands_come_first_and_ci_runs_the_test_command():
    first, second = blocks("bash")[:2]
    assert "examples/train_gpt.py --simulate 8" in first
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == second.strip()


def test_every_example_command_parses():
    runs = [c for c in commands() if any(a.endswith("train_gpt.py") for a in c)]
    assert len(runs) >= 4
    for cmd in runs:
        args = cmd[[i for i, a in enumerate(cmd) if a.endswith("train_gpt.py")][0] + 1 :]
        train_gpt.parse_args(args)   # exits on an unknown flag
