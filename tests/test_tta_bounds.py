"""experiments/bench/tta/bounds.py and bench_tta.py's bound table: every arm's bound (issue 54, item 6) on hand-made
grids and records: the grid's interpolation, the generation floor from the rows alive at each decode forward, each
arm kind's bound and ``achieved / bound``, the table's rows, the grid measured once and kept in the record, and
one-line errors on bad input.  No test assumes a speed: the measured grid is replaced by a known function."""
from __future__ import annotations

import json
import random
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "experiments" / "bench"
sys.path.insert(0, str(BENCH))

import bench_tta  # noqa: E402
from tta.analysis import curve, parse_arms  # noqa: E402
from tta.bounds import (ArmBound, DecodeGrid, alive_rows, arm_kind, decode_floor_ms,  # noqa: E402
                        equal_length_floor_ms, generation_floor_s, grid_axes, lengths_from_percentiles, share,
                        step_shapes)


def affine_grid(rows=(1, 2, 4, 8), columns=(5, 10, 40), a=0.5, b=0.25, c=0.01) -> DecodeGrid:
    """``ms = a + b * rows + c * columns`` at every point: bilinear interpolation reproduces it exactly between
    points, and a row costs less in a larger batch (``ms / rows`` falls with rows)."""
    return DecodeGrid(rows, columns, tuple(tuple(a + b * r + c * k for k in columns) for r in rows))


# ------------------------------------------------------------------ the grid and its interpolation
def test_the_grid_is_exact_at_its_points_bilinear_between_and_flat_outside():
    g = DecodeGrid((1, 3), (10, 20), ((1.0, 2.0), (3.0, 5.0)))
    for i, r in enumerate(g.rows):
        for j, c in enumerate(g.columns):
            assert g.at(r, c) == g.ms[i][j]
    assert g.at(2, 15) == pytest.approx((1 + 2 + 3 + 5) / 4)          # the centre: the mean of the four corners
    assert g.at(1, 15) == pytest.approx(1.5) and g.at(2, 10) == pytest.approx(2.0)
    assert g.at(2.5, 12) == pytest.approx(0.25 * (0.8 * 1 + 0.2 * 2) + 0.75 * (0.8 * 3 + 0.2 * 5))
    assert (g.at(0.5, 4), g.at(10, 100), g.at(2, 100)) == (1.0, 5.0, pytest.approx(3.5))   # the nearest edge
    assert DecodeGrid.from_dict(json.loads(json.dumps(g.to_dict()))) == g


def test_the_interpolation_is_monotone_between_points_of_a_monotone_grid():
    rng = random.Random(0)
    rows, columns = (1, 2, 4, 16, 128), (7, 20, 61, 254)
    ms = [[0.0] * len(columns) for _ in rows]
    for i in range(len(rows)):              # increasing along both axes, by uneven steps
        for j in range(len(columns)):
            ms[i][j] = max(ms[i - 1][j] if i else 0.1, ms[i][j - 1] if j else 0.1) + rng.uniform(0.0, 0.5)
    g = DecodeGrid(rows, columns, ms)
    xs = [1 + 127 * k / 200 for k in range(201)]
    ys = [7 + 247 * k / 200 for k in range(201)]
    for c in (7, 13.5, 61, 100, 254):
        along = [g.at(r, c) for r in xs]
        assert all(b >= a - 1e-12 for a, b in zip(along, along[1:]))
    for r in (1, 3, 16, 77.7, 128):
        along = [g.at(r, c) for c in ys]
        assert all(b >= a - 1e-12 for a, b in zip(along, along[1:]))
    assert min(min(r) for r in g.ms) <= g.at(50, 50) <= max(max(r) for r in g.ms)


@pytest.mark.parametrize("rows, columns, ms, says", [
    ((), (1,), (), "no rows"),
    ((1,), (), ((),), "no columns"),
    ((2, 1), (1,), ((1.0,), (1.0,)), "rows must be strictly increasing integers >= 1"),
    ((0, 1), (1,), ((1.0,), (1.0,)), "rows must be strictly increasing integers >= 1"),
    ((1,), (4, 4), ((1.0, 1.0),), "columns must be strictly increasing"),
    ((1, 2), (4,), ((1.0,),), "ms must be 2 rows x 1 columns"),
    ((1,), (4,), ((0.0,),), "every cell must be a finite number of ms > 0"),
    ((1,), (4,), ((float("nan"),),), "every cell must be a finite number of ms > 0"),
])
def test_a_bad_grid_is_one_line_naming_the_problem(rows, columns, ms, says):
    with pytest.raises(ValueError, match=says) as e:
        DecodeGrid(rows, columns, ms)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="a query must be finite"):
        DecodeGrid((1,), (1,), ((1.0,),)).at(float("nan"), 1)


