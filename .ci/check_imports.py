"""Every vsf module imports with nothing but the runtime dependencies pyproject.toml declares.

Imports each module of the installed ``vsf`` in this fresh interpreter with every installed
distribution outside vsf's declared requirements (their closure, extras excluded) hidden, as if
it were not installed: torch's own optional imports (numpy, tqdm, ...) then take their fallback,
and a module vsf needs but does not declare fails to import. Such an import works on a machine
where a test extra happens to bring the package, and breaks the README's first command on a
fresh one. Exits 1 naming the module that failed and what it could not import.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata as md
import pkgutil
import re
import sys
import warnings


def requirement_closure(dist: str) -> set[str]:
    """Normalised names of ``dist`` and everything its requirements (no extras) pull in."""
    seen: set[str] = set()
    todo = [dist]
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" not in req:
                todo.append(re.match(r"[A-Za-z0-9._-]+", req).group(0))
    return seen


class Hidden(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Refuses the top-level modules of undeclared distributions, as if they were not installed.

    A probe (``importlib.util.find_spec``, as torch's own start-up makes) still sees a spec; only
    importing it fails, with the ``ModuleNotFoundError`` a missing package gives."""

    def __init__(self, allowed: set[str]) -> None:
        providers = md.packages_distributions()
        self.hidden = {
            top: sorted(dists)
            for top, dists in providers.items()
            if top not in sys.stdlib_module_names and not {re.sub(r"[-_.]+", "-", d).lower() for d in dists} & allowed
        }

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self) if name in self.hidden else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        raise ModuleNotFoundError(
            f"No module named {spec.name!r} ({', '.join(self.hidden[spec.name])} is not a declared dependency)",
            name=spec.name,
        )

    def exec_module(self, module: object) -> None:
        raise AssertionError("create_module always raises")


def main() -> int:
    allowed = requirement_closure("vsf")
    sys.meta_path.insert(0, Hidden(allowed))
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch's own notice that numpy is absent
    name, count = "vsf", 1
    try:
        vsf = importlib.import_module(name)
        for info in pkgutil.walk_packages(vsf.__path__, "vsf."):
            name, count = info.name, count + 1
            importlib.import_module(name)
    except ImportError as e:
        print(
            f"check_imports: {name} cannot be imported with vsf's declared runtime dependencies "
            f"({', '.join(sorted(allowed))}): {e}",
            file=sys.stderr,
        )
        return 1
    print(f"check_imports: all {count} vsf modules import with the declared runtime dependencies alone")
    return 0


if __name__ == "__main__":
    sys.exit(main())
