"""The shape of the routing package (issue 26, item 5): no import cycle (type-only imports included), no class over
400 lines, no function over 80, and the routing rules read the explicit state, never the controller's privates."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROUTING = Path(__file__).resolve().parents[2] / "offpolicy_moe" / "routing"
MODULES = {p.stem: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(ROUTING.glob("*.py"))}


def _relative_imports(tree: ast.Module) -> set[str]:
    """Modules of the package imported by ``tree``, wherever the import sits (``if TYPE_CHECKING:`` included)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("offpolicy_moe.routing."):
            out.add(node.module.split(".")[2])
    return out & set(MODULES)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_no_import_cycle_in_routing():
    graph = {m: _relative_imports(t) for m, t in MODULES.items()}
    assert "controller" not in graph["capture"]
    assert _cycle(graph) is None, _cycle(graph)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_class_over_400_and_no_function_over_80_lines(module):
    for node in ast.walk(MODULES[module]):
        n = node.end_lineno - node.lineno + 1 if hasattr(node, "end_lineno") else 0
        if isinstance(node, ast.ClassDef):
            assert n <= 400, f"class {node.name} has {n} lines"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert n <= 80, f"function {node.name} has {n} lines"


@pytest.mark.parametrize("module", ["adapter_rule", "generic", "capture", "generation", "checkpointing"])
def test_rules_and_recorders_read_no_controller_privates(module):
    """No ``ctl._x`` / ``controller._x`` / ``self._ctl`` in the strategies and recorders: they get the state or the
    frozen shape."""
    for node in ast.walk(MODULES[module]):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            assert not (node.value.id in ("ctl", "controller") and node.attr.startswith("_")), \
                f"{module} reads {node.value.id}.{node.attr}"
        if isinstance(node, ast.Attribute):
            assert node.attr != "_ctl", f"{module} keeps a controller reference"
