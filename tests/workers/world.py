"""Tier 3: several worker scripts in one launch of gloo processes, one after the other in the
same processes and default process group, so that a launch's start-up (each process importing
torch and vsf, the rendezvous) is paid once for all of them (see ``world`` in tests/conftest.py).

argv: out_dir, then one JSON list ``[script, *args]`` per section. Each section runs as its script
would run alone (as ``__main__``, with ``sys.argv = [script, out_dir/<section name>, *args]``) and
writes its ``rank{r}.json`` there; ``out_dir/<section name>/done.rank{r}`` marks a section this rank
finished. A section that raises ends the launch (torchrun stops the other ranks), so the sections
after it report nothing and their tests say which section stopped the launch.
"""

import json
import os
import runpy
import sys
import types
from pathlib import Path

WORKERS = Path(__file__).resolve().parent
sys.path.insert(0, str(WORKERS.parents[1]))  # this checkout's vsf
import vsf  # noqa: E402


def section_name(script: str, *args: str) -> str:
    """The directory a section writes to: the script's stem and its arguments."""
    return "-".join([Path(script).stem, *args])


def _switches() -> dict[str, object]:
    return {k: v for k, v in vars(vsf.config).items() if not k.startswith("_") and not isinstance(v, types.ModuleType)}


def main(out: Path, sections: list[list[str]]) -> None:
    rank, defaults = os.environ["RANK"], _switches()
    for script, *args in sections:
        where = out / section_name(script, *args)
        where.mkdir(parents=True, exist_ok=True)
        sys.argv = [str(WORKERS / script), str(where), *args]
        print(f"[world] rank {rank}: {script} {' '.join(args)}", flush=True)
        runpy.run_path(str(WORKERS / script), run_name="__main__")
        vars(vsf.config).update(defaults)  # a section's switches stay its own
        (where / f"done.rank{rank}").write_text("")


if __name__ == "__main__":
    main(Path(sys.argv[1]), [json.loads(s) for s in sys.argv[2:]])
