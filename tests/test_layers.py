"""The package's layering holds: the import-linter ``layers`` contract in pyproject.toml is kept, no module below the
CLI imports the package inside a function, and no module guards one of the package's own imports with
``except ImportError``."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "offpolicy_moe"
LAZY_OK = ("cli.py", "commands")   # the CLI imports torch-heavy layers lazily so `--help` stays fast


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in LAZY_OK)


def _imports_package(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "offpolicy_moe"
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] == "offpolicy_moe" for a in node.names)
    return False


def test_import_linter_layers_contract_is_kept():
    out = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                          "sys.exit(lint_imports_command())"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 kept, 0 broken" in out.stdout


def test_no_function_local_imports_of_the_package():
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(fn) if _imports_package(n)]
    assert not found, f"function-local imports of offpolicy_moe: {found}"


def test_no_import_error_fallbacks_around_the_package():
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Try) and any(_imports_package(n) for b in node.body for n in ast.walk(b)):
                names = [ast.unparse(h.type) for h in node.handlers if h.type is not None]
                if any("ImportError" in n or "ModuleNotFoundError" in n for n in names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"ImportError fallbacks around offpolicy_moe imports: {found}"
