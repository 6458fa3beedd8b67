"""Claims: a paper's finding restated as "treatment vs baseline on one metric, in one direction", checked against a
sweep's runs with a paired t interval (:mod:`offpolicy_moe.report.stats`).  The ``report.claims`` format and the
verdicts are in docs/sweeps.md, "Claims".

Each side's completed runs are reduced to one value per seed by ``agg``; the two sides are paired by seed and
compared (:func:`~offpolicy_moe.report.stats.compare`), or, with ``baseline_value``, the treatment's seeds are
compared with the constant (:func:`~offpolicy_moe.report.stats.compare_to_value`).  :func:`parse_claims` checks
an entry on its own, :func:`check_claim_axes` its axis names against a grid before any run exists.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from offpolicy_moe.report.names import (check_axes, did_you_mean, known_metrics, leaf_keys, metric_did_you_mean,
                                        sampled_requirement)
from offpolicy_moe.report.runs import RunRecord, load_runs
from offpolicy_moe.report.stats import (
    CONFIDENCE,
    DIRECTIONS,
    EXPECTS,
    MARKER,
    NO_RUNS,
    REPRODUCED,
    SCALES,
    Comparison,
    compare,
    compare_to_value,
    format_comparison,
    margin_band,
    verdict,
)
from offpolicy_moe.report.table import DASH, aggregate_series, format_number, parse_metrics, render_grid

CLAIM_KEYS = ("claim", "paper", "metric", "agg", "treatment", "baseline", "baseline_value", "where", "expect",
              "margin", "scale", "explain")
#: required in every entry; besides these, exactly one of ``baseline`` / ``baseline_value``
REQUIRED_KEYS = ("claim", "paper", "metric", "treatment", "expect")
HEADER = ["claim", "paper", "treatment", "baseline", f"Δ or ratio [{CONFIDENCE:.0%} CI]", "n", "verdict"]


@dataclass(frozen=True)
class Claim:
    """One validated entry of ``report.claims`` (``index``: its position in the list)."""

    index: int
    claim: str
    paper: str
    metric: str
    treatment: dict[str, str]
    baseline: dict[str, str]       # empty for a one-sample claim (``baseline_value``)
    expect: str
    where: dict[str, str] = field(default_factory=dict)
    agg: Optional[str] = None
    scale: str = "linear"
    explain: str = ""
    higher_is_better: bool = True   # only for agg "best": from a ":lower" suffix of the metric
    baseline_value: Optional[float] = None   # a one-sample claim: the treatment vs this constant
    margin: Optional[float] = None           # expect same: the band ±margin (log: ratios within ×/÷margin)

    @property
    def one_sample(self) -> bool:
        return self.baseline_value is not None


@dataclass(frozen=True)
class Side:
    """One side of a claim: its per-seed values, or why it has none (``reason``), and its failed runs."""

    values: dict[str, float]
    reason: str = ""
    failed: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClaimResult:
    """A claim checked against a sweep: the aggregation used, the comparison (None with no runs) and verdict."""

    claim: Claim
    agg: str
    comparison: Optional[Comparison]
    verdict: str
    reason: str = ""
    failed: tuple[str, ...] = ()


def parse_claims(items: Any, where: str = "report", default_metric: Optional[str] = None) -> list[Claim]:
    """Validate ``report.claims`` (a list of mappings) into :class:`Claim` records; every problem is a one-line
    :class:`ValueError` naming ``<where>.claims[i]`` and the key.  ``default_metric`` (``report.metric``): the
    metric of an entry that names none."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise ValueError(f"{where}.claims must be a list of mappings, got {type(items).__name__}")
    return [parse_claim(item, i, where, default_metric) for i, item in enumerate(items)]


