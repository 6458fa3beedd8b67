"""Ablation tables from run folders: cells ``mean ± std (n)`` over seeds, the best cell per column marked.

Per run, a metric's series from ``metrics.jsonl`` is reduced to one number by ``agg``:

| agg | value |
| --- | --- |
| ``final`` (``last``) | the last logged value |
| ``best`` | max of the series (min with lower-is-better) |
| ``mean_last:N`` | mean of the last N logged values (all of them if fewer) |
| ``min`` / ``max`` | min / max of the series |
| ``collapse:F`` | collapse step: the first step at which the trailing 5-point mean of the series falls below F × its best trailing mean so far (F = 0.5 by default); runs that never collapse are counted as ``k stable`` in the cell, not averaged |

A cell aggregates its runs (usually the seeds): mean, SAMPLE standard deviation (ddof = 1; shown as ``–`` when
n = 1) and n. The best mean per column (max, or min for lower-is-better metrics; ties all marked) is bold in
md/latex and starred in console/csv. Missing cells are ``–``. Failed runs are excluded from cells, counted in
their cell's annotation and listed below the table.
"""
from __future__ import annotations

import csv
import io
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from tabulate import DataRow, Line, TableFormat, tabulate

from offpolicy_moe.report.names import check_axes, check_metrics
from offpolicy_moe.report.runs import RunRecord, axis_order, load_runs, natural_sort

DASH = "–"
FORMATS = ("md", "csv", "latex", "console")
#: the per-run aggregation of tables AND plots when neither the command line, the entry nor the sweep's
#: ``report.agg`` names one (see :func:`offpolicy_moe.report.spec.default_agg`)
DEFAULT_AGG = "final"


@dataclass
class MetricSpec:
    """A metric name and its direction (``name:lower`` / ``name:higher`` in a metric list)."""

    name: str
    higher: bool = True


@dataclass
class Cell:
    values: list[float] = field(default_factory=list)
    failed: int = 0
    stable: int = 0   # collapse aggregation: runs that never collapsed

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> Optional[float]:
        return sum(self.values) / len(self.values) if self.values else None

    @property
    def std(self) -> Optional[float]:
        """Sample standard deviation sqrt(Σ(x − mean)² / (n − 1)); None for n < 2."""
        n = len(self.values)
        if n < 2:
            return None
        m = sum(self.values) / n
        return math.sqrt(sum((x - m) ** 2 for x in self.values) / (n - 1))


@dataclass
class Table:
    row_header: str
    row_labels: list[str]
    col_labels: list[str]
    col_metrics: list[MetricSpec]
    cells: dict[tuple[str, str], Cell]
    best: set[tuple[str, str]]
    caption: str
    failed: list[tuple[str, str]] = field(default_factory=list)  # (run name, first error line)
    incomplete: list[tuple[str, str]] = field(default_factory=list)  # (run name, status)
    missing_metric: list[tuple[str, str]] = field(default_factory=list)  # (run name, metric)

    def notes(self) -> list[str]:
        out = []
        if self.failed:
            out.append(f"Failed runs ({len(self.failed)}): " + "; ".join(f"{n} ({e})" for n, e in self.failed))
        if self.incomplete:
            out.append(
                f"Incomplete runs, excluded ({len(self.incomplete)}): "
                + "; ".join(f"{n} (status {s})" for n, s in self.incomplete)
            )
        if self.missing_metric:
            out.append(
                f"Runs without the metric ({len(self.missing_metric)}): "
                + "; ".join(f"{n} ({m})" for n, m in self.missing_metric)
            )
        return out


def parse_metrics(spec: str | Sequence[str], default_higher: bool = True) -> list[MetricSpec]:
    """``"eval/accuracy,mismatch/k3_kl:lower"`` -> metric specs (suffix ``:lower``/``:higher`` sets direction)."""
    items = [s for part in ([spec] if isinstance(spec, str) else spec) for s in str(part).split(",")]
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        higher = default_higher
        for suffix, h in ((":lower", False), (":higher", True), (":min", False), (":max", True)):
            if item.endswith(suffix):
                item, higher = item[: -len(suffix)], h
        out.append(MetricSpec(item, higher))
    if not out:
        raise ValueError("no metric given (--metric NAME[,NAME...])")
    return out


COLLAPSE_WINDOW = 5


def collapse_step(points: Sequence[tuple[float, float]], frac: float = 0.5,
                  window: int = COLLAPSE_WINDOW) -> Optional[float]:
    """Step at which a series collapses, or ``None`` if it never does.

    ``s_t`` = mean of the last ``window`` values up to t; the collapse step is the first t with
    ``s_t < frac * max_{u<=t} s_u`` (and that best trailing mean > 0). Used for reward curves: the R3 and M2PO
    papers report the step where training reward collapses.
    """
    if not 0 < frac < 1:
        raise ValueError(f"collapse fraction must be in (0, 1), got {frac}")
    best = -math.inf
    ys: list[float] = []
    for step, y in points:
        ys.append(y)
        trail = ys[-window:]
        s = sum(trail) / len(trail)
        if len(ys) >= window and best > 0 and s < frac * best:
            return step
        if len(ys) >= window:
            best = max(best, s)
    return None


def aggregate_series(values: Sequence[float], agg: str, higher: bool = True,
                     steps: Optional[Sequence[float]] = None) -> Optional[float]:
    """Reduce one run's series to a number (see the module table). ``None`` for an empty series.

    ``collapse:F`` returns the collapse step (``steps`` default to 0, 1, ...) or ``math.inf`` when the run never
    collapses.
    """
    vals = list(values)
    kind, _, arg = agg.partition(":")
    if kind not in ("final", "last", "best", "mean_last", "min", "max", "collapse"):
        raise ValueError(f"unknown --agg {agg!r}; expected final, best, mean_last:N, min, max or collapse[:F]")
    if kind == "collapse":
        try:
            frac = float(arg) if arg else 0.5
        except ValueError:
            raise ValueError(f"--agg collapse:F needs a number F in (0, 1), got {agg!r}") from None
        if not 0 < frac < 1:
            raise ValueError(f"--agg collapse:F needs F in (0, 1), got {agg!r}")
        if not vals:
            return None
        xs = list(steps) if steps is not None else [float(i) for i in range(len(vals))]
        step = collapse_step(list(zip(xs, vals)), frac)
        return math.inf if step is None else step
    if kind == "mean_last":
        try:
            n = int(arg)
        except ValueError:
            raise ValueError(f"--agg mean_last:N needs an integer N >= 1, got {agg!r}") from None
        if n < 1:
            raise ValueError(f"--agg mean_last:N needs N >= 1, got {agg!r}")
    elif arg:
        raise ValueError(f"--agg {kind} takes no argument, got {agg!r}")
    if not vals:
        return None
    if kind in ("final", "last"):
        return vals[-1]
    if kind == "best":
        return max(vals) if higher else min(vals)
    if kind == "min":
        return min(vals)
    if kind == "max":
        return max(vals)
    tail = vals[-n:]
    return sum(tail) / len(tail)


def build_table(
    sweep_dir: str | Path,
    rows: Sequence[str] | str,
    cols: Sequence[str] | str | None,
    metrics: Sequence[MetricSpec] | str,
    agg: str = DEFAULT_AGG,
    where: Optional[dict[str, str]] = None,
    runs: Optional[list[RunRecord]] = None,
) -> Table:
    """Aggregate the run folders of ``sweep_dir`` into a :class:`Table`.

    ``rows``/``cols``: axis names (comma-separated or lists; ``cols`` may be empty: one column per metric).
    ``where``: ``{axis: label}`` filters. Every other axis that varies among the selected runs is an error
    (it would silently be averaged over), as is an unknown axis.
    """
    rows = _split(rows)
    cols = _split(cols)
    if not rows:
        raise ValueError("--rows needs at least one axis")
    mspecs = parse_metrics(metrics) if isinstance(metrics, str) else list(metrics)
    aggregate_series([], agg)  # validates agg
    where = {k: str(v) for k, v in (where or {}).items()}
    all_runs = runs if runs is not None else load_runs(sweep_dir)
    if not all_runs:
        raise ValueError(f"no run folders found in '{sweep_dir}'")
    sel = [r for r in all_runs if all(r.value_of(k) == v for k, v in where.items())]
    if not sel:
        raise ValueError(f"no run matches --where {where}")
    check_axes(sel, [*rows, *cols])
    check_metrics([r for r in sel if r.completed] or sel, [m.name for m in mspecs])
    used = set(rows) | set(cols) | set(where) | {"seed"}
    for ax in sorted({a for r in sel for a in r.axes} - used):
        labels = sorted({r.axes.get(ax, "") for r in sel})
        if len(labels) > 1:
            raise ValueError(
                f"axis '{ax}' varies ({', '.join(labels)}) but is not in --rows/--cols: add it, or pick one "
                f"value with --where {ax}={labels[0]}"
            )

    order = axis_order(sweep_dir)

    def labels_for(axes: list[str]) -> tuple[list[str], dict[str, list[str]]]:
        per_axis = {a: natural_sort([r.value_of(a) or DASH for r in sel], order.get(a)) for a in axes}
        combos = [", ".join(c) for c in itertools.product(*[per_axis[a] for a in axes])]
        return combos, per_axis

    row_labels, _ = labels_for(rows)
    col_combos, _ = labels_for(cols) if cols else ([""], {})
    if cols and len(cols) == 1:
        col_names = {c: f"{cols[0]}={c}" for c in col_combos}
    else:
        col_names = {c: c for c in col_combos}
    col_labels, col_metrics, col_key = [], [], {}
    for c in col_combos:
        for m in mspecs:
            if not cols:
                label = m.name
            elif len(mspecs) == 1:
                label = col_names[c]
            else:
                label = f"{col_names[c]} {m.name}"
            col_labels.append(label)
            col_metrics.append(m)
            col_key[(c, m.name)] = label

    cells: dict[tuple[str, str], Cell] = {}
    failed, incomplete, missing = [], [], []
    for r in sel:
        rl = ", ".join(r.value_of(a) or DASH for a in rows)
        cl = ", ".join(r.value_of(a) or DASH for a in cols) if cols else ""
        if r.failed:
            failed.append((r.name, (r.error or r.status).strip().splitlines()[0] if (r.error or r.status) else r.status))
            for m in mspecs:
                cells.setdefault((rl, col_key[(cl, m.name)]), Cell()).failed += 1
            continue
        if not r.completed:
            incomplete.append((r.name, r.status))
            continue
        for m in mspecs:
            pts = r.series(m.name)
            v = aggregate_series([y for _, y in pts], agg, m.higher, steps=[x for x, _ in pts])
            if v is None:
                missing.append((r.name, m.name))
                continue
            cell = cells.setdefault((rl, col_key[(cl, m.name)]), Cell())
            if math.isinf(v):       # collapse aggregation: this run never collapsed
                cell.stable += 1
            else:
                cell.values.append(v)

    best: set[tuple[str, str]] = set()
    # a collapse step has no "best": an early collapse is bad, no collapse is best but has no number
    for label, m in zip(col_labels, col_metrics if not agg.startswith("collapse") else []):
        means = [(cells[(rl, label)].mean, rl) for rl in row_labels if (rl, label) in cells and cells[(rl, label)].n]
        if means:
            target = max(x for x, _ in means) if m.higher else min(x for x, _ in means)
            best |= {(rl, label) for x, rl in means if x == target}

    metric_txt = ", ".join(f"{m.name} ({'higher' if m.higher else 'lower'} is better)" for m in mspecs)
    caption = (f"{metric_txt}; agg {agg}; mean ± std (n runs) over seeds; best per column marked"
               if not agg.startswith("collapse") else
               f"{metric_txt}; agg {agg}: step of collapse, mean ± std (n runs that collapsed; k stable = runs "
               f"that never collapsed)")
    if where:
        caption += "; " + ", ".join(f"{k}={v}" for k, v in where.items())
    return Table(", ".join(rows) + (f" \\ {', '.join(cols)}" if cols else ""), row_labels, col_labels,
                 col_metrics, cells, best, caption, failed, incomplete, missing)


def format_number(x: float, digits: int = 3) -> str:
    """``digits`` significant digits (``%.{digits}g``)."""
    return f"{x:.{digits}g}"


def format_cell(cell: Optional[Cell], digits: int = 3) -> str:
    """``mean ± std (n)``; ``mean ± – (1)`` for one run; ``–`` when empty; failures appended (``; k failed``)."""
    if cell is None or (cell.n == 0 and cell.failed == 0 and cell.stable == 0):
        return DASH
    fail = f"; {cell.failed} failed" if cell.failed else ""
    fail += f"; {cell.stable} stable" if cell.stable else ""
    if cell.n == 0:
        return f"{DASH} (0{fail})"
    std = cell.std
    s = DASH if std is None else format_number(std, digits)
    return f"{format_number(cell.mean, digits)} ± {s} ({cell.n}{fail})"


