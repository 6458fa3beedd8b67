"""The package's layering holds: the import-linter ``layers`` contract in pyproject.toml is kept, no module below the
CLI imports the package inside a function, and no module guards one of the package's own imports with
``except ImportError``."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
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
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert len(contracts) >= 2
    for c in contracts:
        assert f"{c['name']} KEPT" in out.stdout, c["name"]
    assert f"{len(contracts)} kept, 0 broken" in out.stdout


def test_the_package_docstring_lists_the_contract_layers_bottom_up():
    """``offpolicy_moe.__doc__`` numbers the layers of the "offpolicy_moe layers" contract, bottom up, each an
    existing subpackage or module, and names nothing else as a layer."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["name"] == "offpolicy_moe layers")
    want = [sorted(name.strip().removeprefix("offpolicy_moe.") for name in layer.split("|"))
            for layer in reversed(layers)]
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    numbered = [line.split(maxsplit=1)[1] for line in doc.splitlines() if re.match(r"\s*\d+\.\s", line)]
    listed = [sorted(re.findall(r"``(?:offpolicy_moe\.)?(\w+)``", line.split("  ")[0])) for line in numbered]
    assert listed == want, f"docstring layers {listed} != contract {want}"
    for name in {n for layer in listed for n in layer} | set(re.findall(r"^``(\w+)``", doc, flags=re.M)):
        assert (PACKAGE / name / "__init__.py").is_file() or (PACKAGE / f"{name}.py").is_file(), name


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(path: Path, tree: ast.AST) -> set[str]:
    """Every module of the package ``path`` imports, at any depth (type-only imports under TYPE_CHECKING too)."""
    me = _module_name(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            if mod.split(".")[0] == "offpolicy_moe":
                out.add(mod)
                out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "offpolicy_moe")
    return out


def test_no_import_cycles_between_modules():
    """No two modules of the package import each other, directly or through others, counting imports inside
    functions and under ``TYPE_CHECKING`` (a package's ``__init__`` re-exporting its modules is not a cycle)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        if path.name == "__init__.py":
            continue
        graph[name] = {t for t in _targets(path, ast.parse(path.read_text())) if t in paths and t != name
                       and paths[t].name != "__init__.py"}
    seen, stack, cycles = set(), [], []

    def visit(n: str) -> None:
        stack.append(n)
        for m in graph.get(n, ()):
            if m in stack:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in seen:
                visit(m)
        stack.pop()
        seen.add(n)

    for n in sorted(graph):
        if n not in seen:
            visit(n)
    assert not cycles, f"import cycles: {cycles[:5]}"


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
