"""The ``report:`` section of an experiment (copied into the sweep folder as ``experiment.yaml``; its format is in
docs/sweeps.md).

:func:`parse_report` is its one parser, into a :class:`ReportSpec` of :class:`TableSpec`, :class:`PlotSpec` and
:class:`~offpolicy_moe.report.claims.Claim` records: the sweep planner checks an experiment file with it before any
run, and ``table`` / ``plot`` read the copy in the sweep folder with it.  Tables and plots of one sweep aggregate
the same way unless an entry or ``--agg`` says otherwise (:func:`default_agg`); likewise ``report.metric`` is the
metric of every table and claim that names none and the curve of every plot that names none (a sweep that reports
``eval/avg@16`` instead of ``eval/accuracy`` says so once), filled in here, so the parsed entries always name their
metrics.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from offpolicy_moe.report.claims import parse_claims
from offpolicy_moe.report.table import DEFAULT_AGG, parse_metrics

__all__ = ["TableSpec", "PlotSpec", "ReportSpec", "parse_report", "report_spec", "default_agg", "parse_where",
           "metric_names", "TABLE_KEYS", "PLOT_KEYS", "REPORT_KEYS"]


@dataclass(frozen=True)
class TableSpec:
    """One table: ``rows`` (and ``cols``) axes, the ``metric`` list (``"a,b:lower"`` or a list of names; in an
    experiment file ``report.metric`` when left out), the aggregation, a ``where`` filter, and an optional
    ``baseline`` row for paired differences."""

    rows: str
    metric: Any = None            # "a,b" or a list of names (report.table.parse_metrics reads both)
    cols: Optional[str] = None
    title: Optional[str] = None
    agg: Optional[str] = None
    where: dict = field(default_factory=dict)
    lower_is_better: bool = False
    digits: Optional[int] = None
    baseline: Optional[str] = None


@dataclass(frozen=True)
class PlotSpec:
    """One figure: curves of ``metrics`` per value of ``by`` (with a seed ``band``), or, with ``staleness_axis``,
    the aggregated metric against that numeric axis; ``metrics`` left out of an experiment file: ``report.metric``."""

    by: str
    metrics: Any = None           # "a,b" or a list of names (report.table.parse_metrics reads both)
    title: Optional[str] = None
    band: str = "std"
    where: dict = field(default_factory=dict)
    staleness_axis: Optional[str] = None
    agg: Optional[str] = None


@dataclass(frozen=True)
class ReportSpec:
    """The ``report:`` section, parsed and checked."""

    tables: tuple = ()
    plots: tuple = ()
    claims: tuple = ()
    agg: Optional[str] = None
    metric: Optional[str] = None   # the default metric of the entries that name none (already filled in)


TABLE_KEYS = frozenset(f.name for f in fields(TableSpec))
PLOT_KEYS = frozenset(f.name for f in fields(PlotSpec))
REPORT_KEYS = frozenset({"tables", "plots", "agg", "claims", "metric"})


def parse_where(items) -> dict[str, str]:
    """``["staleness=4", "algorithm=m2po"]`` (``--where``, repeatable) -> ``{axis: label}``."""
    out = {}
    for it in items or []:
        if "=" not in it:
            raise ValueError(f"--where expects AXIS=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _entry(cls: type, item: Any, where: str, metric_key: str, default_metric: Optional[str]) -> Any:
    """``cls(**item)`` with one-line errors naming ``where`` and the key: not a mapping, unknown or missing keys,
    a ``where`` filter that is not a mapping, a metric list that names no metric (:func:`check_metric_list`).  The
    entry's ``metric_key`` left out is ``default_metric`` (``report.metric``); with neither, the key is missing."""
    keys = {f.name for f in fields(cls)}
    if not isinstance(item, Mapping):
        raise ValueError(f"{where} must be a mapping")
    bad = set(item) - keys
    if bad:
        raise ValueError(f"{where}: unknown key(s) {sorted(bad)}; allowed {sorted(keys)}")
    missing = [f.name for f in fields(cls)
               if f.name not in item and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    values = dict(item)
    if values.get(metric_key) is None:
        if default_metric is None:
            raise ValueError(f"{where}: missing key(s) ['{metric_key}'] (or give report.metric, the metric of the "
                             f"entries that name none)")
        values[metric_key] = default_metric
    check_metric_list(values[metric_key], f"{where}.{metric_key}")
    if values.get("where") is not None and not isinstance(values["where"], Mapping):
        raise ValueError(f"{where}.where must be a mapping of axis -> value")
    values["where"] = dict(values.get("where") or {})
    return cls(**values)


def check_metric_list(value: Any, where: str) -> None:
    """One-line :class:`ValueError` naming ``where`` unless ``value`` is a metric list: a string ``"a,b:lower"``
    or a list of such strings, naming at least one metric."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(x, str) for x in items):
        raise ValueError(f"{where} must be a metric name, a comma list or a list of names, got {value!r}")
    try:
        parse_metrics(items)
    except ValueError:
        raise ValueError(f"{where} names no metric, got {value!r}") from None


def _default_metric(raw: Mapping, where: str) -> Optional[str]:
    """``report.metric``, checked: one metric name (a ``:lower`` / ``:higher`` suffix allowed), or None."""
    metric = raw.get("metric")
    if metric is None:
        return None
    if not isinstance(metric, str) or len([m for m in metric.split(",") if m.strip()]) != 1:
        raise ValueError(f"{where}: report.metric must name one metric (e.g. eval/avg@16), got {metric!r}")
    check_metric_list(metric, f"{where}: report.metric")
    return metric.strip()


def parse_report(raw: Any, where: str) -> ReportSpec:
    """The one parser of a ``report:`` section (``raw``: its mapping, or None); every problem is a one-line
    ``ValueError`` naming ``where`` (the file) and the entry."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: 'report' must be a mapping with 'tables', 'plots', 'agg', 'metric' and/or "
                         f"'claims'")
    bad_top = set(raw) - REPORT_KEYS
    if bad_top:
        raise ValueError(f"{where}: report: unknown key(s) {sorted(bad_top)}; allowed {sorted(REPORT_KEYS)}")
    metric = _default_metric(raw, where)
    tables = tuple(_entry(TableSpec, t, f"{where}: report.tables[{i}]", "metric", metric)
                   for i, t in enumerate(raw.get("tables") or []))
    plots = tuple(_entry(PlotSpec, t, f"{where}: report.plots[{i}]", "metrics", metric)
                  for i, t in enumerate(raw.get("plots") or []))
    claims = tuple(parse_claims(raw.get("claims"), where=f"{where}: report", default_metric=metric))
    agg = raw.get("agg")
    if agg is not None and not isinstance(agg, str):
        raise ValueError(f"{where}: report.agg must be a string such as 'final' or 'mean_last:3', got {agg!r}")
    return ReportSpec(tables, plots, claims, agg, metric)


