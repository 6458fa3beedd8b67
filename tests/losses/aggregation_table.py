"""The table "Aggregation and all-masked rows" of docs/losses.md, parsed, so that tests run every row against the
real verl / TRL code and the table cannot drift from it."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
HEADER = "| framework | their loss | their settings | their aggregation | all-masked rows | ours |"


@dataclass(frozen=True)
class Row:
    framework: str
    loss: str
    settings: dict
    aggregation: str           # an aggregation mode, "loss_agg_mode" (the one passed) or "row mean"
    empty_rows: str            # "counted", "counted in global_batch_size" or "–"
    ours: str
    options: dict


def _value(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def rows(framework: str | None = None) -> list[Row]:
    """The table's rows (of ``framework`` only, when given)."""
    lines = DOC.read_text().splitlines()
    start = lines.index(HEADER) + 2
    out = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        fw, loss, settings, agg, empty, ours = [c.strip() for c in line.strip("|").split("|")]
        names = re.findall(r"`([^`]*)`", ours)
        options = dict((k.strip(), _value(v.strip())) for k, v in (o.split(":") for o in names[1:]))
        sets = dict((k, _value(v)) for k, v in (x.split("=") for x in re.findall(r"`([^`]*=[^`]*)`", settings)))
        out.append(Row(fw, loss.strip("`"), sets, agg.strip("`"), empty.replace("`", ""), names[0], options))
    return [r for r in out if framework is None or r.framework == framework]
