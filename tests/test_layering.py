"""The package in floors: no hf_gsc module imports a module on a higher floor, and no import cycle among them.

Imports are read from the source with ``ast``: module-level and inside functions, relative and absolute, and
``importlib.import_module`` with a literal name. Imports under ``if TYPE_CHECKING:`` are left out: they never run
(annotations only, every module has ``from __future__ import annotations``), so they order nothing at import time.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest


PACKAGE = Path(__file__).resolve().parents[1] / "hf_gsc"

#: The floors, lowest first: a module may import its own floor and those below, never one above. An entry names a
#: subpackage (and so every module in it) or one module; ``hf_gsc`` itself is only the package's ``__init__``,
#: the front door: it re-exports public names from every floor (the evaluation's on first use), so it is the top.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("hf_gsc.utils", "hf_gsc.reference_models"),  # ground floor: helpers that know no detector
    ("hf_gsc.classifier", "hf_gsc.data"),  # the base classifier (architectures, heads, split points); datasets
    ("hf_gsc.gsc_math",),  # GSC's math: short-circuit, the step, the linearisation backends
    ("hf_gsc.settings",),  # every method's config and the registry of method names
    ("hf_gsc.storage",),  # the saved format and the Hub
    ("hf_gsc.detectors",),  # the detector interface, the shared backbone pass, every method (GSC included)
    ("hf_gsc.auto", "hf_gsc.pipeline"),  # entry points: a saved detector by its method, the pipeline
    ("hf_gsc.evaluation", "hf_gsc.method_table"),  # the evaluation
    ("hf_gsc.analysis", "hf_gsc.app", "hf_gsc.cli", "hf_gsc.__main__"),  # analyses, the demo app, the command
    ("hf_gsc",),  # the public names
)


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, package): path for path in sorted(package.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The hf_gsc modules ``name`` imports, each with the line of its first import. ``from a import b`` imports the
    module ``a.b`` when there is one, else ``a``; importing ``a.b`` counts as importing ``a.b`` only, not ``a``:
    that Python runs a package's ``__init__`` first is how imports work, not a dependency (a package whose
    ``__init__`` imports its own modules would otherwise be a cycle with each of them)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]
        if target in modules and target != name:
            found.setdefault(target, line)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    visit_node(other)
            else:
                visit_node(child)

    def visit_node(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source, node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            add(node.args[0].value, node.lineno)
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    modules = package_modules(package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def floor_of(module: str) -> int | None:
    """The floor of the longest entry naming ``module`` or a package above it (``hf_gsc`` names only itself)."""
    best: tuple[int, int] | None = None
    for level, entries in enumerate(FLOORS):
        for entry in entries:
            if module == entry or (entry != "hf_gsc" and module.startswith(entry + ".")):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), level)
    return None if best is None else best[1]


GRAPH = import_graph()


def test_the_reader_sees_every_kind_of_import(tmp_path):
    """A tiny package with each kind of import: relative at any depth, absolute, in a function, by
    ``importlib.import_module``, and one under ``TYPE_CHECKING`` that must be left out."""
    root = tmp_path / "hf_gsc"
    (root / "low").mkdir(parents=True)
    for name in ("__init__.py", "top.py", "low/__init__.py", "low/a.py", "low/b.py", "low/c.py", "low/d.py"):
        (root / name).write_text("")
    (root / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nfrom . import b\nif TYPE_CHECKING:\n    from .. import top\n"
        "def f():\n    from .c import x\n    import importlib\n    importlib.import_module('hf_gsc.low.d')\n")
    (root / "top.py").write_text("import hf_gsc.low.a\nfrom .low import b\n")
    graph = import_graph(root)
    assert graph["hf_gsc.low.a"] == {"hf_gsc.low.b": 2, "hf_gsc.low.c": 6, "hf_gsc.low.d": 8}
    assert graph["hf_gsc.top"] == {"hf_gsc.low.a": 1, "hf_gsc.low.b": 2}


def test_every_module_is_on_a_floor():
    assert [name for name in GRAPH if floor_of(name) is None] == []


def test_no_module_imports_a_higher_floor():
    upward = [f"{name} (floor {floor_of(name)}) imports {target} (floor {floor_of(target)}) at line {line}"
              for name, targets in GRAPH.items() for target, line in targets.items()
              if floor_of(name) is not None and floor_of(target) is not None and floor_of(target) > floor_of(name)]
    assert upward == []


def test_no_import_cycle():
    try:
        graphlib.TopologicalSorter({name: set(targets) for name, targets in GRAPH.items()}).prepare()
    except graphlib.CycleError as error:
        cycle = error.args[1]
        steps = [f"{a} imports {b} at line {GRAPH[a][b]}" for a, b in zip(cycle[1:], cycle)]
        pytest.fail("import cycle:\n" + "\n".join(steps))