def parse_claim(item: Any, index: int, where: str = "report", default_metric: Optional[str] = None) -> Claim:
    """One claim entry, checked strictly: known keys only, required keys present (``metric``: ``default_metric``
    when left out), values of the right kind."""
    at = f"{where}.claims[{index}]"
    if not isinstance(item, Mapping):
        raise ValueError(f"{at} must be a mapping with keys {', '.join(REQUIRED_KEYS)} and baseline or "
                         f"baseline_value")
    if default_metric is not None and item.get("metric") is None:
        item = {**item, "metric": default_metric}
    unknown = sorted(set(map(str, item)) - set(CLAIM_KEYS))
    if unknown:
        raise ValueError(f"{at}: unknown key(s) {unknown}; allowed {list(CLAIM_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if item.get(k) in (None, "", {})]
    if missing:
        hint = " (or give report.metric, the metric of the entries that name none)" if "metric" in missing else ""
        raise ValueError(f"{at}: missing key(s) {missing}{hint}")
    has_baseline, has_value = item.get("baseline") not in (None, "", {}), item.get("baseline_value") is not None
    if has_baseline == has_value:
        raise ValueError(f"{at}: give exactly one of baseline (axis labels of runs) or baseline_value (a number), "
                         f"got {'both' if has_value else 'neither'}")
    for key in ("claim", "paper", "metric", "explain", "agg"):
        if key in item and item[key] is not None and not isinstance(item[key], str):
            raise ValueError(f"{at}.{key} must be a string, got {item[key]!r}")
    expect, scale = item["expect"], item.get("scale") or "linear"
    if expect not in EXPECTS:
        raise ValueError(f"{at}.expect must be one of {', '.join(DIRECTIONS)}, got {expect!r} (or same, with a "
                         f"margin, for an equivalence claim)")
    if scale not in SCALES:
        raise ValueError(f"{at}.scale must be one of {', '.join(SCALES)}, got {scale!r}")
    margin = item.get("margin")
    if expect == "same" and margin is None:
        raise ValueError(f"{at}: expect same needs margin: the largest difference that still counts as the same "
                         f"(a ratio factor > 1 on scale log)")
    if expect in DIRECTIONS and margin is not None:
        raise ValueError(f"{at}.margin is only for expect same, not expect {expect}")
    if margin is not None:
        try:
            margin_band(margin, scale)
        except ValueError as exc:
            raise ValueError(f"{at}.{exc}") from None
        margin = float(margin)
    value = item.get("baseline_value")
    if has_value:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{at}.baseline_value must be a finite number, got {value!r}")
        if scale == "log" and not value > 0:
            raise ValueError(f"{at}.baseline_value must be > 0 on scale log, got {value!r}")
        value = float(value)
    metric = _one_metric(item["metric"], at)
    agg = item.get("agg") or None
    if agg is not None:
        _check_agg(agg, f"{at}.agg")
    treatment = _labels(item["treatment"], f"{at}.treatment")
    baseline = _labels(item["baseline"], f"{at}.baseline") if has_baseline else {}
    fixed = _labels(item.get("where") or {}, f"{at}.where")
    if "seed" in treatment or "seed" in baseline:
        raise ValueError(f"{at}: runs are paired by seed, so seed cannot pick a side (use where: to fix seeds)")
    if has_baseline and treatment == baseline:
        raise ValueError(f"{at}: treatment and baseline select the same runs ({_fmt_labels(treatment)})")
    for side, labels in (("treatment", treatment), ("baseline", baseline)):
        both = sorted(set(labels) & set(fixed))
        if both:
            raise ValueError(f"{at}: axis '{both[0]}' is in both where and {side}; name it in one place")
    return Claim(index=index, claim=item["claim"], paper=item["paper"], metric=metric.name, treatment=treatment,
                 baseline=baseline, expect=expect, where=fixed, agg=agg, scale=scale,
                 explain=item.get("explain") or "", higher_is_better=metric.higher, baseline_value=value,
                 margin=margin)


def check_claim_axes(claims: Sequence[Claim], axes: Mapping[str, Sequence[str]],
                     configs: Iterable[Mapping] = (), where: str = "report") -> list[str]:
    """Check parsed claims against a grid before any run exists: every axis a claim names must be a grid axis
    (``axes``: name -> labels), ``seed``, or a leaf key of one of ``configs`` (the planned runs' resolved configs).

    An unknown name is a one-line :class:`ValueError` with a did-you-mean.  A label the grid axis lacks is only a
    warning (returned): such a claim reads ``no runs``, which may be meant.
    """
    config_keys: Optional[set[str]] = None
    warnings: list[str] = []
    for c in claims:
        at = f"{where}.claims[{c.index}]"
        for side, labels in (("treatment", c.treatment), ("baseline", c.baseline), ("where", c.where)):
            for name, label in labels.items():
                if name in axes:
                    known = [str(x) for x in axes[name]]
                    if label not in known:
                        warnings.append(f"{at}.{side}: grid axis '{name}' has no label '{label}' (labels: "
                                        f"{', '.join(known)}); the claim will read 'no runs'")
                    continue
                if name == "seed":
                    continue
                if config_keys is None:
                    config_keys = set().union(*(leaf_keys(dict(cfg)) for cfg in configs))
                if name not in config_keys:
                    raise ValueError(f"{at}.{side}: unknown axis '{name}': not a grid axis "
                                     f"({', '.join([*axes, 'seed'])}) nor a config key."
                                     f"{did_you_mean(name, [*axes, 'seed', *config_keys])}")
    return warnings


def evaluate_claims(sweep_dir: str | Path, claims: Sequence[Claim], default_agg: str,
                    runs: Optional[list[RunRecord]] = None) -> list[ClaimResult]:
    """Check every claim against the run folders of ``sweep_dir`` (or ``runs``)."""
    all_runs = runs if runs is not None else load_runs(sweep_dir)
    return [evaluate_claim(c, all_runs, default_agg) for c in claims]


def evaluate_claim(claim: Claim, runs: Sequence[RunRecord], default_agg: str) -> ClaimResult:
    """One claim: each side's per-seed values, their paired comparison and the verdict.  An axis no run knows, or
    one other than the seed that varies among one side's runs, is an error; a side with no usable runs is the
    verdict ``no runs``, with the reason."""
    at = f"report.claims[{claim.index}]"
    agg = claim.agg or default_agg
    _check_agg(agg, f"{at}.agg")
    if runs:
        try:
            check_axes(runs, [*claim.where, *claim.treatment, *claim.baseline])
        except ValueError as exc:
            raise ValueError(f"{at}: {exc}") from None
    named = [("treatment", claim.treatment)] + ([] if claim.one_sample else [("baseline", claim.baseline)])
    sides = {name: side_values(runs, {**labels, **claim.where}, claim, agg, name) for name, labels in named}
    failed = tuple(n for s in sides.values() for n in s.failed)
    reasons = [s.reason for s in sides.values() if s.reason]
    if reasons:
        return ClaimResult(claim, agg, None, NO_RUNS, "; ".join(reasons), failed)
    try:
        if claim.one_sample:
            comparison = compare_to_value(sides["treatment"].values, claim.baseline_value, claim.scale)
        else:
            comparison = compare(sides["treatment"].values, sides["baseline"].values, claim.scale)
    except ValueError as exc:
        raise ValueError(f"{at}: {exc}") from None
    reason = "" if comparison.n else "no seed has runs on both sides"
    return ClaimResult(claim, agg, comparison, verdict(comparison, claim.expect, claim.margin), reason, failed)


def side_values(runs: Sequence[RunRecord], labels: Mapping[str, str], claim: Claim, agg: str, name: str) -> Side:
    """``{seed: value}`` of the completed runs matching every ``labels`` (``name``: treatment | baseline)."""
    at = f"report.claims[{claim.index}]"
    desc = f"{name} ({_fmt_labels(labels)})"
    matching = [r for r in runs if all(r.value_of(k) == v for k, v in labels.items())]
    failed = tuple(r.name for r in matching if r.failed)
    done = [r for r in matching if r.completed]
    if not matching:
        return Side({}, f"no {desc} run", failed)
    if not done:
        return Side({}, f"no completed {desc} run ({len(failed)} failed, "
                        f"{len(matching) - len(failed)} unfinished)", failed)
    for ax in sorted({a for r in done for a in r.axes} - set(labels)):
        values = sorted({r.axes.get(ax, DASH) for r in done})
        if len(values) > 1:
            raise ValueError(f"{at}: axis '{ax}' varies among the {desc} runs ({', '.join(values)}); fix it with "
                             f"where: {{{ax}: {values[0]}}}")
    out: dict[str, float] = {}
    for r in done:
        pts = r.series(claim.metric)
        v = aggregate_series([y for _, y in pts], agg, claim.higher_is_better, steps=[x for x, _ in pts])
        if v is None:
            continue
        seed = r.value_of("seed")
        if seed is None or seed in out:
            raise ValueError(f"{at}: the {desc} runs cannot be paired by seed (run {r.name}: seed "
                             f"{'unknown' if seed is None else seed + ' repeated'})")
        out[seed] = v
    if not out:
        hint = metric_did_you_mean(claim.metric, known_metrics(done))
        need = sampled_requirement(claim.metric)
        need = f" (logged only by runs trained with {need})" if need else ""
        return Side({}, f"no {desc} run logged {claim.metric}.{hint}".rstrip(".") + need, failed)
    return Side(out, "", failed)


def verdict_text(result: ClaimResult) -> str:
    """The verdict, then why there are no runs, then the claim's ``explain`` unless it reproduced."""
    parts = [result.verdict + (f": {result.reason}" if result.reason else "")]
    if result.verdict != REPRODUCED and result.claim.explain:
        parts.append(result.claim.explain)
    return " — ".join(parts)


def claim_row(result: ClaimResult, digits: int = 3) -> list[str]:
    """The cells of one claim: claim, paper, treatment mean, baseline mean, Δ or ratio [CI], n, verdict."""
    c, claim = result.comparison, result.claim
    fixed = f"{format_number(claim.baseline_value, digits)} (fixed)" if claim.one_sample else None
    if c is None or c.n == 0:
        return [claim.claim, claim.paper, DASH, fixed or DASH, DASH, "0", verdict_text(result)]
    n = str(c.n) + (f" ({c.pairing.unpaired} unpaired)" if c.pairing.unpaired else "")
    return [claim.claim, claim.paper, format_number(c.treatment_mean, digits),
            fixed or format_number(c.baseline_mean, digits), format_comparison(c, digits), n, verdict_text(result)]


def claims_notes(results: Sequence[ClaimResult]) -> list[str]:
    """What the columns are, then each claim's metric, aggregation and the runs of its two sides."""
    out = [f"Paired by seed: Δ = mean over seeds of (treatment − baseline); on a log scale, ratio = "
           f"10^mean(log10 treatment − log10 baseline). [lo, hi]: {CONFIDENCE:.0%} Student-t interval, "
           f"mean ± t(0.975, n−1)·sd/√n (as ratios on a log scale); {MARKER} = it excludes no effect (0, or a ratio "
           f"of 1); "
           f"treatment, baseline = means over the paired seeds; n = seed pairs. Verdict: reproduced when the interval "
           f"excludes no effect in the paper's direction, opposite when it excludes it the other way, not resolved "
           f"when it contains it, n too small with fewer than 2 pairs."]
    if any(r.claim.one_sample for r in results):
        out.append("Baseline \"(fixed)\": a one-sample claim, the treatment's seeds against a constant: Δ = mean of "
                   "(treatment − constant) (on a log scale the ratio to it), n = treatment seeds, same t interval.")
    if any(r.claim.expect == "same" for r in results):
        out.append("Expect same within a margin m (on a log scale a ratio factor: ratios within [1/m, m]): "
                   "reproduced when the whole interval lies inside [−m, +m], opposite when it lies wholly outside "
                   "that band, not resolved otherwise.")
    for r in results:
        c = r.claim
        fixed = f"; where {_fmt_labels(c.where)}" if c.where else ""
        expect = c.expect
        if c.margin is not None:
            expect += f" within ×/÷{c.margin:g}" if c.scale == "log" else f" within ±{c.margin:g}"
        versus = (f"baseline value {c.baseline_value:g}" if c.one_sample else f"baseline {_fmt_labels(c.baseline)}")
        out.append(f"Claim {c.index + 1}: {c.metric}, agg {r.agg}, {c.scale} scale, expect {expect}; treatment "
                   f"{_fmt_labels(c.treatment)} vs {versus}{fixed}"
                   + (f"; failed runs: {', '.join(r.failed)}" if r.failed else ""))
    return out


def render_claims(results: Sequence[ClaimResult], fmt: str = "md", digits: int = 3, notes: bool = True) -> str:
    """The claims table in ``md`` | ``csv`` | ``latex`` | ``console`` (notes appended except for csv)."""
    rows = [claim_row(r, digits) for r in results]
    caption = "claims vs this sweep: paired by seed, 95% t interval (notes below)"
    return render_grid(list(HEADER), rows, fmt, caption, claims_notes(results) if notes else [], align="left")


def _one_metric(spec: str, at: str):
    metrics = parse_metrics(spec)
    if len(metrics) != 1:
        raise ValueError(f"{at}.metric must name one metric, got {spec!r}")
    return metrics[0]


def _check_agg(agg: str, at: str) -> None:
    try:
        aggregate_series([], agg)
    except ValueError as exc:
        raise ValueError(f"{at}: {exc}") from None
    if agg.startswith("collapse"):
        raise ValueError(f"{at}: agg {agg!r} cannot be paired (runs that never collapse have no value)")


def _labels(value: Any, at: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(v, (str, int, float, bool)) for v in value.values()):
        raise ValueError(f"{at} must be a mapping of axis -> label, got {value!r}")
    return {str(k): str(v) for k, v in value.items()}


def _fmt_labels(labels: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in labels.items()) or "all runs"
