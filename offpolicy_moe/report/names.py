"""The metric and axis names a set of run folders knows, and the one-line refusal of a name it does not know.

A table or plot asked for a metric no selected run logged, or for an axis that is neither a sweep axis, ``seed``
nor a config leaf key, is refused with a did-you-mean, before anything is drawn.
"""
from __future__ import annotations

import difflib
import math
from typing import Iterable, Sequence

from offpolicy_moe.report.runs import RunRecord


def leaf_keys(d: dict, prefix: str = "") -> set[str]:
    """Dotted names of every non-mapping value of a nested dict (``{"a": {"b": 1}}`` -> ``{"a.b"}``)."""
    out: set[str] = set()
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= leaf_keys(v, key + ".")
        else:
            out.add(key)
    return out


def known_axes(runs: Iterable[RunRecord]) -> tuple[list[str], set[str]]:
    """``(sweep axes + seed, config leaf keys)`` of ``runs``."""
    runs = list(runs)
    axes = sorted({a for r in runs for a in r.axes}) + ["seed"]
    config_keys = set().union(*(leaf_keys(r.config) for r in runs)) if runs else set()
    return axes, config_keys


def known_metrics(runs: Iterable[RunRecord]) -> set[str]:
    """Every numeric metric logged in ``metrics.jsonl`` (or ``summary.json``'s ``final``) by any of ``runs``."""
    out: set[str] = set()
    for r in runs:
        for row in r.rows:
            out |= {k for k, v in row.items() if _numeric(v) and k != "step"}
        final = r.summary.get("final")
        if isinstance(final, dict):
            out |= {k for k, v in final.items() if _numeric(v)}
    return out


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest candidates, or ``""``."""
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def check_axes(runs: Sequence[RunRecord], names: Iterable[str]) -> None:
    """:class:`ValueError` naming the first of ``names`` that no run has as an axis or a config leaf key."""
    for name in names:
        if any(r.value_of(name) is not None for r in runs):
            continue
        axes, config_keys = known_axes(runs)
        raise ValueError(f"unknown axis '{name}': not a sweep axis ({', '.join(axes)}) nor a config key."
                         f"{did_you_mean(name, [*axes, *config_keys])}")


def check_metrics(runs: Sequence[RunRecord], names: Iterable[str]) -> None:
    """:class:`ValueError` naming the first of ``names`` that none of ``runs`` logged, with a did-you-mean."""
    known = None
    for name in names:
        known = known_metrics(runs) if known is None else known
        if name not in known:
            raise ValueError(f"unknown metric '{name}': not logged by any selected run.{did_you_mean(name, known)} "
                             f"({len(known)} metrics logged, e.g. {', '.join(sorted(known)[:6]) or 'none'})")


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
