"""Plots from run folders (matplotlib, Agg backend; PNG files): curves per step with seed bands
(:func:`plot_curves`) and an aggregate against staleness (:func:`plot_staleness`, symlog axis so 0 sits at the
origin).  Failed and incomplete runs are left out (their count goes in the title).
"""
from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Optional, Sequence

from offpolicy_moe.report.names import check_axes, check_metrics
from offpolicy_moe.report.runs import RunRecord, axis_order, load_runs, natural_sort
from offpolicy_moe.report.table import DEFAULT_AGG, aggregate_series, parse_metrics


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def set_grid_ticks(ax, values: Sequence[float]) -> None:
    """Major ticks exactly at the grid's values (``0 1 4 16``), no minor ticks: a symlog axis would otherwise tick
    at powers of ten that the sweep never ran."""
    ax.set_xticks(list(values), [f"{v:g}" for v in values])
    ax.xaxis.set_minor_locator(_plt().NullLocator())


def metric_filename(metric: str) -> str:
    """``reward/mean`` -> ``reward_mean``, ``eval/pass@4`` -> ``eval_pass@4``: every character but letters, digits,
    ``.``, ``_``, ``-`` and ``@`` becomes ``_`` (a sampled metric's file keeps its ``@k``)."""
    return re.sub(r"[^A-Za-z0-9._@-]+", "_", metric).strip("_") or "metric"


def _select(sweep_dir, runs, where):
    runs = runs if runs is not None else load_runs(sweep_dir)
    where = {k: str(v) for k, v in (where or {}).items()}
    sel = [r for r in runs if all(r.value_of(k) == v for k, v in where.items())]
    if not sel:
        raise ValueError(f"no run folders in '{sweep_dir}' match {where or 'anything'}")
    good = [r for r in sel if r.completed]
    return good, len(sel) - len(good), where


def _facets(runs: list[RunRecord], fixed: set[str], order) -> list[tuple[str, list[RunRecord]]]:
    varying = sorted(a for a in {a for r in runs for a in r.axes} - fixed - {"seed"}
                     if len({r.axes.get(a) for r in runs}) > 1)
    if not varying:
        return [("", runs)]
    per = {a: natural_sort([r.axes.get(a, "") for r in runs], order.get(a)) for a in varying}
    out = []
    for combo in itertools.product(*[per[a] for a in varying]):
        sub = [r for r in runs if all(r.axes.get(a) == v for a, v in zip(varying, combo))]
        if sub:
            out.append((", ".join(f"{a}={v}" for a, v in zip(varying, combo)), sub))
    return out


