"""The modules of ``hf_gsc.evaluation`` form no import cycle, counting the imports inside functions: each module has one
job, and a lower one never reaches up to a higher one. Imports under ``if TYPE_CHECKING:`` are left out, as
``tests/test_layering.py`` leaves them out: they never run (an annotation may name a class of a module above)."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_gsc.evaluation


PACKAGE = Path(hf_gsc.evaluation.__file__).parent


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those inside the body of an ``if TYPE_CHECKING:`` (its ``else`` runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend([node.test, *node.orelse])
        else:
            stack.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def evaluation_imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of ``hf_gsc.evaluation`` it imports anywhere in its file (``from .x import``,
    ``from . import x``, ``from ..evaluation.x import``, ``import hf_gsc.evaluation.x``)."""
    graph: dict[str, set[str]] = {}
    modules = {path.stem for path in package.glob("*.py")} - {"__init__"}
    for module in modules:
        found: set[str] = set()
        for node in _runtime_nodes(ast.parse((package / f"{module}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                target = node.module or ""
                if node.level == 1:
                    names = [target.split(".")[0]] if target else [alias.name for alias in node.names]
                elif node.level == 2 and target.startswith("evaluation"):
                    rest = target.split(".")[1:]
                    names = rest[:1] if rest else [alias.name for alias in node.names]
                elif node.level == 0 and target.startswith("hf_gsc.evaluation"):
                    rest = target.split(".")[2:]
                    names = rest[:1] if rest else [alias.name for alias in node.names]
                else:
                    names = []
            elif isinstance(node, ast.Import):
                names = [alias.name.split(".")[2] for alias in node.names
                         if alias.name.startswith("hf_gsc.evaluation.")]
            else:
                continue
            found.update(name for name in names if name in modules and name != module)
        graph[module] = found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return stack[stack.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_function_level_imports_and_leaves_out_type_checking_ones(tmp_path) -> None:
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
                                   "def f():\n    from .c import C\n")
    (tmp_path / "b.py").write_text("from .a import f\n")
    (tmp_path / "c.py").write_text("")
    assert evaluation_imports(tmp_path) == {"a": {"c"}, "b": {"a"}, "c": set()}
    graph = evaluation_imports()
    assert "fitting" in graph["evaluator"] and "json_files" in graph["report"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_evaluation_package() -> None:
    cycle = find_cycle(evaluation_imports())
    assert cycle is None, " -> ".join(cycle)
