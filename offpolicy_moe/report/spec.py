"""The ``report:`` section of an experiment (copied into the sweep folder as ``experiment.yaml``).

::

    report:
      agg: "mean_last:3"          # optional: the sweep's default aggregation for every table and plot below AND
                                  # for `table`/`plot` command lines without --agg (else "final")
      tables:
        - {title: Accuracy, rows: algorithm, cols: staleness, metric: eval/accuracy, agg: "mean_last:3"}
        - {rows: algorithm, metric: "eval/accuracy,mismatch/k3_kl:lower", where: {ministep: single}}
        - {rows: algorithm, cols: staleness, metric: eval/accuracy, baseline: grpo}   # + paired Δ vs the grpo row
      plots:
        - {metrics: [reward/mean, eval/accuracy], by: algorithm, band: std}
        - {metrics: [eval/accuracy], by: algorithm, staleness_axis: staleness, agg: final}
      claims:                     # checked with a paired t interval; see offpolicy_moe.report.claims
        - {claim: "R3 lowers the k3 KL", paper: "~1e-3 -> ~1e-5", metric: mismatch/k3_kl, expect: lower,
           treatment: {algorithm: grpo+r3}, baseline: {algorithm: grpo}, where: {ministep: single}, scale: log}
        - {claim: "M2PO matches GRPO", paper: "fig. 1", metric: eval/accuracy, expect: same, margin: 0.02,
           treatment: {algorithm: m2po}, baseline: {algorithm: grpo}}            # equivalence within ±margin
        - {claim: "PR2 skill ratio < 1", paper: "-", metric: pr2/skill_ratio, expect: lower,
           treatment: {algorithm: grpo+pr2}, baseline_value: 1.0}                # one sample, vs a constant

``offpolicy-moe table SWEEP`` / ``offpolicy-moe plot SWEEP`` without ``--metric(s)`` render these. Tables and
plots of one sweep aggregate the same way unless an entry or ``--agg`` says otherwise (:func:`default_agg`).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from offpolicy_moe.report.claims import parse_claims
from offpolicy_moe.report.table import DEFAULT_AGG

TABLE_KEYS = {"title", "rows", "cols", "metric", "agg", "where", "lower_is_better", "digits", "baseline"}
REPORT_KEYS = {"tables", "plots", "agg", "claims"}
PLOT_KEYS = {"title", "metrics", "by", "band", "where", "staleness_axis", "agg"}


def parse_where(items) -> dict[str, str]:
    """``["staleness=4", "algorithm=m2po"]`` (``--where``, repeatable) -> ``{axis: label}``."""
    out = {}
    for it in items or []:
        if "=" not in it:
            raise ValueError(f"--where expects AXIS=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def report_spec(sweep_dir: str | Path) -> dict:
    """``{"tables": [...], "plots": [...], "claims": [Claim, ...], "agg": str | None}`` from
    ``<sweep>/experiment.yaml`` (empty when absent). Claims are validated here
    (:func:`~offpolicy_moe.report.claims.parse_claims`); every problem is one line naming the file and the entry."""
    p = Path(sweep_dir) / "experiment.yaml"
    raw = {}
    if p.is_file():
        try:
            raw = (yaml.safe_load(p.read_text()) or {}).get("report") or {}
        except yaml.YAMLError as exc:   # incl. python/object tags: refused by safe_load, never built
            raise ValueError(f"{p}: cannot parse YAML: {str(exc).splitlines()[0]}") from None
    bad_top = set(raw) - REPORT_KEYS
    if bad_top:
        raise ValueError(f"{p}: report: unknown key(s) {sorted(bad_top)}; allowed {sorted(REPORT_KEYS)}")
    tables, plots = list(raw.get("tables") or []), list(raw.get("plots") or [])
    for kind, items, keys in (("tables", tables, TABLE_KEYS), ("plots", plots, PLOT_KEYS)):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ValueError(f"{p}: report.{kind}[{i}] must be a mapping")
            bad = set(item) - keys
            if bad:
                raise ValueError(f"{p}: report.{kind}[{i}]: unknown key(s) {sorted(bad)}; allowed {sorted(keys)}")
    claims = parse_claims(raw.get("claims"), where=f"{p}: report")
    return {"tables": tables, "plots": plots, "claims": claims, "agg": raw.get("agg")}


def default_agg(sweep_dir: str | Path) -> str:
    """The aggregation of a table or plot of this sweep that names none: ``report.agg`` of its experiment file,
    else :data:`~offpolicy_moe.report.table.DEFAULT_AGG`."""
    return report_spec(sweep_dir)["agg"] or DEFAULT_AGG
