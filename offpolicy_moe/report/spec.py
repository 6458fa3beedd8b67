"""The ``report:`` section of an experiment (copied into the sweep folder as ``experiment.yaml``).

::

    report:
      tables:
        - {title: Accuracy, rows: algorithm, cols: staleness, metric: eval/accuracy, agg: "mean_last:3"}
        - {rows: algorithm, metric: "eval/accuracy,mismatch/k3_kl:lower", where: {ministep: single}}
      plots:
        - {metrics: [reward/mean, eval/accuracy], by: algorithm, band: std}
        - {metrics: [eval/accuracy], by: algorithm, staleness_axis: staleness, agg: final}

``offpolicy-moe table SWEEP`` / ``offpolicy-moe plot SWEEP`` without ``--metric(s)`` render these.
"""
from __future__ import annotations

from pathlib import Path

import yaml

TABLE_KEYS = {"title", "rows", "cols", "metric", "agg", "where", "lower_is_better", "digits"}
PLOT_KEYS = {"title", "metrics", "by", "band", "where", "staleness_axis", "agg"}


def report_spec(sweep_dir: str | Path) -> dict:
    """``{"tables": [...], "plots": [...]}`` from ``<sweep>/experiment.yaml`` (empty lists when absent)."""
    p = Path(sweep_dir) / "experiment.yaml"
    raw = {}
    if p.is_file():
        try:
            raw = (yaml.safe_load(p.read_text()) or {}).get("report") or {}
        except yaml.YAMLError as exc:   # incl. python/object tags: refused by safe_load, never built
            raise ValueError(f"{p}: cannot parse YAML: {str(exc).splitlines()[0]}") from None
    tables, plots = list(raw.get("tables") or []), list(raw.get("plots") or [])
    for kind, items, keys in (("tables", tables, TABLE_KEYS), ("plots", plots, PLOT_KEYS)):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ValueError(f"{p}: report.{kind}[{i}] must be a mapping")
            bad = set(item) - keys
            if bad:
                raise ValueError(f"{p}: report.{kind}[{i}]: unknown key(s) {sorted(bad)}; allowed {sorted(keys)}")
    return {"tables": tables, "plots": plots}
