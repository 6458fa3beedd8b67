"""Ablation tables from run folders: cells ``mean ± std (n)`` over seeds, the best cell per column marked.

Per run, a metric's series is reduced to one number by ``agg`` (the table of aggregations is in docs/sweeps.md,
"Tables"); a cell aggregates its runs: mean, SAMPLE standard deviation (ddof = 1; ``–`` when n = 1) and n.
Failed runs are excluded from cells, counted in their cell's annotation and listed below the table.  With a
``baseline`` row, every other row's cell also shows its paired difference from the baseline row's cell in the same
column (:mod:`offpolicy_moe.report.stats`).
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
from offpolicy_moe.report.stats import CONFIDENCE, MARKER, Comparison, compare, format_comparison

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
    seeds: list[Optional[str]] = field(default_factory=list)   # the seed of each value (same order)

    def by_seed(self) -> dict[str, float]:
        """``{seed: value}`` of the cell's runs, for pairing; :class:`ValueError` if a seed is unknown or repeated
        (the cell then mixes runs that differ by something other than the seed)."""
        if len(self.seeds) != len(self.values):
            raise ValueError("cell values carry no seeds; cannot pair by seed")
        out: dict[str, float] = {}
        for seed, v in zip(self.seeds, self.values):
            if seed is None:
                raise ValueError("a run of this cell has no seed; cannot pair by seed")
            if seed in out:
                raise ValueError(f"seed {seed} appears twice in one cell; cannot pair by seed")
            out[seed] = v
        return out

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
    missing_metric: list[tuple[str, str, str]] = field(default_factory=list)  # (cell, metric, run name)
    baseline: Optional[str] = None   # the row label every other row is compared with
    paired: dict[tuple[str, str], Comparison] = field(default_factory=dict)   # (row, col) -> vs the baseline row

    def notes(self) -> list[str]:
        out = []
        if self.baseline is not None:
            out.append(paired_note(self.baseline))
        if self.failed:
            out.append(f"Failed runs ({len(self.failed)}): " + "; ".join(f"{n} ({e})" for n, e in self.failed))
        if self.incomplete:
            out.append(
                f"Incomplete runs, excluded ({len(self.incomplete)}): "
                + "; ".join(f"{n} (status {s})" for n, s in self.incomplete)
            )
        if self.missing_metric:
            out.append(f"Runs without the metric ({len(self.missing_metric)}), by cell:")
            out += missing_by_cell(self.missing_metric)
        return out


def missing_by_cell(missing: Sequence[tuple[str, str, str]], shown: int = 3) -> list[str]:
    """One line per (cell, metric) of the runs that lack the metric: how many, and the first ``shown`` names (a
    sweep of 100 such runs reads as a few lines, not 100)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for cell, metric, name in missing:
        groups.setdefault((cell, metric), []).append(name)
    lines = []
    for (cell, metric), names in groups.items():
        more = f", +{len(names) - shown} more" if len(names) > shown else ""
        lines.append(f"  {cell}: {metric}: {len(names)} run{'s' if len(names) != 1 else ''} "
                     f"({', '.join(names[:shown])}{more})")
    return lines


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
    """Step at which a series collapses, or ``None`` if it never does: the first t with
    ``s_t < frac * max_{u<=t} s_u`` (and that best > 0), ``s_t`` the mean of the last ``window`` values up to t.
    The R3 and M2PO papers report the step where training reward collapses."""
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
    """Reduce one run's series to a number by ``agg``; ``None`` for an empty series.  ``collapse:F`` returns the
    collapse step (``steps`` default to 0, 1, ...) or ``math.inf`` when the run never collapses."""
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
    baseline: Optional[str] = None,
) -> Table:
    """Aggregate the run folders of ``sweep_dir`` into a :class:`Table`.

    ``rows``/``cols``: axis names (``cols`` may be empty: one column per metric).  Every other axis that varies among
    the selected runs is an error (it would silently be averaged over), as is an unknown axis.  ``baseline``: a row
    label whose cells every other row is compared with, paired by seed (:func:`paired_cells`).
    """
    rows = _split(rows)
    cols = _split(cols)
    if not rows:
        raise ValueError("--rows needs at least one axis")
    mspecs = parse_metrics(metrics) if isinstance(metrics, str) else list(metrics)
    aggregate_series([], agg)  # validates agg
    where = {k: str(v) for k, v in (where or {}).items()}
    sel = _select_runs(sweep_dir, runs, rows, cols, where, mspecs)
    order = axis_order(sweep_dir)
    row_labels = _combos(sel, rows, order)
    col_labels, col_metrics, col_key = _column_layout(_combos(sel, cols, order) if cols else [""], cols, mspecs)
    cells, failed, incomplete, missing = _fill_cells(sel, rows, cols, mspecs, agg, col_key)
    best = _best_cells(cells, row_labels, col_labels, col_metrics if not agg.startswith("collapse") else [])
    paired = {}
    if baseline is not None:
        check_baseline(baseline, row_labels, agg)
        paired = paired_cells(cells, baseline, row_labels, col_labels)
    return Table(", ".join(rows) + (f" \\ {', '.join(cols)}" if cols else ""), row_labels, col_labels,
                 col_metrics, cells, best, _caption(mspecs, agg, where), failed, incomplete, missing, baseline, paired)


