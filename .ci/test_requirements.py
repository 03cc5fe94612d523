"""Prints the requirements of vsf's ``test`` extra, one a line, as the installed vsf's metadata
lists them (for .ci/run, which installs them beside the README demo; any Python vsf supports)."""

import importlib.metadata as md

print("\n".join(r.split(";")[0].strip() for r in md.requires("vsf") or [] if r.endswith('extra == "test"')))
