"""No function of the package is longer than 80 lines (from its ``def`` line to its last line): a longer one is split
into named pieces."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offpolicy_moe"
MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """``(name, first line, lines)`` of every function or method in ``source`` longer than ``limit`` lines."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_the_finder_names_a_long_function_or_method_and_passes_one_of_80_lines():
    lines = [f"    x{i} = {i}\n" for i in range(80)]
    assert long_functions("def long():\n" + "".join(lines)) == [("long", 1, 81)]
    assert long_functions("def short():\n" + "".join(lines[:79])) == []
    method = "class C:\n    async def method(self):\n" + "".join("    " + line for line in lines)
    assert long_functions(method) == [("method", 2, 81)]


def test_no_function_of_the_package_is_over_80_lines():
    found = [f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)"
             for path in sorted(PACKAGE.rglob("*.py")) for name, line, n in long_functions(path.read_text())]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines: {found}"