def check_baseline(baseline: str, row_labels: Sequence[str], agg: str) -> None:
    """:class:`ValueError` (one line) for a baseline that is not a row label, or a collapse aggregation (a run that
    never collapses has no value to pair)."""
    if baseline not in row_labels:
        raise ValueError(f"unknown baseline '{baseline}': not a row of this table (rows: {', '.join(row_labels)})")
    if agg.startswith("collapse"):
        raise ValueError(f"baseline '{baseline}': no paired differences with agg {agg} (runs that never collapse "
                         f"have no value to pair)")


def paired_cells(cells: dict[tuple[str, str], Cell], baseline: str, row_labels: Sequence[str],
                 col_labels: Sequence[str]) -> dict[tuple[str, str], Comparison]:
    """For every row but ``baseline`` and every column where both cells have values: the paired comparison
    (:func:`offpolicy_moe.report.stats.compare`) of the row's cell with the baseline row's cell, by seed."""
    out = {}
    for c in col_labels:
        base = cells.get((baseline, c))
        if base is None or not base.n:
            continue
        for r in row_labels:
            cell = cells.get((r, c))
            if r != baseline and cell is not None and cell.n:
                out[(r, c)] = compare(cell.by_seed(), base.by_seed())
    return out


def paired_note(baseline: str) -> str:
    """The note under a table with a baseline row: what Δ, the interval, the marker and n are."""
    return (f"Δ: paired difference (row − baseline row '{baseline}', same column) of the per-seed values, over the "
            f"seeds both cells have; [lo, hi]: {CONFIDENCE:.0%} Student-t interval of the mean difference, "
            f"mean ± t(0.975, n−1)·sd/√n; {MARKER} = the interval excludes 0; n = number of seed pairs (no interval "
            f"when n < 2).")


def _select_runs(sweep_dir: str | Path, runs: Optional[list[RunRecord]], rows: list[str], cols: list[str],
                 where: dict[str, str], mspecs: list[MetricSpec]) -> list[RunRecord]:
    """The runs matching ``where``; unknown axes or metrics, and a varying axis left out of the table, raise."""
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
    return sel


def _combos(sel: list[RunRecord], axes: list[str], order: dict) -> list[str]:
    """Labels of every combination of the ``axes``' values, each axis in its natural (or declared) order."""
    per_axis = {a: natural_sort([r.value_of(a) or DASH for r in sel], order.get(a)) for a in axes}
    return [", ".join(c) for c in itertools.product(*[per_axis[a] for a in axes])]


def _column_layout(col_combos: list[str], cols: list[str], mspecs: list[MetricSpec]):
    """Column labels (one per column combination and metric), their metrics, and ``(combo, metric) -> label``."""
    col_names = {c: f"{cols[0]}={c}" for c in col_combos} if cols and len(cols) == 1 else {c: c for c in col_combos}
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
    return col_labels, col_metrics, col_key


def _fill_cells(sel: list[RunRecord], rows: list[str], cols: list[str], mspecs: list[MetricSpec], agg: str,
                col_key: dict):
    """Each cell's aggregated values over seeds, and the failed, unfinished and metric-less runs."""
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
                missing.append((" / ".join(x for x in (rl, cl) if x), m.name, r.name))
                continue
            cell = cells.setdefault((rl, col_key[(cl, m.name)]), Cell())
            if math.isinf(v):       # collapse aggregation: this run never collapsed
                cell.stable += 1
            else:
                cell.values.append(v)
                cell.seeds.append(r.value_of("seed"))
    return cells, failed, incomplete, missing


def _best_cells(cells: dict, row_labels: list[str], col_labels: list[str], col_metrics: list[MetricSpec]) -> set:
    """The best mean per column (a collapse step has no "best": callers pass no metrics for it)."""
    best: set[tuple[str, str]] = set()
    for label, m in zip(col_labels, col_metrics):
        means = [(cells[(rl, label)].mean, rl) for rl in row_labels if (rl, label) in cells and cells[(rl, label)].n]
        if means:
            target = max(x for x, _ in means) if m.higher else min(x for x, _ in means)
            best |= {(rl, label) for x, rl in means if x == target}
    return best


def _caption(mspecs: list[MetricSpec], agg: str, where: dict[str, str]) -> str:
    metric_txt = ", ".join(f"{m.name} ({'higher' if m.higher else 'lower'} is better)" for m in mspecs)
    caption = (f"{metric_txt}; agg {agg}; mean ± std (n runs) over seeds; best per column marked"
               if not agg.startswith("collapse") else
               f"{metric_txt}; agg {agg}: step of collapse, mean ± std (n runs that collapsed; k stable = runs "
               f"that never collapsed)")
    if where:
        caption += "; " + ", ".join(f"{k}={v}" for k, v in where.items())
    return caption


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


def _md_rule(widths: list[int], _aligns, cell_rule: str = "---:") -> str:
    """``|---|---:|---:|``: the row header left, the cells right-aligned (or as ``cell_rule`` says; cells are not
    padded)."""
    return "|" + "|".join("---" if i == 0 else cell_rule for i in range(len(widths))) + "|"


def _latex_top(ncols: int, col: str = "r"):
    return lambda _widths, _aligns: "\\begin{tabular}{l" + col * (ncols - 1) + "}\n\\toprule"


def _md_format(align: str = "right") -> TableFormat:
    """GitHub-flavoured markdown without padding: ``| a | b |`` rows, so a cell reads the same in every table;
    cells right-aligned (``---:``) or, with ``align="left"``, left-aligned."""
    rule = "---:" if align == "right" else "---"
    return TableFormat(lineabove=None, linebelowheader=lambda w, a: _md_rule(w, a, rule), linebetweenrows=None,
                       linebelow=None, headerrow=DataRow("|", "|", "|"), datarow=DataRow("|", "|", "|"), padding=1,
                       with_header_hide=None)



def _latex_format(ncols: int, align: str = "right") -> TableFormat:
    """booktabs ``tabular`` (``l`` then ``r`` columns, or all ``l`` with ``align="left"``); cells are escaped by the
    caller."""
    return TableFormat(lineabove=_latex_top(ncols, "r" if align == "right" else "l"),
                       linebelowheader=Line("\\midrule", "", "", ""),
                       linebetweenrows=None, linebelow=Line("\\bottomrule\n\\end{tabular}", "", "", ""),
                       headerrow=DataRow("", "&", "\\\\"), datarow=DataRow("", "&", "\\\\"), padding=1,
                       with_header_hide=None)


def _grid(header: list[str], rows: list[list[str]], fmt, **kw) -> str:
    return tabulate(rows, header, tablefmt=fmt, disable_numparse=True, **kw)


def format_paired(c: Comparison, digits: int = 3) -> str:
    """``Δ +0.031 [-0.012, +0.074]† (n=3)``: the paired difference from the baseline row (``†``: the interval
    excludes 0); ``Δ – (n=0)`` when the two cells share no seed."""
    return f"Δ {format_comparison(c, digits)} (n={c.n})"