def _md_rule(widths: list[int], _aligns) -> str:
    """``|---|---:|---:|``: the row header left, the cells right-aligned (cells are not padded)."""
    return "|" + "|".join("---" if i == 0 else "---:" for i in range(len(widths))) + "|"


def _latex_top(ncols: int):
    return lambda _widths, _aligns: "\\begin{tabular}{l" + "r" * (ncols - 1) + "}\n\\toprule"


#: GitHub-flavoured markdown without padding: ``| a | b |`` rows, so a cell reads the same in every table
MD_FORMAT = TableFormat(lineabove=None, linebelowheader=_md_rule, linebetweenrows=None, linebelow=None,
                        headerrow=DataRow("|", "|", "|"), datarow=DataRow("|", "|", "|"), padding=1,
                        with_header_hide=None)


def _latex_format(ncols: int) -> TableFormat:
    """booktabs ``tabular`` (``l`` then ``r`` columns); cells are escaped by the caller."""
    return TableFormat(lineabove=_latex_top(ncols), linebelowheader=Line("\\midrule", "", "", ""),
                       linebetweenrows=None, linebelow=Line("\\bottomrule\n\\end{tabular}", "", "", ""),
                       headerrow=DataRow("", "&", "\\\\"), datarow=DataRow("", "&", "\\\\"), padding=1,
                       with_header_hide=None)


def _grid(header: list[str], rows: list[list[str]], fmt, **kw) -> str:
    return tabulate(rows, header, tablefmt=fmt, disable_numparse=True, **kw)


def render_table(table: Table, fmt: str = "md", digits: int = 3, notes: bool = True) -> str:
    """Render as ``md`` | ``csv`` | ``latex`` | ``console`` (tabulate; csv with the csv module).

    Every format shows the same cells (:func:`format_cell`); the best cell per column is ``**bold**`` in md,
    ``\\textbf`` in latex and starred (``*``) in console and csv. Notes (failed runs...) are appended except for
    csv.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown --format {fmt!r}; expected one of {', '.join(FORMATS)}")
    body = [[format_cell(table.cells.get((r, c)), digits) for c in table.col_labels] for r in table.row_labels]
    marked = [[(r, c) in table.best for c in table.col_labels] for r in table.row_labels]
    header = [table.row_header, *table.col_labels]
    extra = table.notes() if notes else []

    def rows(mark, label=lambda s: s):
        return [[label(r), *[mark(label(c)) if m else label(c) for c, m in zip(cells, mk)]]
                for r, cells, mk in zip(table.row_labels, body, marked)]

    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerows([header, *rows(lambda c: f"{c}*")])
        return buf.getvalue()
    if fmt == "md":
        esc = lambda s: s.replace("|", "\\|")  # noqa: E731
        text = _grid([esc(h) for h in header], rows(lambda c: f"**{c}**", esc), MD_FORMAT, stralign=None)
        return "\n".join([f"*{table.caption}*", "", text] + ([""] + extra if extra else [])) + "\n"
    if fmt == "latex":
        tex = lambda s: _latex_escape(s).replace("±", "$\\pm$").replace(DASH, "--")  # noqa: E731
        text = _grid([tex(h) for h in header], rows(lambda c: f"\\textbf{{{c}}}", tex), _latex_format(len(header)),
                     stralign=None)
        return "\n".join([f"% {table.caption}", text] + [f"% {n}" for n in extra]) + "\n"
    text = _grid(header, rows(lambda c: f"{c} *"), "simple", colalign=("left",) + ("right",) * (len(header) - 1))
    return "\n".join([table.caption, text] + extra) + "\n"


_LATEX_SPECIAL = {"\\": "\\textbackslash{}", "&": "\\&", "%": "\\%", "#": "\\#", "_": "\\_", "$": "\\$",
                  "{": "\\{", "}": "\\}"}


def _latex_escape(s: str) -> str:
    """Escape LaTeX's special characters in one pass (a backslash's ``{}`` is not escaped again)."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in s)


def _split(v: Sequence[str] | str | None) -> list[str]:
    if v is None:
        return []
    items = [v] if isinstance(v, str) else list(v)
    return [x.strip() for item in items for x in str(item).split(",") if x.strip()]
