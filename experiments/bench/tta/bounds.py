"""Pure arithmetic of every arm's bound (issue 54, item 6): the step time an arm's parts allow, and how far its
achieved step is from it.

No file access, no torch, no processes; tests/test_tta_bounds.py checks each function on hand-made inputs.

**The decode grid** (:class:`DecodeGrid`): milliseconds of one bare decode forward of the model for ``R`` rows
against a KV cache of ``C`` columns (``experiments/bench/bench_bounds.py`` ``decode_ms``), measured at a few rows
and columns around the run's own.  Between the measured points it is **bilinear** in (rows, columns): exact at
every grid point, and monotone between them in each axis wherever the measured grid is; outside the measured
range the nearest edge's value (flat: no trend is extrapolated).

**The generation floor of a step** (:func:`decode_floor_ms`): with the step's ``B`` responses of lengths
``L_i`` (tokens, EOS included) after a prompt padded to ``P`` columns, the decode forward after token ``t``
(``t = 0 .. max L - 2``; the last token needs no forward) must feed the rows whose response goes on,
``n_t = #{i : L_i >= t + 2}``, against ``P + t`` cached columns::

    floor = sum_t grid(n_t, P + t)

the prefill (one forward a step) is not counted.  When the run records only the step's mean length ``L`` (no
length percentiles), :func:`equal_length_floor_ms` gives every row that length::

    floor_eq(L) = sum_{t=0}^{m-2} grid(B, P + t) + f * grid(B, P + m - 1),   m = floor(L), f = L - m

(linear between integer lengths).  It is a lower bound of the exact floor of any lengths with that mean when
``grid(r, c) / r`` does not grow with ``r`` (a row costs no more in a larger batch) and ``grid(B, c)`` does not
fall with ``c``: the same row-forwards ``B (L - 1)`` then cost least packed into the fewest, earliest forwards.
``floor_eq`` is convex in ``L``, so the floor of a run's mean length is also at most the mean of its steps'.

**The bound of an arm** (:class:`ArmBound`), seconds a step (G = generation floor, O = old-log-prob pass, U =
update, the last two as the run measured them):

* ``sync`` (on-policy, one process): ``G + U`` (the update's own forward is the old policy);
* ``fixed`` (one process, batches k versions old): ``G + O + U``;
* ``async`` and ``stream`` (a worker beside the trainer): ``max(O + U, G)``, the trainer's busy time or the
  worker's generation, whichever is longer.

What the bound leaves out (reward scoring, weight publishing, waits, bookkeeping, the prefill, an engine slower
than the bare forward) is what ``achieved / bound`` (>= 1 when the grid was measured on the run's machine)
charges; the target is :data:`BOUND_TARGET`.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

#: the target of ``achieved / bound`` (issue 54, item 6)
BOUND_TARGET = 1.2
#: the arm kinds and their bound rules, in words
RULES = {"sync": "G + U", "fixed": "G + O + U", "async": "max(O + U, G)", "stream": "max(O + U, G)"}


def _positive(name: str, x: float) -> float:
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {x}")
    return x


@dataclass(frozen=True)
class DecodeGrid:
    """Bare decode forward milliseconds ``ms[i][j]`` at ``rows[i]`` rows and ``columns[j]`` KV columns, measured
    on ``threads`` torch threads.  :class:`ValueError` with one line for an empty or ragged grid, axes that are not
    strictly increasing integers >= 1, or a cell that is not a finite number > 0."""

    rows: tuple
    columns: tuple
    ms: tuple
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("rows", "columns"):
            axis = tuple(getattr(self, name))
            if not axis:
                raise ValueError(f"decode grid: no {name}")
            if any(int(x) != x or x < 1 for x in axis) or any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"decode grid: {name} must be strictly increasing integers >= 1, got {list(axis)}")
            object.__setattr__(self, name, tuple(int(x) for x in axis))
        ms = tuple(tuple(float(v) for v in row) for row in self.ms)
        if len(ms) != len(self.rows) or any(len(row) != len(self.columns) for row in ms):
            raise ValueError(f"decode grid: ms must be {len(self.rows)} rows x {len(self.columns)} columns")
        if any(not math.isfinite(v) or v <= 0 for row in ms for v in row):
            raise ValueError("decode grid: every cell must be a finite number of ms > 0")
        object.__setattr__(self, "ms", ms)

    def at(self, rows: float, columns: float) -> float:
        """Milliseconds of a decode forward of ``rows`` rows against ``columns`` KV columns: bilinear between the
        grid's points, the nearest edge's value outside them."""
        i, j, wr = _bracket(self.rows, rows)
        k, m, wc = _bracket(self.columns, columns)
        g = self.ms
        return ((1 - wr) * ((1 - wc) * g[i][k] + wc * g[i][m])
                + wr * ((1 - wc) * g[j][k] + wc * g[j][m]))

    def to_dict(self) -> dict:
        """The grid as a record keeps it (JSON)."""
        return {"rows": list(self.rows), "columns": list(self.columns), "ms": [list(r) for r in self.ms],
                "threads": self.threads}

    @classmethod
    def from_dict(cls, d: Mapping) -> "DecodeGrid":
        """The grid of :meth:`to_dict` (other keys of the record, e.g. the load average, are ignored)."""
        return cls(tuple(d["rows"]), tuple(d["columns"]), tuple(tuple(r) for r in d["ms"]), int(d.get("threads", 1)))


def _bracket(axis: Sequence[int], x: float) -> tuple[int, int, float]:
    """``(i, j, w)``: ``x`` lies between ``axis[i]`` and ``axis[j]`` at weight ``w`` of the way (``i == j``,
    ``w = 0`` at or beyond an edge)."""
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"decode grid: a query must be finite, got {x}")
    if x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 1, len(axis) - 1, 0.0
    j = bisect_right(axis, x)
    i = j - 1
    return i, j, (x - axis[i]) / (axis[j] - axis[i])


def grid_axes(batch_rows: int, prompt_min: int, prompt_max: int, max_new_tokens: int) -> tuple[list, list]:
    """The rows and columns to measure for a run: rows ``1, 2, 4, ...`` below ``batch_rows`` and ``batch_rows``;
    columns from ``prompt_min`` (the first decode forward of the shortest padded prompt) to ``prompt_max +
    max_new_tokens - 2`` (the last forward of the longest), ``ceil(log2(last / first)) + 1`` points spaced
    geometrically (at least two unless first == last)."""
    if min(batch_rows, prompt_min, max_new_tokens) < 1 or prompt_max < prompt_min:
        raise ValueError(f"grid axes: need batch_rows, prompt_min, max_new_tokens >= 1 and prompt_max >= prompt_min, "
                         f"got {batch_rows}, {prompt_min}..{prompt_max}, {max_new_tokens}")
    rows = [1 << i for i in range(batch_rows.bit_length()) if (1 << i) < batch_rows] + [batch_rows]
    first, last = prompt_min, max(prompt_min, prompt_max + max_new_tokens - 2)
    n = max(2, math.ceil(math.log2(last / first)) + 1) if last > first else 1
    columns = sorted({round(first * (last / first) ** (i / max(n - 1, 1))) for i in range(n)})
    return rows, columns


def alive_rows(lengths: Sequence[int]) -> list[int]:
    """``n_t = #{i : L_i >= t + 2}`` for ``t = 0 .. max L - 2``: the rows the decode forward after token ``t`` must
    feed (a row whose token ``t`` ended it leaves).  Lengths are integers >= 1 (EOS included)."""
    if any(int(x) != x or x < 1 for x in lengths):
        raise ValueError(f"response lengths must be integers >= 1, got {sorted(set(lengths))[:5]}")
    counts = Counter(int(x) for x in lengths)
    top = max(counts, default=1)
    out, alive = [0] * (top - 1), 0
    for t in range(top - 2, -1, -1):        # from the last forward back: n_t = n_{t+1} + #{L == t + 2}
        alive += counts.get(t + 2, 0)
        out[t] = alive
    return out


def decode_floor_ms(grid: DecodeGrid, lengths: Sequence[int], prompt_columns: int) -> float:
    """The generation floor of one step (module docstring): ``sum_t grid(n_t, P + t)`` over
    :func:`alive_rows` of ``lengths``, ``P = prompt_columns``."""
    if prompt_columns < 1:
        raise ValueError(f"prompt_columns must be >= 1, got {prompt_columns}")
    return sum(grid.at(n, prompt_columns + t) for t, n in enumerate(alive_rows(lengths)))


def equal_length_floor_ms(grid: DecodeGrid, rows: int, mean_length: float, prompt_columns: int) -> float:
    """The floor with every one of ``rows`` responses at ``mean_length`` tokens (module docstring: linear between
    integer lengths; a lower bound of :func:`decode_floor_ms` for any lengths of that mean on a grid whose cost a
    row does not grow with the rows)."""
    if rows < 1 or prompt_columns < 1:
        raise ValueError(f"rows and prompt_columns must be >= 1, got {rows}, {prompt_columns}")
    if not math.isfinite(mean_length) or mean_length < 1:
        raise ValueError(f"a mean response length must be a finite number >= 1 (EOS included), got {mean_length}")
    m = int(math.floor(mean_length))
    whole = sum(grid.at(rows, prompt_columns + t) for t in range(m - 1))
    return whole + (mean_length - m) * grid.at(rows, prompt_columns + m - 1)


#: what a run records about its steps' shapes: the mean response length (every run of ours), the padded prompt
#: width and the lower percentiles of the response lengths (``<prefix><ppp>``, p = 0, 10, ..., 100; the package's
#: ``rollout.batch.generation_shape``)
MEAN_LENGTH = "reward/response_len"
PROMPT_WIDTH = "rollout/prompt_len"
LENGTH_PERCENTILE = "rollout/response_len_q"


def lengths_from_percentiles(percentiles: Mapping[int, float], rows: int) -> list[int]:
    """``rows`` response lengths that never exceed the true ones, from their lower percentiles ``{p: length}``: the
    row of rank ``i`` (0 = shortest) gets the percentile ``p`` with the largest ``floor(p / 100 * (rows - 1)) <= i``
    (that percentile *is* the row of that rank, and lengths grow with the rank), so the floor priced from them is a
    lower bound of the exact one, exact when every rank is a percentile's."""
    if rows < 1 or not percentiles or 0 not in percentiles:
        raise ValueError(f"length percentiles: need rows >= 1 and the 0th percentile, got rows={rows}, "
                         f"percentiles {sorted(percentiles)}")
    ranks = sorted((int(p * (rows - 1) // 100), float(v)) for p, v in percentiles.items())
    if any(b[1] < a[1] for a, b in zip(ranks, ranks[1:])) or any(v < 1 or v != int(v) for _, v in ranks):
        raise ValueError(f"length percentiles must be whole lengths >= 1 that grow with p, got {dict(percentiles)}")
    out, j = [], 0
    for i in range(rows):
        while j + 1 < len(ranks) and ranks[j + 1][0] <= i:
            j += 1
        out.append(int(ranks[j][1]))
    return out


def step_shapes(rows: Sequence[Mapping]) -> Optional[dict]:
    """What a run's ``metrics.jsonl`` rows say about the shape of each timed step's generation (steps 2..N, as the
    phases): ``{"steps", "mean_length", "prompt_len" (or None), "percentiles" (per step ``{p: length}``, or
    None)}``; None when no step records its mean response length (TRL)."""
    timed = [r for r in rows if r.get("perf/time_step_s") is not None and r.get("step") is not None
             and int(r["step"]) >= 2 and r.get(MEAN_LENGTH) is not None]
    if not timed:
        return None
    pcts = [{int(k[len(LENGTH_PERCENTILE):]): float(v) for k, v in r.items() if k.startswith(LENGTH_PERCENTILE)}
            for r in timed]
    widths = [r.get(PROMPT_WIDTH) for r in timed]
    return {"steps": [int(r["step"]) for r in timed], "mean_length": [float(r[MEAN_LENGTH]) for r in timed],
            "prompt_len": [int(w) for w in widths] if all(w is not None for w in widths) else None,
            "percentiles": pcts if all(pcts) else None}


def generation_floor_s(grid: DecodeGrid, shapes: Mapping, rows_per_step: int,
                       prompt_columns: int) -> tuple[float, str]:
    """``(seconds, source)``: the mean over the recorded steps of each step's generation floor, from its length
    percentiles (:func:`lengths_from_percentiles` over ``rows_per_step`` rows, then :func:`decode_floor_ms`; source
    ``lengths``) when every step has them, else from its mean length over ``rows_per_step`` rows
    (:func:`equal_length_floor_ms`, source ``mean length``); the step's padded prompt width where recorded, else
    ``prompt_columns`` (the task's shortest prompt: a lower bound of the width).  Both are lower bounds of G."""
    means = list(shapes.get("mean_length") or [])
    if not means:
        raise ValueError("generation floor: the record has no step's mean response length")
    widths = shapes.get("prompt_len") or [prompt_columns] * len(means)
    pcts = shapes.get("percentiles")
    if len(widths) != len(means) or (pcts is not None and len(pcts) != len(means)):
        raise ValueError(f"generation floor: {len(means)} steps' mean lengths but {len(widths)} prompt widths and "
                         f"{len(pcts) if pcts is not None else 0} length percentiles")
    if pcts is not None:
        per_step = [decode_floor_ms(grid, lengths_from_percentiles(q, rows_per_step), int(p))
                    for q, p in zip(pcts, widths)]
        source = "lengths"
    else:
        per_step = [equal_length_floor_ms(grid, rows_per_step, m, int(p)) for m, p in zip(means, widths)]
        source = "mean length"
    return sum(per_step) / len(per_step) / 1e3, source


def arm_kind(system: str, mode: str, staleness: int) -> Optional[str]:
    """The bound rule of an arm (:data:`RULES`): ``sync`` (ours, ``fixed`` at staleness 0), ``fixed`` (staleness
    >= 1), ``async``, ``stream``; None for TRL (it records none of the parts)."""
    if system != "ours":
        return None
    if mode == "fixed":
        return "sync" if staleness == 0 else "fixed"
    if mode in ("async", "stream"):
        return mode
    raise ValueError(f"arm kind: unknown buffer mode {mode!r} (expected fixed, async or stream)")


@dataclass(frozen=True)
class ArmBound:
    """One arm's (or run's) bound a step, seconds: its parts, the bound they allow (module docstring) and the
    achieved step.  :class:`ValueError` with one line for an unknown kind or a time that is negative or not
    finite (the achieved step must be > 0)."""

    kind: str               # sync | fixed | async | stream (RULES)
    generation_s: float     # G: the generation floor
    old_logp_s: float       # O: the old-log-prob pass as measured (not counted by sync)
    update_s: float         # U: the update as measured
    achieved_s: float       # the run's step (steps 2..N, evaluation excluded)

    def __post_init__(self) -> None:
        if self.kind not in RULES:
            raise ValueError(f"arm bound: unknown kind {self.kind!r} (expected one of {', '.join(RULES)})")
        for name in ("generation_s", "old_logp_s", "update_s", "achieved_s"):
            object.__setattr__(self, name, _positive(f"arm bound: {name}", getattr(self, name)))
        if self.achieved_s == 0:
            raise ValueError("arm bound: achieved_s must be > 0, got 0.0")

    @property
    def busy_s(self) -> float:
        """The trainer's busy time a step, ``O + U`` (``U`` alone for sync)."""
        return self.update_s if self.kind == "sync" else self.old_logp_s + self.update_s

    @property
    def bound_s(self) -> float:
        """``G + U`` (sync), ``G + O + U`` (fixed), ``max(O + U, G)`` (async, stream)."""
        if self.kind in ("async", "stream"):
            return max(self.busy_s, self.generation_s)
        return self.generation_s + self.busy_s

    @property
    def fraction(self) -> float:
        """``achieved / bound`` (>= 1 when the parts were measured on the run's machine; inf for a bound of 0)."""
        return self.achieved_s / self.bound_s if self.bound_s > 0 else math.inf


def share(part_s: Optional[float], step_s: float) -> Optional[float]:
    """``part / step``: a share of the step's wall time; None where the run does not record the part."""
    if part_s is None:
        return None
    part = _positive("share: the part", part_s)
    if not (math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"share: the step must be a finite number > 0, got {step_s}")
    return part / step_s