def test_the_grid_axes_cover_the_run_s_rows_and_columns():
    assert grid_axes(128, 7, 7, 3) == ([1, 2, 4, 8, 16, 32, 64, 128], [7, 8])          # the default job
    rows, columns = grid_axes(128, 9, 31, 225)                                           # the longtail job
    assert rows[-1] == 128 and columns[0] == 9 and columns[-1] == 31 + 225 - 2 and len(columns) == 6
    assert columns == sorted(set(columns))
    assert grid_axes(24, 5, 5, 1) == ([1, 2, 4, 8, 16, 24], [5])
    assert grid_axes(1, 5, 5, 2) == ([1], [5])
    with pytest.raises(ValueError, match="grid axes: need batch_rows"):
        grid_axes(0, 5, 5, 3)


# ------------------------------------------------------------------ the generation floor
def test_rows_alive_at_each_decode_forward():
    # the forward after token t feeds the rows with a token t + 1 still to draw: lengths >= t + 2
    assert alive_rows([1, 2, 2, 4]) == [3, 1, 1]
    assert alive_rows([3, 3]) == [2, 2] and alive_rows([1, 1]) == [] and alive_rows([]) == []
    for bad in ([0, 2], [1.5]):
        with pytest.raises(ValueError, match="response lengths must be integers >= 1"):
            alive_rows(bad)


def test_the_floor_sums_the_grid_at_the_rows_alive_and_the_columns_of_each_forward():
    g = affine_grid()
    # P = 5: forward 0 feeds 3 rows over 5 columns, forward 1 one row over 6, forward 2 one row over 7
    want = sum(0.5 + 0.25 * n + 0.01 * c for n, c in ((3, 5), (1, 6), (1, 7)))
    assert decode_floor_ms(g, [1, 2, 2, 4], 5) == pytest.approx(want)
    assert decode_floor_ms(g, [1] * 8, 5) == 0.0                    # one token each: the prefill's only
    with pytest.raises(ValueError, match="prompt_columns must be >= 1"):
        decode_floor_ms(g, [2], 0)


def test_the_equal_length_floor_is_exact_at_whole_lengths_linear_between_and_a_lower_bound():
    g = affine_grid()
    assert equal_length_floor_ms(g, 4, 3.0, 5) == pytest.approx(decode_floor_ms(g, [3, 3, 3, 3], 5))
    assert equal_length_floor_ms(g, 4, 1.0, 5) == 0.0
    at2, at3 = equal_length_floor_ms(g, 4, 2.0, 5), equal_length_floor_ms(g, 4, 3.0, 5)
    assert equal_length_floor_ms(g, 4, 2.25, 5) == pytest.approx(at2 + 0.25 * (at3 - at2))
    rng = random.Random(1)
    for _ in range(200):                 # any lengths of the same mean cost at least as much on this grid
        lengths = [rng.choice([1, 1, 2, 3, 7, 20]) for _ in range(8)]
        mean = sum(lengths) / len(lengths)
        assert equal_length_floor_ms(g, 8, mean, 5) <= decode_floor_ms(g, lengths, 5) + 1e-9
    for bad in (0.5, float("nan")):
        with pytest.raises(ValueError, match="mean response length must be a finite number >= 1"):
            equal_length_floor_ms(g, 4, bad, 5)


def test_step_shapes_keep_what_the_run_records_of_steps_2_to_n():
    rows = [{"step": 1, "perf/time_step_s": 1.0, "reward/response_len": 9.0},
            {"step": 2, "perf/time_step_s": 1.0, "reward/response_len": 2.5},
            {"step": 2, "eval/accuracy": 0.5},
            {"step": 3, "perf/time_step_s": 1.0, "reward/response_len": 3.0}]
    assert step_shapes(rows) == {"steps": [2, 3], "mean_length": [2.5, 3.0], "prompt_len": None, "percentiles": None}
    full = [dict(r, **{"rollout/prompt_len": 7.0, "rollout/response_len_q000": 1.0,
                       "rollout/response_len_q050": 3.0, "rollout/response_len_q100": 3.0}) for r in rows]
    s = step_shapes(full)
    assert s["prompt_len"] == [7, 7] and s["percentiles"] == [{0: 1.0, 50: 3.0, 100: 3.0}] * 2
    assert step_shapes([{"step": 2, "perf/time_step_s": 1.0, "eval/accuracy": 0.1}]) is None     # TRL


