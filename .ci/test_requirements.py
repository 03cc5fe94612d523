"""Prints the requirements of pyproject.toml's ``test`` extra, one a line (for .ci/run, which
installs them beside the README demo)."""

import tomllib
from pathlib import Path

pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
print("\n".join(pyproject["project"]["optional-dependencies"]["test"]))
