"""Every ```python block of docs/*.md runs as written.

The blocks of one page run in order in one namespace (a page reads like a notebook), in a fresh temporary working
folder.  A block directly preceded by a ``<!-- not run: REASON -->`` line is skipped; the reason must be given.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"(?:^(<!-- not run: (?P<why>[^>]*?) -->)\n)?^```python\n(?P<code>.*?)^```", re.S | re.M)
PAGES = sorted(DOCS.glob("*.md"))


def python_blocks(text: str) -> list[tuple[str, str | None, int]]:
    """``(code, skip reason or None, line number)`` of each python block of a markdown page."""
    return [(m.group("code"), m.group("why"), text.count("\n", 0, m.start("code")) + 1) for m in BLOCK.finditer(text)]


def test_docs_folder_has_pages():
    assert {"index.md", "architecture.md", "algorithms.md", "losses.md", "config.md", "metrics.md"} <= {
        p.name for p in PAGES}


def test_block_parser_finds_runnable_and_skipped_blocks():
    text = "x\n```python\na = 1\n```\n<!-- not run: needs verl -->\n```python\nimport verl\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [("a = 1\n", None, 3), ("import verl\n", "needs verl", 7)]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_blocks_run(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": f"docs_{page.stem}"}
    for code, why, line in python_blocks(page.read_text(encoding="utf-8")):
        if why is not None:
            assert why.strip(), f"{page.name}:{line}: a skipped block must say why"
            continue
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), ns)