def test_lengths_from_percentiles_are_the_ranks_lower_bounds():
    lengths = [1, 1, 2, 3, 3, 5, 8, 8, 9, 12, 12]            # 11 rows: every 10th percentile is one row's rank
    pcts = {p: float(lengths[p * 10 // 100]) for p in range(0, 101, 10)}
    assert lengths_from_percentiles(pcts, 11) == lengths
    coarse = lengths_from_percentiles({0: 1.0, 50: 3.0, 100: 12.0}, 11)
    assert coarse == [1] * 5 + [3] * 5 + [12] and all(a <= b for a, b in zip(coarse, lengths))
    for bad, rows in (({50: 3.0}, 11), ({0: 1.0}, 0), ({0: 3.0, 50: 2.0}, 5), ({0: 0.0}, 2), ({0: 1.5}, 2)):
        with pytest.raises(ValueError, match="length percentiles"):
            lengths_from_percentiles(bad, rows)


def test_a_run_s_floor_is_the_mean_of_its_steps_from_lengths_or_from_mean_lengths():
    g = affine_grid()
    shapes = {"mean_length": [2.0, 3.0], "prompt_len": None, "percentiles": None}
    secs, source = generation_floor_s(g, shapes, 4, 5)
    want = (equal_length_floor_ms(g, 4, 2.0, 5) + equal_length_floor_ms(g, 4, 3.0, 5)) / 2 / 1e3
    assert source == "mean length" and secs == pytest.approx(want)
    shapes = {"mean_length": [1.75, 2.0], "prompt_len": [6, 8],
              "percentiles": [{0: 1.0, 40: 2.0, 100: 2.0}, {0: 2.0, 100: 2.0}]}
    secs, source = generation_floor_s(g, shapes, 4, 5)
    want = (decode_floor_ms(g, [1, 2, 2, 2], 6) + decode_floor_ms(g, [2, 2, 2, 2], 8)) / 2 / 1e3
    assert source == "lengths" and secs == pytest.approx(want)
    with pytest.raises(ValueError, match="2 steps' mean lengths but 1 prompt widths"):
        generation_floor_s(g, dict(shapes, prompt_len=[6]), 4, 5)
    with pytest.raises(ValueError, match="2 steps' mean lengths but 2 prompt widths and 1 length percentiles"):
        generation_floor_s(g, dict(shapes, percentiles=shapes["percentiles"][:1]), 4, 5)
    with pytest.raises(ValueError, match="no step's mean response length"):
        generation_floor_s(g, {"mean_length": []}, 4, 5)


# ------------------------------------------------------------------ each arm kind's bound
def test_each_arm_kind_s_bound_and_the_achieved_fraction():
    # G = 0.4, O = 0.1, U = 0.2, achieved 0.84
    def b(kind, g=0.4):
        return ArmBound(kind, g, 0.1, 0.2, 0.84)

    assert b("sync").bound_s == pytest.approx(0.6) and b("sync").busy_s == pytest.approx(0.2)   # G + U
    assert b("fixed").bound_s == pytest.approx(0.7)                                              # G + O + U
    assert b("async").bound_s == pytest.approx(0.4) and b("stream").bound_s == pytest.approx(0.4)   # max: G
    assert b("async", g=0.2).bound_s == pytest.approx(0.3)                                       # max: O + U
    assert b("sync").fraction == pytest.approx(1.4) and b("fixed").fraction == pytest.approx(1.2)
    assert b("async").fraction == pytest.approx(2.1) and b("async", g=0.2).fraction == pytest.approx(2.8)
    assert ArmBound("sync", 0.0, 0.0, 0.0, 1.0).fraction == float("inf")


@pytest.mark.parametrize("args, says", [
    (("warp", 0.1, 0.1, 0.1, 1.0), "unknown kind 'warp'"),
    (("sync", -0.1, 0.1, 0.1, 1.0), "generation_s must be a finite number >= 0, got -0.1"),
    (("fixed", 0.1, -1.0, 0.1, 1.0), "old_logp_s must be a finite number >= 0"),
    (("async", 0.1, 0.1, float("inf"), 1.0), "update_s must be a finite number >= 0"),
    (("stream", 0.1, 0.1, 0.1, 0.0), "achieved_s must be > 0"),
])
def test_a_bad_bound_is_one_line_naming_the_problem(args, says):
    with pytest.raises(ValueError, match=says) as e:
        ArmBound(*args)
    assert "\n" not in str(e.value)


def test_arm_kinds_and_shares():
    kinds = [arm_kind(a.system, a.mode, a.staleness) for a in parse_arms("trl,sync,fixed-k1-grpo,async-k2-m2po,stream")]
    assert kinds == [None, "sync", "fixed", "async", "stream"]
    with pytest.raises(ValueError, match="unknown buffer mode 'ring'"):
        arm_kind("ours", "ring", 0)
    assert share(None, 1.0) is None and share(0.25, 0.5) == 0.5
    with pytest.raises(ValueError, match="share: the part must be a finite number >= 0"):
        share(-0.1, 1.0)
    with pytest.raises(ValueError, match="share: the step must be a finite number > 0"):
        share(0.1, 0.0)


# ------------------------------------------------------------------ the table in bench_tta.py
GRID = {"grids": {"1": affine_grid().to_dict(), "2": affine_grid(a=1.0).to_dict()}, "rows_per_step": 4,
        "prompt_columns": [5, 5]}


def _run(arm, threads, achieved, phases, mean_length=3.0, with_eval=None):
    """A run of 11 steps (phases: sums over steps 2..11, i.e. 10 steps) whose every step has ``mean_length``;
    ``with_eval``: its step with evaluation (the loop's end over 10 steps)."""
    return {"arm": arm, "seed": 0, "threads": threads, "s_per_step": achieved,
            "curve": {"phases": {k: v * 10 for k, v in phases.items()},
                      **({"end_s": with_eval * 10} if with_eval else {})},
            "shapes": {"steps": list(range(2, 12)), "mean_length": [mean_length] * 10, "prompt_len": None,
                       "percentiles": None}}


def test_the_bound_table_gives_each_arm_its_parts_bound_fraction_and_shares():
    g1 = equal_length_floor_ms(affine_grid(), 4, 3.0, 5) / 1e3              # G at 1 thread (a worker)
    g2 = equal_length_floor_ms(affine_grid(a=1.0), 4, 3.0, 5) / 1e3         # G at 2 threads (one process)
    runs = [_run("sync", 2, 2 * (g2 + 0.02), {"perf/time_generate_s": 1.5 * g2, "perf/time_update_s": 0.02}),
            _run("fixed-k1-grpo", 2, 1.1 * (g2 + 0.03), {"perf/time_generate_s": g2, "perf/time_old_logp_s": 0.01,
                                                          "perf/time_update_s": 0.02}),
            _run("async-k1-grpo", 1, 0.05, {"async/worker_generate_s": 0.004, "perf/time_old_logp_s": 0.01,
                                            "perf/time_update_s": 0.03, "async/trainer_wait_s": 0.005,
                                            "async/worker_wait_s": 0.02}, with_eval=0.1),
            _run("async-k1-grpo", 1, 0.05, {"async/worker_generate_s": 0.004, "perf/time_old_logp_s": 0.01,
                                            "perf/time_update_s": 0.03, "async/trainer_wait_s": 0.015,
                                            "async/worker_wait_s": 0.02, "async/worker_send_s": 0.01},
                 with_eval=0.1),
            {"arm": "trl", "seed": 0, "threads": 2, "s_per_step": 0.1, "curve": {"phases": {}}, "shapes": None}]
    assert g1 < 0.04                             # the asynchronous arm is bound by its trainer: O + U = 0.04
    text = bench_tta.bound_table(runs, parse_arms("trl,sync,fixed-k1-grpo,async-k1-grpo"), GRID, 11)
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in text.splitlines() if line.startswith("| ")}
    assert rows["trl"] == ["—"] * 11 + ["— |"]
    assert rows["sync"][:8] == ["G + U", f"{g2:.4f}", f"{1.5 * g2:.4f}", "0.0000", "0.0200", f"{g2 + 0.02:.4f}",
                                f"{2 * (g2 + 0.02):.4f}", "2.00x"]
    assert rows["sync"][8:] == ["—", "—", "—", "mean length |"]
    assert rows["fixed-k1-grpo"][0] == "G + O + U" and rows["fixed-k1-grpo"][5] == f"{g2 + 0.03:.4f}"
    assert rows["fixed-k1-grpo"][7] == "1.10x"
    # the worker's generation floor on the 1-thread grid; the bound is the trainer's 0.04; the trainer idle 10% and
    # 30% of its 0.05 s step; the worker blocked 0.02 s and (one run records it) 0.01 s of the 0.1 s with evaluation
    assert rows["async-k1-grpo"] == ["max(O + U, G)", f"{g1:.4f}", "0.0040", "0.0100", "0.0300", "0.0400",
                                     "0.0500", "1.25x", "20%", "20%", "10%", "mean length |"]
    assert text.splitlines()[-1] == "above 1.2x of the bound: sync, async-k1-grpo"
    assert ("decode grid (measured before the runs): 1 thread(s): 4 rows 1..8 x 3 KV columns 5..40; 2 thread(s): "
            "4 rows 1..8 x 3 KV columns 5..40") in text
    timed = {**GRID, "grids": {"1": {**GRID["grids"]["1"], "seconds": 2.5, "load_before": [1.5, 1, 1],
                                     "load_after": [2.25, 1, 1]}}}
    assert "1 thread(s): 4 rows 1..8 x 3 KV columns 5..40, 2.5 s, load 1.50 -> 2.25" in bench_tta.grid_note(timed)
    assert bench_tta.bound_table(runs, parse_arms("sync"), {}, 11) == ""      # a record without a grid


def test_a_saved_record_prints_its_bounds_again_without_measuring(tmp_path, monkeypatch, capsys):
    rows = [{"step": 0, "eval/accuracy": 0.3},
            *({"step": s, "perf/elapsed_s": float(s), "perf/time_step_s": 1.0, "perf/time_generate_s": 0.25,
               "perf/time_update_s": 0.5, "reward/response_len": 2.0, **({"eval/accuracy": 0.5} if s == 4 else {})}
              for s in range(1, 5))]
    run = {"arm": "sync", "seed": 0, "threads": 1, "curve": curve(rows).__dict__, "startup_s": 1.0,
           "s_per_step": 1.0, "load_after": [1.0, 1.0, 1.0], "shapes": step_shapes(rows)}
    rec = {"date": "d", "command": "c", "arms": ["sync"], "wall_s": 1.0, "load_start": [1, 1, 1],
           "load_end": [1, 1, 1], "warm_start_s": {"0": 1.0}, "args": {"steps": 4}, "decode_grids": GRID,
           "runs": [run]}
    src = tmp_path / "runs.json"
    src.write_text(json.dumps(rec))
    monkeypatch.setattr(bench_tta, "measure_grids", lambda *a: pytest.fail("re-measured"))
    bench_tta.main(["--reanalyse", str(src), "--target", "0.4", "--out", str(tmp_path / "o")])
    g = equal_length_floor_ms(affine_grid(), 4, 2.0, 5) / 1e3
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| sync | G + U |"))
    assert f"| {g + 0.5:.4f} | 1.0000 | {1 / (g + 0.5):.2f}x |" in line
    assert json.loads((tmp_path / "o" / "runs.json").read_text())["decode_grids"] == GRID


def test_the_grid_is_measured_once_at_the_run_s_rows_and_columns_on_each_generating_thread_count(monkeypatch):
    cells = []

    def fake_decode_ms(model, rows, columns, repeats, warmup, *, lean=False):
        assert lean          # the bound is the fastest forward the project runs
        cells.append((torch.get_num_threads(), rows, columns, repeats, warmup))
        return 1.0 + rows / 100 + columns / 1000

    monkeypatch.setattr(bench_tta.bench_bounds, "decode_ms", fake_decode_ms)
    args = bench_tta.parse_args(["--arms", "trl,sync,async-k1-grpo", "--headline", "sync", "--threads", "2",
                                 "--grid-repeats", "3"])
    threads = torch.get_num_threads()
    rec = bench_tta.measure_grids(args, args.arm_list)
    assert torch.get_num_threads() == threads
    assert set(rec["grids"]) == {"1", "2"} and rec["rows_per_step"] == 128 and rec["prompt_columns"] == [7, 7]
    g = DecodeGrid.from_dict(rec["grids"]["1"])
    assert g.rows == (1, 2, 4, 8, 16, 32, 64, 128) and g.columns == (7, 8)      # "a+b+c=" and bos; 3 new tokens
    assert g.ms[3][1] == 1.0 + 8 / 100 + 8 / 1000 and g.threads == 1
    assert {c[0] for c in cells} == {1, 2} and len(cells) == 2 * 8 * 2
    assert {c[3:] for c in cells} == {(3, bench_tta.GRID_WARMUP)}
    assert bench_tta.measure_grids(Namespace(**{**vars(args), "grid_repeats": 0}), args.arm_list) == {}
    assert bench_tta.measure_grids(args, parse_arms("trl")) == {}
    with pytest.raises(SystemExit):
        bench_tta.parse_args(["--arms", "sync", "--headline", "sync", "--grid-repeats", "-1"])