def plot_curves(
    sweep_dir: str | Path,
    metrics: Sequence[str] | str,
    by: str,
    out_dir: Optional[str | Path] = None,
    band: str = "std",
    where: Optional[dict[str, str]] = None,
    runs: Optional[list[RunRecord]] = None,
    skip_missing: bool = False,
) -> list[Path]:
    """Write ``<out_dir>/<metric>.png`` (default ``<sweep>/plots``) for each metric: one line per value of ``by``
    with a band (``std``: mean ± sample std; ``minmax``), other varying axes as side-by-side panels.  A metric no
    selected run logs raises ``ValueError`` (or is skipped with ``skip_missing``)."""
    if band not in ("std", "minmax", "none"):
        raise ValueError(f"unknown --band {band!r}; expected std, minmax or none")
    plt = _plt()
    good, n_bad, where = _select(sweep_dir, runs, where)
    check_axes(good, [by])
    if not skip_missing:
        check_metrics(good, [m.name for m in parse_metrics(metrics)])
    order = axis_order(sweep_dir)
    out = Path(out_dir) if out_dir is not None else Path(sweep_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    facets = _facets(good, {by, *where}, order)
    paths = []
    for m in parse_metrics(metrics):
        fig, axs = plt.subplots(1, len(facets), figsize=(5.2 * len(facets), 3.8), squeeze=False, sharey=True)
        drawn = 0
        for ax, (title, sub) in zip(axs[0], facets):
            groups = natural_sort([r.value_of(by) or "" for r in sub], order.get(by))
            for g in groups:
                series = [dict(r.series(m.name)) for r in sub if r.value_of(by) == g]
                series = [s for s in series if s and not any(math.isnan(k) for k in s)]
                if not series:
                    continue
                steps = sorted(set().union(*series))
                xs, mean, lo, hi = [], [], [], []
                for st in steps:
                    vals = [s[st] for s in series if st in s]
                    mu = sum(vals) / len(vals)
                    if band == "std" and len(vals) > 1:
                        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / (len(vals) - 1))
                        a, b = mu - sd, mu + sd
                    elif band == "minmax":
                        a, b = min(vals), max(vals)
                    else:
                        a = b = mu
                    xs.append(st), mean.append(mu), lo.append(a), hi.append(b)
                line, = ax.plot(xs, mean, label=f"{by}={g} (n={len(series)})", lw=1.6)
                if band != "none":
                    ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
                drawn += 1
            ax.set_xlabel("step")
            ax.set_title(title or m.name, fontsize=10)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        axs[0][0].set_ylabel(m.name)
        sup = f"{m.name}: mean with {'± std' if band == 'std' else 'min–max' if band == 'minmax' else 'no'} band"
        if n_bad:
            sup += f" ({n_bad} failed/incomplete runs left out)"
        fig.suptitle(sup, fontsize=10)
        fig.tight_layout()
        if not drawn:
            plt.close(fig)
            if skip_missing:
                continue
            raise ValueError(f"metric '{m.name}' is not logged by any selected run")
        p = out / f"{metric_filename(m.name)}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def plot_staleness(
    sweep_dir: str | Path,
    metrics: Sequence[str] | str,
    staleness_axis: str,
    by: str,
    out_dir: Optional[str | Path] = None,
    agg: str = DEFAULT_AGG,
    where: Optional[dict[str, str]] = None,
    runs: Optional[list[RunRecord]] = None,
) -> list[Path]:
    """Write ``<out_dir>/staleness_<metric>.png``: aggregate metric against staleness, one line per ``by`` value."""
    plt = _plt()
    good, n_bad, where = _select(sweep_dir, runs, where)
    order = axis_order(sweep_dir)
    check_axes(good, [staleness_axis, by])
    check_metrics(good, [m.name for m in parse_metrics(metrics)])
    out = Path(out_dir) if out_dir is not None else Path(sweep_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    facets = _facets(good, {by, staleness_axis, *where}, order)
    paths = []
    for m in parse_metrics(metrics):
        fig, axs = plt.subplots(1, len(facets), figsize=(5.2 * len(facets), 3.8), squeeze=False, sharey=True)
        xmax, grid = 1.0, set()
        for ax, (title, sub) in zip(axs[0], facets):
            for g in natural_sort([r.value_of(by) or "" for r in sub], order.get(by)):
                pts: dict[float, list[float]] = {}
                for r in sub:
                    if r.value_of(by) != g:
                        continue
                    try:
                        x = float(r.value_of(staleness_axis))
                    except (TypeError, ValueError):
                        raise ValueError(
                            f"staleness axis '{staleness_axis}' has a non-numeric value "
                            f"{r.value_of(staleness_axis)!r} in run {r.name}"
                        ) from None
                    pts_r = r.series(m.name)
                    v = aggregate_series([y for _, y in pts_r], agg, m.higher, steps=[x for x, _ in pts_r])
                    if v is not None and math.isfinite(v):
                        pts.setdefault(x, []).append(v)
                if not pts:
                    continue
                xs = sorted(pts)
                mus = [sum(pts[x]) / len(pts[x]) for x in xs]
                sds = [math.sqrt(sum((v - mu) ** 2 for v in pts[x]) / (len(pts[x]) - 1)) if len(pts[x]) > 1 else 0.0
                       for x, mu in zip(xs, mus)]
                ax.errorbar(xs, mus, yerr=sds, marker="o", capsize=3, lw=1.6, label=f"{by}={g}")
                xmax = max(xmax, max(xs))
                grid |= set(xs)
            ax.set_xscale("symlog", linthresh=1.0)
            ax.set_xlim(-0.2, xmax * 1.3)
            set_grid_ticks(ax, sorted(grid))
            ax.set_xlabel(staleness_axis)
            ax.set_title(title or m.name, fontsize=10)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        axs[0][0].set_ylabel(f"{m.name} ({agg})")
        sup = f"{m.name} ({agg}) vs {staleness_axis}: mean ± std over seeds"
        if n_bad:
            sup += f" ({n_bad} failed/incomplete runs left out)"
        fig.suptitle(sup, fontsize=10)
        fig.tight_layout()
        p = out / f"staleness_{metric_filename(m.name)}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths
