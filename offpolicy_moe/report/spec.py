"""The ``report:`` section of an experiment (copied into the sweep folder as ``experiment.yaml``; its format is in
docs/sweeps.md).

:func:`parse_report` is its one parser, into a :class:`ReportSpec` of :class:`TableSpec`, :class:`PlotSpec` and
:class:`~offpolicy_moe.report.claims.Claim` records: the sweep planner checks an experiment file with it before any
run, and ``table`` / ``plot`` read the copy in the sweep folder with it.  Tables and plots of one sweep aggregate
the same way unless an entry or ``--agg`` says otherwise (:func:`default_agg`).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from offpolicy_moe.report.claims import Claim, parse_claims
from offpolicy_moe.report.table import DEFAULT_AGG

__all__ = ["TableSpec", "PlotSpec", "ReportSpec", "parse_report", "report_spec", "default_agg", "parse_where",
           "TABLE_KEYS", "PLOT_KEYS", "REPORT_KEYS"]


@dataclass(frozen=True)
class TableSpec:
    """One table: ``rows`` (and ``cols``) axes, the ``metric`` list (``"a,b:lower"``), the aggregation, a
    ``where`` filter, and an optional ``baseline`` row for paired differences."""

    rows: str
    metric: str
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
    the aggregated metric against that numeric axis."""

    metrics: Any                  # "a,b" or a list of names (report.table.parse_metrics reads both)
    by: str
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


TABLE_KEYS = frozenset(f.name for f in fields(TableSpec))
PLOT_KEYS = frozenset(f.name for f in fields(PlotSpec))
REPORT_KEYS = frozenset({"tables", "plots", "agg", "claims"})


def parse_where(items) -> dict[str, str]:
    """``["staleness=4", "algorithm=m2po"]`` (``--where``, repeatable) -> ``{axis: label}``."""
    out = {}
    for it in items or []:
        if "=" not in it:
            raise ValueError(f"--where expects AXIS=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _entry(cls: type, item: Any, where: str) -> Any:
    """``cls(**item)`` with one-line errors naming ``where`` and the key: not a mapping, unknown or missing keys,
    a ``where`` filter that is not a mapping."""
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
    if values.get("where") is not None and not isinstance(values["where"], Mapping):
        raise ValueError(f"{where}.where must be a mapping of axis -> value")
    values["where"] = dict(values.get("where") or {})
    return cls(**values)


def parse_report(raw: Any, where: str) -> ReportSpec:
    """The one parser of a ``report:`` section (``raw``: its mapping, or None); every problem is a one-line
    ``ValueError`` naming ``where`` (the file) and the entry."""
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: 'report' must be a mapping with 'tables', 'plots', 'agg' and/or 'claims'")
    bad_top = set(raw) - REPORT_KEYS
    if bad_top:
        raise ValueError(f"{where}: report: unknown key(s) {sorted(bad_top)}; allowed {sorted(REPORT_KEYS)}")
    tables = tuple(_entry(TableSpec, t, f"{where}: report.tables[{i}]") for i, t in enumerate(raw.get("tables") or []))
    plots = tuple(_entry(PlotSpec, t, f"{where}: report.plots[{i}]") for i, t in enumerate(raw.get("plots") or []))
    claims = tuple(parse_claims(raw.get("claims"), where=f"{where}: report"))
    agg = raw.get("agg")
    if agg is not None and not isinstance(agg, str):
        raise ValueError(f"{where}: report.agg must be a string such as 'final' or 'mean_last:3', got {agg!r}")
    return ReportSpec(tables, plots, claims, agg)


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
