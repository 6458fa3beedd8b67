"""Paired comparisons of two cells of a sweep over seeds: differences, a Student-t interval, a verdict
(docs/sweeps.md, "Paired differences" and "Claims").  Runs of one seed share their data order and initialisation,
so the comparison is paired:

* ``d_i = treatment_i − baseline_i`` for every seed in both cells (the others dropped and counted); on the log scale
  ``log10`` differences, reported back as ratios ``10**x``; one sample (:func:`compare_to_value`): ``d_i = t_i − c``;
* the 95% interval of the mean difference is ``mean ± t_{0.975, n−1} · sd / √n`` (sample sd); none for n < 2;
* ``higher`` / ``lower``: ``reproduced`` when the interval excludes 0 on the expected side, ``opposite`` on the
  other, ``not resolved`` when it contains 0, ``n too small`` with fewer than two pairs;
* ``same`` within ``margin`` m (log scale: a ratio factor, the band ±log10 m): ``reproduced`` when the interval lies
  inside ``[−m, +m]``, ``opposite`` when wholly outside, ``not resolved`` otherwise; two one-sided tests at 2.5%
  each (stricter than the common TOST at 5%, which uses a 90% interval).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional, Sequence

CONFIDENCE = 0.95
SCALES = ("linear", "log")
EXPECTS = ("higher", "lower", "same")
#: the directional expectations; ``same`` (equivalence) needs a margin instead
DIRECTIONS = ("higher", "lower")

REPRODUCED = "reproduced"
OPPOSITE = "opposite"
NOT_RESOLVED = "not resolved"
N_TOO_SMALL = "n too small"
NO_RUNS = "no runs"
#: follows an interval that excludes no effect (not ``*``, which marks a column's best cell in console/csv tables)
MARKER = "†"


@dataclass(frozen=True)
class Pairing:
    """The seeds both cells have, their values (in seed order) and the seeds only one cell has."""

    seeds: list[Hashable]
    treatment: list[float]
    baseline: list[float]
    only_treatment: list[Hashable] = field(default_factory=list)
    only_baseline: list[Hashable] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def unpaired(self) -> int:
        """How many runs were dropped for want of a partner seed."""
        return len(self.only_treatment) + len(self.only_baseline)


@dataclass(frozen=True)
class Interval:
    """The mean of ``n`` differences with its Student-t interval (``lo``/``hi`` None when n < 2)."""

    mean: float
    n: int
    sd: Optional[float] = None
    t: Optional[float] = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    confidence: float = CONFIDENCE

    @property
    def excludes_zero(self) -> bool:
        return self.lo is not None and (self.lo > 0 or self.hi < 0)


@dataclass(frozen=True)
class Comparison:
    """A paired comparison: the pairing, the interval on the difference scale and the scale; on the log scale
    :attr:`estimate`, :attr:`lo` and :attr:`hi` give the ``log10`` interval back as ratios."""

    pairing: Pairing
    interval: Optional[Interval]
    scale: str = "linear"
    #: a one-sample comparison against this constant (:func:`compare_to_value`); None for two cells
    baseline_value: Optional[float] = None

    @property
    def n(self) -> int:
        return self.pairing.n

    @property
    def estimate(self) -> Optional[float]:
        return None if self.interval is None else self._back(self.interval.mean)

    @property
    def lo(self) -> Optional[float]:
        return None if self.interval is None or self.interval.lo is None else self._back(self.interval.lo)

    @property
    def hi(self) -> Optional[float]:
        return None if self.interval is None or self.interval.hi is None else self._back(self.interval.hi)

    @property
    def excludes_zero(self) -> bool:
        """The interval excludes "no effect" (a difference of 0, a ratio of 1)."""
        return self.interval is not None and self.interval.excludes_zero

    @property
    def treatment_mean(self) -> Optional[float]:
        """Arithmetic mean of the treatment's paired values."""
        return _mean(self.pairing.treatment) if self.pairing.n else None

    @property
    def baseline_mean(self) -> Optional[float]:
        """Arithmetic mean of the baseline's paired values."""
        return _mean(self.pairing.baseline) if self.pairing.n else None

    def _back(self, x: float) -> float:
        return 10.0 ** x if self.scale == "log" else x