def metric_names(spec: ReportSpec) -> dict[str, list[str]]:
    """Every metric the report reads (direction suffixes dropped) -> the entries that read it
    (``report.tables[0]``, ``report.plots[1]``, ``report.claims[2]``), in the order of the file."""
    out: dict[str, list[str]] = {}
    entries = [(f"report.tables[{i}]", t.metric) for i, t in enumerate(spec.tables)]
    entries += [(f"report.plots[{i}]", p.metrics) for i, p in enumerate(spec.plots)]
    entries += [(f"report.claims[{c.index}]", c.metric) for c in spec.claims]
    for at, value in entries:
        for m in parse_metrics(value):
            out.setdefault(m.name, []).append(at)
    return out


def report_spec(sweep_dir: str | Path) -> ReportSpec:
    """The :class:`ReportSpec` of ``<sweep>/experiment.yaml`` (empty when absent)."""
    p = Path(sweep_dir) / "experiment.yaml"
    raw = {}
    if p.is_file():
        try:
            raw = (yaml.safe_load(p.read_text()) or {}).get("report") or {}
        except yaml.YAMLError as exc:   # incl. python/object tags: refused by safe_load, never built
            raise ValueError(f"{p}: cannot parse YAML: {str(exc).splitlines()[0]}") from None
    return parse_report(raw, str(p))


def default_agg(sweep_dir: str | Path) -> str:
    """The aggregation of a table or plot of this sweep that names none: ``report.agg`` of its experiment file,
    else :data:`~offpolicy_moe.report.table.DEFAULT_AGG`."""
    return report_spec(sweep_dir).agg or DEFAULT_AGG
