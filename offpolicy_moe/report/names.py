"""The metric and axis names a set of run folders knows, and the one-line refusal of a name it does not know.

A table or plot asked for a metric no selected run logged, or for an axis that is neither a sweep axis, ``seed``
nor a config leaf key, is refused with a did-you-mean and the metrics of that family the runs did log, before
anything is drawn.  The sampled held-out metrics (``eval/avg@n``, ``eval/pass@k``, ``eval/maj@k``,
:mod:`offpolicy_moe.tasks.sampled_scores`) exist only in runs trained with ``eval.samples`` > 0:
:func:`sampled_requirement` says which value a name needs, and the refusal says it too.
"""
from __future__ import annotations

import difflib
import math
import re
from typing import Iterable, Optional, Sequence

from offpolicy_moe.report.runs import RunRecord
from offpolicy_moe.tasks.sampled_metrics import report_ks

#: the config key of the samples per held-out problem; a run logs the sampled metrics only when it is > 0
SAMPLES_KEY = "eval.samples"
#: ``eval/avg@n``, ``eval/pass@k``, ``eval/maj@k``: the names ``sampled_metrics`` gives with the trainer's prefix
SAMPLED_METRIC = re.compile(r"eval/(avg|pass|maj)@([1-9][0-9]*)")
#: how many names of a metric family an unknown-metric error lists before "+N more"
LISTED = 12


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
    """:class:`ValueError` naming the first of ``names`` that none of ``runs`` logged (:func:`unknown_metric`)."""
    known = None
    for name in names:
        known = known_metrics(runs) if known is None else known
        if name not in known:
            raise ValueError(unknown_metric(name, known))


def unknown_metric(name: str, known: Iterable[str]) -> str:
    """The one-line refusal of ``name``, which none of the runs logged: a did-you-mean, the metrics the runs did log
    in the same family (the part before the first ``/``), and for a sampled metric the ``eval.samples`` it needs."""
    known = set(known)
    text = f"unknown metric '{name}': not logged by any selected run.{metric_did_you_mean(name, known)} "
    text += logged_text(name, known)
    need = sampled_requirement(name)
    if need is not None:
        text += f"; {name} is logged only by runs trained with {need}"
    return text


def metric_did_you_mean(name: str, known: Iterable[str]) -> str:
    """:func:`did_you_mean` among the metrics ``known``; for a sampled metric among the sampled ones only
    (``eval/avg@16`` is not a misspelt ``eval/accuracy``)."""
    sampled = sampled_metric(name) is not None
    return did_you_mean(name, [k for k in known if not sampled or sampled_metric(k) is not None])


def logged_text(name: str, known: Iterable[str]) -> str:
    """What the runs did log, for an error about ``name``: the metrics of its family (``eval/...``), else a few of
    all."""
    known = sorted(set(known))
    family = name.split("/", 1)[0] + "/" if "/" in name else None
    same = [k for k in known if family is not None and k.startswith(family)]
    if not same:
        return f"({len(known)} metrics logged, e.g. {', '.join(known[:6]) or 'none'})"
    more = f", +{len(same) - LISTED} more" if len(same) > LISTED else ""
    return f"(the runs log {', '.join(same[:LISTED])}{more}; {len(known)} metrics in all)"


def sampled_metric(name: str) -> Optional[tuple[str, int]]:
    """``("avg", 16)`` for ``eval/avg@16`` (likewise ``pass``, ``maj``); None for any other name."""
    m = SAMPLED_METRIC.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else None


def logs_sampled(name: str, samples: int) -> bool:
    """Whether a run with ``eval.samples = samples`` logs the sampled metric ``name``: ``avg@n`` at n = samples,
    ``pass@k`` and ``maj@k`` at the k of :func:`~offpolicy_moe.tasks.sampled_metrics.report_ks` (1, 2, 4, ...,
    samples)."""
    parsed = sampled_metric(name)
    if parsed is None or samples < 1:
        return False
    kind, k = parsed
    return k == samples if kind == "avg" else k in report_ks(samples)


def sampled_requirement(name: str) -> Optional[str]:
    """The ``eval.samples`` that logs the sampled metric ``name``, in words (``eval.samples = 16``, ``eval.samples
    >= 4``); None for a name that is not a sampled metric."""
    parsed = sampled_metric(name)
    if parsed is None:
        return None
    kind, k = parsed
    if kind != "avg" and k & (k - 1) == 0:      # a power of two is reported for every n >= k
        return f"{SAMPLES_KEY} >= {k}"
    return f"{SAMPLES_KEY} = {k}"


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
