"""docs/metrics.md is generated from ``offpolicy_moe.run.metrics`` and defines every documented key.

The block between the ``BEGIN GENERATED`` and ``END GENERATED`` markers must equal :func:`render` of
:data:`~offpolicy_moe.run.metrics.DOCUMENTED_KEYS` and ``DOCUMENTED_PREFIXES`` (a new, renamed or re-described
key makes it stale); every documented key must also appear in the hand-written definitions below the block.
``python -m tests.test_docs_metrics --write`` rewrites the generated block.
"""
from __future__ import annotations

import sys
from pathlib import Path

from offpolicy_moe.run.metrics import DOCUMENTED_KEYS, DOCUMENTED_PREFIXES

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
BEGIN = "<!-- BEGIN GENERATED: python -m tests.test_docs_metrics --write -->"
END = "<!-- END GENERATED -->"


def render(keys: dict[str, str] = DOCUMENTED_KEYS, prefixes: tuple[str, ...] = DOCUMENTED_PREFIXES) -> str:
    """The generated part of docs/metrics.md: one table per family, in the order of ``keys``, then the families
    whose exact keys depend on the objective or mechanism."""
    families: dict[str, list[str]] = {}
    for key in keys:
        families.setdefault(key.split("/")[0] + "/", []).append(key)
    out = [BEGIN, "", "| key | meaning (`DOCUMENTED_KEYS`) |", "| --- | --- |"]
    for fam_keys in families.values():
        out += [f"| `{k}` | {keys[k].replace('|', '/')} |" for k in fam_keys]
    out += ["", "Families whose exact keys depend on the objective or the mechanism (`DOCUMENTED_PREFIXES`): "
            + ", ".join(f"`{p}`" for p in prefixes) + ".", "", END]
    return "\n".join(out)


def split_doc(text: str) -> tuple[str, str, str]:
    """``(before, generated block, after)`` of the page; ValueError when a marker is missing."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{DOC} lacks the generated-block markers")
    head, rest = text.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    return head, BEGIN + block + END, tail


def test_generated_block_is_current():
    _, block, _ = split_doc(DOC.read_text(encoding="utf-8"))
    assert block == render(), "docs/metrics.md is stale: run `python -m tests.test_docs_metrics --write`"


def test_every_documented_key_has_a_definition():
    _, _, definitions = split_doc(DOC.read_text(encoding="utf-8"))
    missing = [k for k in DOCUMENTED_KEYS if f"`{k}`" not in definitions]
    assert not missing, f"docs/metrics.md defines no formula for: {missing}"
    families = [p for p in DOCUMENTED_PREFIXES if f"`{p}" not in definitions]
    assert not families, f"docs/metrics.md says nothing of the families: {families}"


def test_render_changes_when_a_key_is_added():
    # the comparison can fail: an extra key (or a changed meaning) gives another block
    assert render({**DOCUMENTED_KEYS, "reward/new": "x"}) != render()
    assert render({**DOCUMENTED_KEYS, "reward/mean": "other"}) != render()


if __name__ == "__main__":
    if "--write" in sys.argv:
        head, _, tail = split_doc(DOC.read_text(encoding="utf-8"))
        DOC.write_text(head + render() + tail, encoding="utf-8")
        print(f"wrote {DOC}")
    else:
        print(render())
