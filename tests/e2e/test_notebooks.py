"""Every notebook in notebooks/ runs top to bottom in a fresh python3 kernel, and is stored executed."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found in notebooks/"


@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path):
    nb = nbformat.read(path, as_version=4)
    unexecuted = [
        i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip() and c.execution_count is None
    ]
    assert not unexecuted, f"{path.name} is stored without outputs for code cells {unexecuted}: store it executed"
    # raises CellExecutionError, naming the cell and its traceback, on the first error
    NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(path.parent)}}).execute()
