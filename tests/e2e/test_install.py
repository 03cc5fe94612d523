"""vsf imports with the runtime dependencies pyproject.toml declares, and nothing a test extra brings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_module_imports_with_the_declared_dependencies_alone():
    check = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "check_imports.py")], capture_output=True, text=True, timeout=300
    )
    assert check.returncode == 0, check.stderr
    assert "vsf modules import with the declared runtime dependencies alone" in check.stdout


def test_the_check_fails_on_an_undeclared_import(tmp_path):
    # a copy of vsf with one module that imports numpy (installed here by the test extra, not
    # declared by vsf) comes first on the path: the check must name that module
    shutil.copytree(ROOT / "vsf", tmp_path / "vsf", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "vsf" / "sharding" / "uses_numpy.py").write_text("import numpy\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    check = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "check_imports.py")], capture_output=True, text=True, timeout=300, env=env
    )
    assert check.returncode == 1
    assert "vsf.sharding.uses_numpy cannot be imported" in check.stderr and "numpy" in check.stderr