def pair_by_seed(treatment: Mapping[Hashable, float], baseline: Mapping[Hashable, float]) -> Pairing:
    """Match the per-seed values of two cells: the seeds present in both (sorted), their values, and the rest.

    >>> pair_by_seed({0: 1.0, 1: 2.0, 2: 3.0}, {1: 0.5, 2: 1.0, 3: 9.0}).seeds
    [1, 2]
    """
    common = _sorted_seeds(set(treatment) & set(baseline))
    return Pairing(
        seeds=common,
        treatment=[float(treatment[s]) for s in common],
        baseline=[float(baseline[s]) for s in common],
        only_treatment=_sorted_seeds(set(treatment) - set(baseline)),
        only_baseline=_sorted_seeds(set(baseline) - set(treatment)),
    )


def differences(pairing: Pairing, scale: str = "linear") -> list[float]:
    """``d_i`` over the paired seeds on ``scale``; :class:`ValueError` on an unknown scale, or on the log scale when a
    value is not > 0 (naming the seed)."""
    _check_scale(scale)
    if scale == "linear":
        return [t - b for t, b in zip(pairing.treatment, pairing.baseline)]
    for side, values in (("treatment", pairing.treatment), ("baseline", pairing.baseline)):
        for seed, v in zip(pairing.seeds, values):
            if not v > 0:
                raise ValueError(f"scale log needs values > 0, but the {side} of seed {seed} is {v:g}")
    return [math.log10(t) - math.log10(b) for t, b in zip(pairing.treatment, pairing.baseline)]


