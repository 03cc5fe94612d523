"""The README's code, and the code of the pages in docs/, works as written: its Python runs, its
commands name flags that exist, and CI runs exactly the README's test command."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = {
    p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}
sys.path.insert(0, str(ROOT / "examples"))
import train_gpt  # noqa: E402


def blocks(language: str, page: str = "README.md") -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGES[page], flags=re.S)


SNIPPETS = [(page, i) for page in PAGES for i in range(len(blocks("python", page)))]


def commands() -> list[list[str]]:
    """Every command of the pages' bash blocks, continuation lines joined, split at ``&&``."""
    out = []
    for block in (b for page in PAGES for b in blocks("bash", page)):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            out.extend(shlex.split(part) for part in line.split("&&") if part.strip())
    return out


@pytest.mark.parametrize(("page", "index"), SNIPPETS, ids=[f"{p}:{i}" for p, i in SNIPPETS])
def test_python_snippets_run(page, index):
    code = blocks("python", page)[index]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{page} python block {index}", "exec"), {"__name__": "readme"})
    # every `print(...)  # expected` comment that states a literal value is what it printed
    for expected in re.findall(r"print\(.*\)\s+# (\S+\[[^\s]*\])", code):
        assert expected in out.getvalue().splitlines(), (expected, out.getvalue())


def test_the_docs_have_code_to_check():
    # the README's tour and model, and the docs' pages (status.md's random numbers) are all run
    assert {p for p, _ in SNIPPETS} >= {"README.md", "docs/status.md"}, SNIPPETS


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
        train_gpt.parse_args(args)  # exits on an unknown flag