def render_table(table: Table, fmt: str = "md", digits: int = 3, notes: bool = True) -> str:
    """Render as ``md`` | ``csv`` | ``latex`` | ``console``: every format shows the same cells; the best cell per
    column is ``**bold**`` in md, ``\\textbf`` in latex and starred in console and csv.  Notes are appended except for
    csv."""
    def text(r: str, c: str) -> str:
        cell = format_cell(table.cells.get((r, c)), digits)
        pair = table.paired.get((r, c))
        return cell if pair is None else f"{cell}; {format_paired(pair, digits)}"

    body = [[r, *[text(r, c) for c in table.col_labels]] for r in table.row_labels]
    marked = [[(r, c) in table.best for c in table.col_labels] for r in table.row_labels]
    return render_grid([table.row_header, *table.col_labels], body, fmt, table.caption,
                       table.notes() if notes else [], marked)


def render_grid(header: list[str], rows: list[list[str]], fmt: str, caption: str = "",
                notes: Sequence[str] = (), marked: Optional[list[list[bool]]] = None,
                align: str = "right") -> str:
    """Render ``rows`` (label, then cells) under ``header``; ``marked[i][j]``: cell j of row i is bold or starred;
    ``caption`` and ``notes`` are written around the grid except in csv."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown --format {fmt!r}; expected one of {', '.join(FORMATS)}")
    marked = marked or [[False] * (len(r) - 1) for r in rows]
    extra = list(notes)

    def body(mark, label=lambda s: s):
        return [[label(r[0]), *[mark(label(c)) if m else label(c) for c, m in zip(r[1:], mk)]]
                for r, mk in zip(rows, marked)]

    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerows([header, *body(lambda c: f"{c}*")])
        return buf.getvalue()
    if fmt == "md":
        esc = lambda s: s.replace("|", "\\|").replace("*", "\\*").replace("~", "\\~")  # noqa: E731
        text = _grid([esc(h) for h in header], body(lambda c: f"**{c}**", esc), _md_format(align), stralign=None)
        return "\n".join([f"*{caption}*", "", text] + ([""] + extra if extra else [])) + "\n"
    if fmt == "latex":
        text = _grid([latex_text(h) for h in header], body(lambda c: f"\\textbf{{{c}}}", latex_text),
                     _latex_format(len(header), align), stralign=None)
        return "\n".join([f"% {caption}", text] + [f"% {n}" for n in extra]) + "\n"
    text = _grid(header, body(lambda c: f"{c} *"), "simple", colalign=("left",) + (align,) * (len(header) - 1))
    return "\n".join([caption, text] + extra) + "\n"


_LATEX_MATH = {"±": "$\\pm$", "Δ": "$\\Delta$", "×": "$\\times$", "−": "$-$", "√": "$\\surd$", "→": "$\\to$",
               "—": "---", MARKER: "$^\\dagger$", DASH: "--"}


def latex_text(s: str) -> str:
    """A cell for LaTeX: special characters escaped, then ``±``, ``Δ``, ``×``, ``−``, ``√``, ``→``, ``—``, ``†`` and
    ``–`` as LaTeX."""
    out = _latex_escape(s)
    for ch, tex in _LATEX_MATH.items():
        out = out.replace(ch, tex)
    return out


_LATEX_SPECIAL = {"\\": "\\textbackslash{}", "&": "\\&", "%": "\\%", "#": "\\#", "_": "\\_", "$": "\\$",
                  "{": "\\{", "}": "\\}", "~": "\\textasciitilde{}", "^": "\\textasciicircum{}"}


def _latex_escape(s: str) -> str:
    """Escape LaTeX's special characters in one pass (a backslash's ``{}`` is not escaped again)."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in s)


def _split(v: Sequence[str] | str | None) -> list[str]:
    if v is None:
        return []
    items = [v] if isinstance(v, str) else list(v)
    return [x.strip() for item in items for x in str(item).split(",") if x.strip()]
