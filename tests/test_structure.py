"""The package's shape, read from its imports: docs/architecture.md's layer order, no import cycle, and no
private PyTorch name outside ``vsf/_compat.py``."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

import vsf
from vsf import _compat

ROOT = pathlib.Path(vsf.__file__).parent

# docs/architecture.md's layer table, top first: a module may import its own layer and the ones before it.
# (The foundation: errors, the _compat verbs, config, and runtime, which says where the ranks are.)
# A prefix ending in "." covers a package and its modules.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("vsf.errors", "vsf._compat", "vsf.config", "vsf.runtime")),
    ("pytrees", ("vsf.modules", "vsf.tree")),
    (
        "values",
        tuple(
            f"vsf.sharding.{m}"
            for m in ("entries", "spec", "mesh", "placement", "named", "rules", "inspect", "constraint")
        ),
    ),
    ("collectives", ("vsf.ops", "vsf.ops.")),
    (
        "movement",
        ("vsf.sharding",)
        + tuple(f"vsf.sharding.{m}" for m in ("put", "ragged", "eager", "packing", "fingerprint", "make_array")),
    ),
    ("jit", ("vsf.jit", "vsf.jit.")),
    (
        "transforms",
        (
            "vsf.func",
            "vsf.remat_policies",
            "vsf.abstract",
            "vsf.random",
            "vsf.random.",
            "vsf.nn",
            "vsf.nn.",
            "vsf.pipeline",
            "vsf.pipeline.",
        ),
    ),
    ("optimizers", ("vsf.optim", "vsf.optim.")),
    ("checkpoints", ("vsf.checkpoint", "vsf.checkpoint.")),
    ("api", ("vsf", "vsf.debug", "vsf.launch", "vsf.stages")),
]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or (p.endswith(".") and module.startswith(p)) for p in prefixes):
            return i
    raise AssertionError(f"{module} has no layer in LAYERS (docs/architecture.md's table): add it where it belongs")


def _vsf_imports(module: str) -> set[str]:
    """The vsf modules ``module`` imports, anywhere in its body (a name imported from a package is
    the package's module if it is one, else the package itself)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "vsf")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] != "vsf":
                continue
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return found - {module}


GRAPH = {m: _vsf_imports(m) for m in MODULES}


def test_every_import_goes_down_the_layers():
    wrong = [
        f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
        for m, deps in GRAPH.items()
        for d in sorted(deps)
        if _layer(d) > _layer(m)
    ]
    assert not wrong, "imports against docs/architecture.md's layer order:\n" + "\n".join(wrong)


def test_no_import_cycles():
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(GRAPH[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d) :] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_nothing_in_jit_reaches_back_to_its_api():
    users = sorted(m for m, deps in GRAPH.items() if "vsf.jit.api" in deps and m != "vsf.jit")
    assert users == [], f"{users} import vsf.jit.api; the stages below it must not"


def test_the_test_sees_real_edges():
    # the checks above would pass vacuously if the import reader found nothing
    assert "vsf.sharding.mesh" in GRAPH["vsf.jit.propagate"]
    assert "vsf.jit.solver" in GRAPH["vsf.jit.propagate"]
    assert (
        _layer("vsf.jit.lower")
        > _layer("vsf.sharding.ragged")
        > _layer("vsf.ops.backend")
        > _layer("vsf.sharding.mesh")
    )


# -- private PyTorch names -----------------------------------------------------------------------

# DTensor / Tensor / op internals a module could reach as attributes of an object it holds.
PRIVATE_ATTRIBUTES = {
    "_local_tensor",
    "_local_tensors",
    "_spec",
    "_op_dispatcher",
    "_make_wrapper_subclass",
    "_schema",
    "_overloadname",
    "_rank_map",
    "_layout",
    "_mesh_layout",
}
# aten's multi-tensor ops (torch._foreach_add, ...): registered operators with a schema, which
# torch.optim's foreach path calls the same way; they are ops, not private Python APIs.
ALLOWED_TORCH_ATTRIBUTES = re.compile(r"_foreach_\w+")


def _private_uses(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split(".")):
                    found.append(f"line {node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            if any(p.startswith("_") for p in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module} import ...")
            found += [
                f"line {node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")
            ]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            from_torch = isinstance(root, ast.Name) and root.id == "torch"
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")  # vsf's own fields
            if (node.attr in PRIVATE_ATTRIBUTES and not own) or (
                from_torch and not ALLOWED_TORCH_ATTRIBUTES.fullmatch(node.attr)
            ):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "vsf._compat"))
def test_no_private_pytorch_name_outside_compat(module):
    uses = _private_uses(MODULES[module])
    assert not uses, f"{module} names private PyTorch APIs (add a verb to vsf/_compat.py instead): {uses}"


def test_the_private_name_check_catches_them(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from torch.utils import _pytree\nimport torch.distributed._local_tensor\n"
        "from torch.distributed.tensor._op_schema import OpSchema\nx = dt._local_tensor\ny = torch.Tensor._make_wrapper_subclass\n"
        "ok = torch._foreach_add\n"
    )
    assert [u.split(":")[0] for u in _private_uses(bad)] == ["line 1", "line 2", "line 3", "line 4", "line 5"]


def test_compat_exports_verbs_not_private_types():
    # the one private type it exports is a placement value: the layout layer builds and compares it
    types = sorted(
        n
        for n in _compat.__all__
        if inspect.isclass(getattr(_compat, n)) and getattr(_compat, n).__module__.startswith("torch")
    )
    assert types == ["StridedShard"], types


def test_every_public_error_is_in_errors_and_exported():
    from vsf import errors

    classes = [
        n
        for n, c in vars(errors).items()
        if inspect.isclass(c) and issubclass(c, Exception) and c.__module__ == "vsf.errors"
    ]
    assert sorted(classes) == sorted(errors.__all__)
    assert all(getattr(vsf, n) is getattr(errors, n) and n in vsf.__all__ for n in classes)
    defined_elsewhere = [
        f"{m}.{node.name}"
        for m, p in MODULES.items()
        if m != "vsf.errors"
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef)
        and not node.name.startswith("_")  # private ones carry control flow
        and any(isinstance(b, ast.Name) and b.id.endswith(("Error", "Exception")) for b in node.bases)
    ]
    assert defined_elsewhere == [], defined_elsewhere


def test_modules_are_small_or_say_why():
    long = [
        f"{m} ({n} lines)"
        for m, p in MODULES.items()
        if (n := len(p.read_text().splitlines())) > 500
        and "one piece" not in (ast.get_docstring(ast.parse(p.read_text())) or "")
    ]
    assert not long, f"modules over 500 lines whose docstring does not say why they must be one piece: {long}"


def test_the_architecture_page_lists_these_layers():
    # docs/architecture.md's layer table is LAYERS, in order, each row naming the layer's modules
    page = (ROOT.parent / "docs" / "architecture.md").read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| (.+?) \| .+ \|$", page, flags=re.M)[1:]  # the header row first
    assert [name for name, _ in rows] == [name for name, _ in LAYERS]
    for (name, modules), (_, prefixes) in zip(rows, LAYERS):
        missing = [p for p in prefixes if p.rstrip(".").rpartition(".")[2] not in modules]
        assert not missing, f"docs/architecture.md's {name} row does not name {missing}"


def test_every_compat_verb_vsf_uses_is_exported():
    # tests/test_compat.py exercises every name in _compat.__all__, so a verb used but not exported escapes it
    used = {
        node.attr
        for p in MODULES.values()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "_compat"
    }
    assert sorted(used - set(_compat.__all__)) == []