def t_quantile(n: int, confidence: float = CONFIDENCE) -> float:
    """``t_{(1 + confidence)/2, n−1}``: the two-sided Student-t critical value with ``n − 1`` degrees of freedom."""
    if n < 2:
        raise ValueError(f"a t interval needs n >= 2, got n = {n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    from scipy import stats   # about a second to import: only where an interval is computed, not at `--help`

    return float(stats.t.ppf(0.5 + confidence / 2, n - 1))


def t_interval(diffs: Sequence[float], confidence: float = CONFIDENCE) -> Optional[Interval]:
    """The mean of ``diffs`` and its interval ``mean ± t_{(1+c)/2, n−1} · sd / √n`` (sample sd, ddof 1).

    ``None`` for no differences; ``lo``/``hi``/``sd`` are None for a single one. With ``sd = 0`` the interval is
    the single point ``mean``.

    >>> iv = t_interval([1.0, 2.0, 3.0])
    >>> round(iv.lo, 4), round(iv.hi, 4)
    (-0.4841, 4.4841)
    """
    xs = [float(x) for x in diffs]
    n = len(xs)
    if n == 0:
        return None
    m = _mean(xs)
    if n < 2:
        return Interval(mean=m, n=n, confidence=confidence)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    t = t_quantile(n, confidence)
    half = t * sd / math.sqrt(n)
    return Interval(mean=m, n=n, sd=sd, t=t, lo=m - half, hi=m + half, confidence=confidence)


def compare(treatment: Mapping[Hashable, float], baseline: Mapping[Hashable, float], scale: str = "linear",
            confidence: float = CONFIDENCE) -> Comparison:
    """Pair two cells by seed and take the t interval of their differences on ``scale`` (``linear`` | ``log``)."""
    pairing = pair_by_seed(treatment, baseline)
    return Comparison(pairing, t_interval(differences(pairing, scale), confidence), scale)


def compare_to_value(treatment: Mapping[Hashable, float], value: float, scale: str = "linear",
                     confidence: float = CONFIDENCE) -> Comparison:
    """One sample: the t interval of ``mean over seeds of (treatment − value)`` (log10 on the log scale, reported as
    a ratio to ``value``); :attr:`Comparison.baseline_mean` is ``value``.  :class:`ValueError` for a non-finite value,
    or one that is not > 0 on the log scale.

    >>> c = compare_to_value({0: 0.8, 1: 0.9, 2: 0.7}, 1.0)
    >>> c.n, round(c.estimate, 4), round(c.hi, 4)
    (3, -0.2, 0.0484)
    """
    _check_scale(scale)
    v = float(value)
    if not math.isfinite(v) or (scale == "log" and not v > 0):
        raise ValueError(f"baseline_value must be a finite number{' > 0 on scale log' if scale == 'log' else ''}, "
                         f"got {value!r}")
    seeds = _sorted_seeds(set(treatment))
    pairing = Pairing(seeds=seeds, treatment=[float(treatment[s]) for s in seeds], baseline=[v] * len(seeds))
    return Comparison(pairing, t_interval(differences(pairing, scale), confidence), scale, baseline_value=v)


def margin_band(margin: float, scale: str = "linear") -> float:
    """The half width of the equivalence band on the interval's scale: ``margin`` (linear, > 0) or ``log10 margin``
    (log: ``margin`` is a ratio factor > 1, the band is ratios in ``[1/margin, margin]``)."""
    _check_scale(scale)
    m = float(margin) if isinstance(margin, (int, float)) and not isinstance(margin, bool) else float("nan")
    if scale == "log":
        if not (math.isfinite(m) and m > 1):
            raise ValueError(f"margin on scale log is a ratio factor and must be > 1 (1.1 = within ×/÷1.1), "
                             f"got {margin!r}")
        return math.log10(m)
    if not (math.isfinite(m) and m > 0):
        raise ValueError(f"margin must be a number > 0, got {margin!r}")
    return m


def verdict(comparison: Optional[Comparison], expect: str, margin: Optional[float] = None) -> str:
    """``reproduced`` | ``opposite`` | ``not resolved`` | ``n too small`` | ``no runs`` (see the module docstring);
    ``margin`` is required for ``expect="same"`` and refused otherwise."""
    if expect not in EXPECTS:
        raise ValueError(f"expect must be one of {', '.join(EXPECTS)}, got {expect!r}")
    if expect == "same" and margin is None:
        raise ValueError("expect same needs a margin")
    if expect != "same" and margin is not None:
        raise ValueError(f"a margin is only for expect same, not {expect}")
    band = None if margin is None else margin_band(margin, comparison.scale if comparison is not None else "linear")
    if comparison is None or comparison.n == 0:
        return NO_RUNS
    iv = comparison.interval
    if iv is None or iv.lo is None:
        return N_TOO_SMALL
    if band is not None:
        if -band <= iv.lo and iv.hi <= band:
            return REPRODUCED
        return OPPOSITE if (iv.lo > band or iv.hi < -band) else NOT_RESOLVED
    if not iv.excludes_zero:
        return NOT_RESOLVED
    went_higher = iv.lo > 0
    return REPRODUCED if went_higher == (expect == "higher") else OPPOSITE


def format_signed(x: float, digits: int = 3) -> str:
    """``+0.031`` / ``-0.012``: ``digits`` significant digits with an explicit sign."""
    return f"{x:+.{digits}g}"


def format_comparison(c: Comparison, digits: int = 3, marker: str = MARKER) -> str:
    """``+0.031 [-0.012, +0.074]`` (linear) or ``×0.0123 [×0.00708, ×0.0214]`` (log, ratios), followed by
    ``marker`` (``†``) when the interval excludes no effect (0, or a ratio of 1); the estimate alone when there is
    no interval; ``–`` with no pairs."""
    if c.interval is None:
        return "–"
    if c.scale == "log":
        num = lambda x: f"×{x:.{digits}g}"  # noqa: E731
    else:
        num = lambda x: format_signed(x, digits)  # noqa: E731
    if c.lo is None:
        return num(c.estimate)
    return f"{num(c.estimate)} [{num(c.lo)}, {num(c.hi)}]" + (marker if c.excludes_zero else "")


def _check_scale(scale: str) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _sorted_seeds(seeds: set) -> list:
    def key(s):
        try:
            return (0, float(s), str(s))
        except (TypeError, ValueError):
            return (1, 0.0, str(s))

    return sorted(seeds, key=key)
