"""The collapse-step aggregation against hand-worked series, and its table cells."""
import json
import math

import pytest

from offpolicy_moe.report.table import aggregate_series, build_table, collapse_step, format_cell


def _loop_reference(points, frac, window=5):
    """Literal definition: first step t (with >= window values) whose trailing mean < frac * the best earlier
    trailing mean (computed over all u < t with >= window values), best > 0."""
    ys = [y for _, y in points]
    for t in range(window - 1, len(points)):
        s_t = sum(ys[t - window + 1:t + 1]) / window
        earlier = [sum(ys[u - window + 1:u + 1]) / window for u in range(window - 1, t)]
        if earlier and max(earlier) > 0 and s_t < frac * max(earlier):
            return points[t][0]
    return None


def test_collapse_step_hand_cases():
    rising = [(i, 0.1 * i) for i in range(10)]
    assert collapse_step(rising) is None
    # trailing means 0.5 ... then zeros: the mean drops below 0.25 when >= 3 of the last 5 values are 0
    crash = [(10 * i, 0.5) for i in range(8)] + [(80 + 10 * i, 0.0) for i in range(6)]
    assert collapse_step(crash, 0.5) == 100   # window (0.5, 0.5, 0, 0, 0) -> 0.2 < 0.25
    assert collapse_step(crash, 0.3) == 110   # needs 0.1 < 0.15
    assert collapse_step([(0, 0.0)] * 10) is None      # never above zero: nothing to collapse from
    with pytest.raises(ValueError):
        collapse_step(crash, 1.5)


def test_collapse_step_matches_the_literal_definition():
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 30)
        pts = [(float(i), rng.choice([0.0, rng.random()])) for i in range(n)]
        frac = rng.choice([0.3, 0.5, 0.8])
        assert collapse_step(pts, frac) == _loop_reference(pts, frac)


def test_aggregate_collapse_returns_step_or_inf_and_checks_argument():
    vals = [0.5] * 8 + [0.0] * 6
    steps = [10.0 * i for i in range(len(vals))]
    assert aggregate_series(vals, "collapse", steps=steps) == 100
    assert aggregate_series(vals, "collapse:0.3", steps=steps) == 110
    assert math.isinf(aggregate_series([0.5] * 10, "collapse"))
    assert aggregate_series([], "collapse") is None
    for bad in ("collapse:x", "collapse:2"):
        with pytest.raises(ValueError):
            aggregate_series(vals, bad)


def test_table_counts_stable_runs_apart(tmp_path):
    sw = tmp_path / "sweep"
    series = {0: [0.5] * 8 + [0.0] * 6, 1: [0.5] * 9 + [0.0] * 5, 2: [0.5] * 14}
    for seed, rew in series.items():
        d = sw / f"algorithm=grpo__seed={seed}"
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"axes": {"algorithm": "grpo"}, "seed": seed}))
        (d / "summary.json").write_text(json.dumps({"status": "completed"}))
        (d / "config.yaml").write_text(f"seed: {seed}\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * i, "reward/mean": r}) + "\n"
                                                 for i, r in enumerate(rew)))
    t = build_table(sw, "algorithm", None, "reward/mean", agg="collapse")
    (cell,) = t.cells.values()
    assert sorted(cell.values) == [100.0, 110.0] and cell.stable == 1
    assert format_cell(cell) == "105 ± 7.07 (2; 1 stable)"
    assert not t.best  # no best cell for a collapse step
