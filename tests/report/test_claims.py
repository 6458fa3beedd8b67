"""Paired tables (``baseline``) and claims tables (``report.claims``) on synthetic run folders and through the CLI,
numbers checked against hand computation; bad specs are one-line errors."""
import csv
import io
import json
import re
import sys
from pathlib import Path

import pytest

from offpolicy_moe.cli import main
from offpolicy_moe.report.claims import check_claim_axes, evaluate_claims, parse_claims, render_claims
from offpolicy_moe.report.spec import report_spec
from offpolicy_moe.report.stats import MARKER, NO_RUNS, NOT_RESOLVED, OPPOSITE, REPRODUCED
from offpolicy_moe.report.table import build_table, render_table
from offpolicy_moe.sweep.execute import run_sweep

FAKE = [sys.executable, str(Path(__file__).with_name("fake_train.py"))]

# (algorithm, ministep, seed) -> (final accuracy, final k3 KL)
RUNS = {
    ("grpo", "single", 0): (0.50, 1.0e-3), ("grpo", "single", 1): (0.60, 2.0e-3), ("grpo", "single", 2): (0.55, 1.5e-3),
    ("r3", "single", 0): (0.52, 1.0e-5), ("r3", "single", 1): (0.61, 3.0e-5), ("r3", "single", 2): (0.60, 2.0e-5),
    ("tis", "single", 0): (0.40, 1.0e-3), ("tis", "single", 1): (0.50, 2.0e-3),     # seed 2 missing
    ("grpo", "multi", 0): (0.30, 1.0e-3), ("grpo", "multi", 1): (0.35, 1.0e-3), ("grpo", "multi", 2): (0.40, 1.0e-3),
    ("r3", "multi", 0): (0.31, 1.0e-3), ("r3", "multi", 1): (0.37, 1.0e-3), ("r3", "multi", 2): (0.42, 1.0e-3),
    ("tis", "multi", 0): (0.30, 1.0e-3), ("tis", "multi", 1): (0.30, 1.0e-3), ("tis", "multi", 2): (0.30, 1.0e-3),
}

CLAIMS = """
report:
  tables:
    - {title: Accuracy, rows: algorithm, cols: ministep, metric: eval/accuracy, baseline: grpo}
  claims:
    - claim: "R3 lowers the train/inference k3 KL"
      paper: "R3: ~1e-3 -> ~1e-5"
      metric: mismatch/k3_kl
      treatment: {algorithm: r3}
      baseline: {algorithm: grpo}
      where: {ministep: single}
      expect: lower
      scale: log
    - claim: "R3 raises accuracy"
      paper: "+2 points | table 3"
      metric: eval/accuracy
      treatment: {algorithm: r3}
      baseline: {algorithm: grpo}
      where: {ministep: single}
      expect: higher
      explain: "3 seeds are too few at this scale"
    - claim: "PR2 raises accuracy"
      paper: "+1 point"
      metric: eval/accuracy
      treatment: {algorithm: pr2}
      baseline: {algorithm: grpo}
      where: {ministep: single}
      expect: higher
      explain: "PR2 was not run in this sweep"
"""


def _run(sw: Path, alg: str, ms: str, seed: int, acc: float, kl: float, status: str = "completed") -> None:
    d = sw / f"algorithm={alg}__ministep={ms}__seed={seed}"
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"axes": {"algorithm": alg, "ministep": ms}, "seed": seed}))
    (d / "summary.json").write_text(json.dumps({"status": status, "error": "boom" if status == "failed" else None}))
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval/accuracy": 0.0, "mismatch/k3_kl": 1.0}) + "\n"
                                     + json.dumps({"step": 2, "eval/accuracy": acc, "mismatch/k3_kl": kl}) + "\n")


def _sweep(tmp_path, experiment: str = CLAIMS) -> Path:
    sw = tmp_path / "sweep"
    for (alg, ms, seed), (acc, kl) in RUNS.items():
        _run(sw, alg, ms, seed, acc, kl)
    _run(sw, "tis", "single", 2, 0.9, 1.0, status="failed")
    (sw / "sweep.json").write_text(json.dumps({"axes": {"algorithm": ["grpo", "r3", "tis"],
                                                        "ministep": ["single", "multi"]}}))
    (sw / "experiment.yaml").write_text(experiment)
    return sw


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("offpolicy-moe table: error: "), err[0]
    assert "Traceback" not in err[0]
    return err[0]


# ------------------------------------------------------------------------------------------------ paired tables
def test_paired_table_hand_computed(tmp_path):
    sw = _sweep(tmp_path)
    t = build_table(sw, "algorithm", "ministep", "eval/accuracy", "final", baseline="grpo")
    # r3 - grpo, single: 0.02, 0.01, 0.05 -> mean 0.026667, sd 0.020817, half 4.302653 * 0.020817 / sqrt(3) = 0.051711
    c = t.paired[("r3", "ministep=single")]
    assert c.n == 3 and c.estimate == pytest.approx(0.026667, abs=1e-6)
    assert c.lo == pytest.approx(-0.025045, abs=1e-6) and c.hi == pytest.approx(0.078378, abs=1e-6)
    # r3 - grpo, multi: 0.01, 0.02, 0.02 -> mean 0.016667, sd 0.005774, half 0.014342: excludes 0
    m = t.paired[("r3", "ministep=multi")]
    assert m.lo == pytest.approx(0.002324, abs=1e-6) and m.excludes_zero
    # tis - grpo, single: seed 2 failed, so 2 pairs: -0.1, -0.1 -> a zero-width interval at -0.1
    s = t.paired[("tis", "ministep=single")]
    assert s.n == 2 and s.pairing.only_baseline == ["2"]
    assert s.lo == pytest.approx(-0.1) and s.hi == pytest.approx(-0.1) and s.excludes_zero
    assert not any(r == "grpo" for r, _ in t.paired)            # the baseline row is not compared with itself
    md = render_table(t, "md")
    assert "| grpo | 0.55 ± 0.05 (3) | 0.35 ± 0.05 (3) |" in md
    assert (f"| r3 | **0.577 ± 0.0493 (3); Δ +0.0267 [-0.025, +0.0784] (n=3)** | "
            f"**0.367 ± 0.0551 (3); Δ +0.0167 [+0.00232, +0.031]{MARKER} (n=3)** |") in md
    assert f"| tis | 0.45 ± 0.0707 (2; 1 failed); Δ -0.1 [-0.1, -0.1]{MARKER} (n=2) |" in md
    assert "95% Student-t interval" in md and "paired difference" in md and "baseline row 'grpo'" in md


def test_paired_table_in_csv_latex_console(tmp_path):
    sw = _sweep(tmp_path)
    t = build_table(sw, "algorithm", None, "eval/accuracy", "final", where={"ministep": "multi"}, baseline="tis")
    rows = list(csv.reader(io.StringIO(render_table(t, "csv"))))
    # grpo - tis, multi: 0, 0.05, 0.1 -> mean 0.05, sd 0.05, half 0.124208
    assert rows[1] == ["grpo", "0.35 ± 0.05 (3); Δ +0.05 [-0.0742, +0.174] (n=3)"]
    assert rows[3] == ["tis", "0.3 ± 0 (3)"]
    tex = render_table(t, "latex")
    assert "grpo & 0.35 $\\pm$ 0.05 (3); $\\Delta$ +0.05 [-0.0742, +0.174] (n=3) \\\\" in tex
    assert "% Δ: paired difference" in tex
    con = render_table(t, "console")
    # r3 - tis, multi: 0.01, 0.07, 0.12 -> mean 0.066667, sd 0.055076, half 0.136816; the column's best: starred
    assert "0.367 ± 0.0551 (3); Δ +0.0667 [-0.0701, +0.203] (n=3) *" in con


def test_unknown_baseline_and_collapse_are_refused(tmp_path, capsys):
    sw = _sweep(tmp_path)
    with pytest.raises(ValueError, match=r"unknown baseline 'ppo'.*rows: grpo, r3, tis"):
        build_table(sw, "algorithm", "ministep", "eval/accuracy", baseline="ppo")
    with pytest.raises(ValueError, match="never collapse"):
        build_table(sw, "algorithm", "ministep", "eval/accuracy", agg="collapse", baseline="grpo")
    assert main(["table", str(sw), "--rows", "algorithm", "--cols", "ministep", "--metric", "eval/accuracy",
                 "--baseline", "ppo"]) == 2
    assert "rows: grpo, r3, tis" in _one_error_line(capsys)


def test_cli_baseline_flag(tmp_path, capsys):
    sw = _sweep(tmp_path)
    assert main(["table", str(sw), "--rows", "algorithm", "--cols", "ministep", "--metric", "eval/accuracy",
                 "--baseline", "grpo", "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert f"Δ +0.0167 [+0.00232, +0.031]{MARKER} (n=3)" in out and "### Claims" not in out


# ------------------------------------------------------------------------------------------------ claims tables
def test_claims_evaluated_by_hand(tmp_path):
    sw = _sweep(tmp_path)
    results = evaluate_claims(sw, report_spec(sw).claims, "final")
    kl, acc, pr2 = results
    # per-seed ratios r3/grpo: 0.01, 0.015, 1/75 -> 10**(mean of log10) = their geometric mean (2e-6)**(1/3)
    assert kl.comparison.estimate == pytest.approx((2e-6) ** (1 / 3), rel=1e-9)
    assert kl.comparison.hi < 1 and kl.verdict == REPRODUCED
    assert acc.verdict == NOT_RESOLVED and acc.comparison.lo == pytest.approx(-0.025045, abs=1e-6)
    assert pr2.verdict == NO_RUNS and "no treatment (algorithm=pr2, ministep=single) run" in pr2.reason
    md = render_claims(results, "md")
    lines = md.splitlines()
    assert "| claim | paper | treatment | baseline | Δ or ratio [95% CI] | n | verdict |" in lines
    assert (f"| R3 lowers the train/inference k3 KL | R3: \\~1e-3 -> \\~1e-5 | 2e-05 | 0.0015 | "
            f"×0.0126 [×0.0075, ×0.0212]{MARKER} | 3 | reproduced |") in lines
    assert ("| R3 raises accuracy | +2 points \\| table 3 | 0.577 | 0.55 | +0.0267 [-0.025, +0.0784] | 3 | "
            "not resolved — 3 seeds are too few at this scale |") in lines
    assert ("| PR2 raises accuracy | +1 point | – | – | – | 0 | no runs: no treatment (algorithm=pr2, "
            "ministep=single) run — PR2 was not run in this sweep |") in lines
    assert any("Claim 1: mismatch/k3_kl, agg final, log scale, expect lower" in x for x in lines)


def test_opposite_and_n_too_small_and_unpaired_count(tmp_path):
    exp = """
report:
  claims:
    - {claim: a, paper: p, metric: eval/accuracy, treatment: {algorithm: tis}, baseline: {algorithm: grpo},
       where: {ministep: single}, expect: higher}
    - {claim: b, paper: p, metric: eval/accuracy, treatment: {algorithm: tis}, baseline: {algorithm: grpo},
       where: {ministep: multi}, expect: lower, agg: "mean_last:2"}
"""
    sw = _sweep(tmp_path, exp)
    a, b = evaluate_claims(sw, report_spec(sw).claims, "final")
    assert a.verdict == OPPOSITE and a.comparison.n == 2 and a.failed == ("algorithm=tis__ministep=single__seed=2",)
    # mean_last:2 of the series (0, acc): tis - grpo = 0.15 - (0.15, 0.175, 0.2) = 0, -0.025, -0.05: mean -0.025,
    # sd 0.025, half width 4.302653 * 0.025 / sqrt(3) = 0.062103 -> [-0.0871, +0.0371] contains 0
    assert b.agg == "mean_last:2" and b.comparison.estimate == pytest.approx(-0.025)
    assert b.comparison.lo == pytest.approx(-0.087103, abs=1e-6) and b.verdict == NOT_RESOLVED
    row = list(csv.reader(io.StringIO(render_claims([a], "csv"))))[1]
    assert row[5] == "2 (1 unpaired)" and row[6] == "opposite"


def test_cli_claims_only_in_every_format(tmp_path, capsys):
    sw = _sweep(tmp_path)
    assert main(["table", str(sw), "--claims", "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### Claims\n") and "| R3 raises accuracy |" in out and "### Accuracy" not in out
    assert main(["table", str(sw), "--claims", "--format", "latex"]) == 0
    tex = capsys.readouterr().out
    assert "\\begin{tabular}{lllllll}" in tex and "$\\times$0.0126 [$\\times$0.0075, $\\times$0.0212]$^\\dagger$" in tex
    assert "R3: \\textasciitilde{}1e-3" in tex and "$\\Delta$ or ratio [95\\% CI]" in tex
    assert main(["table", str(sw), "--claims", "--format", "csv"]) == 0
    cap = capsys.readouterr()
    rows = list(csv.reader(io.StringIO(cap.out)))
    assert rows[0] == ["claim", "paper", "treatment", "baseline", "Δ or ratio [95% CI]", "n", "verdict"]
    assert [r[6].split(":")[0].split(" —")[0] for r in rows[1:]] == ["reproduced", "not resolved", "no runs"]
    assert "Paired by seed" in cap.err
    assert main(["table", str(sw), "--claims"]) == 0
    assert "== Claims ==" in capsys.readouterr().out


def test_cli_without_metric_renders_tables_then_claims(tmp_path, capsys):
    sw = _sweep(tmp_path)
    assert main(["table", str(sw), "--format", "md"]) == 0
    out = capsys.readouterr().out
    assert out.index("### Accuracy") < out.index("### Claims")
    assert f"Δ +0.0167 [+0.00232, +0.031]{MARKER} (n=3)" in out     # the table's own baseline: grpo
    assert main(["table", str(sw), "--format", "md", "--baseline", "r3"]) == 0
    assert "baseline row 'r3'" in capsys.readouterr().out
    (sw / "experiment.yaml").write_text("report:\n  tables: [{rows: algorithm, cols: ministep, "
                                        "metric: eval/accuracy}]\n")
    assert main(["table", str(sw), "--format", "md"]) == 0
    assert "Claims" not in capsys.readouterr().out
    assert main(["table", str(sw), "--claims"]) == 2
    assert "no report.claims" in _one_error_line(capsys)
    assert main(["table", str(sw), "--claims", "--metric", "eval/accuracy", "--rows", "algorithm"]) == 2
    assert "--claims renders" in _one_error_line(capsys)


BAD = [
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: lower, "
     "expct: lower}", r"report\.claims\[1\]: unknown key\(s\) \['expct'\]"),
    ("{claim: a, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: lower}",
     r"report\.claims\[1\]: missing key\(s\) \['paper'\]"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: down}",
     r"report\.claims\[1\]\.expect must be one of higher, lower, got 'down'"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: lower, "
     "scale: ln}", r"report\.claims\[1\]\.scale must be one of linear, log, got 'ln'"),
    ("{claim: a, paper: p, metric: m, treatment: r3, baseline: {algorithm: grpo}, expect: lower}",
     r"report\.claims\[1\]\.treatment must be a mapping"),
    ("{claim: a, paper: p, metric: 'a,b', treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: lower}",
     r"report\.claims\[1\]\.metric must name one metric"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: r3}, expect: lower}",
     r"report\.claims\[1\]: treatment and baseline select the same runs"),
    ("{claim: a, paper: p, metric: m, treatment: {seed: 1}, baseline: {seed: 0}, expect: lower}",
     r"report\.claims\[1\]: runs are paired by seed"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: lower, "
     "where: {algorithm: tis}}", r"report\.claims\[1\]: axis 'algorithm' is in both where and treatment"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: lower, "
     "agg: median}", r"report\.claims\[1\]\.agg: unknown --agg"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: lower, "
     "agg: collapse}", r"report\.claims\[1\]\.agg: agg 'collapse' cannot be paired"),
    ("just a string", r"report\.claims\[1\] must be a mapping"),
]
GOOD = ("{claim: ok, paper: p, metric: eval/accuracy, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, "
        "where: {ministep: single}, expect: higher}")


@pytest.mark.parametrize("entry,message", BAD, ids=[m.split("]")[-1][:30] for _, m in BAD])
def test_bad_claim_specs_are_one_line_errors(tmp_path, capsys, entry, message):
    sw = _sweep(tmp_path, f"report:\n  claims:\n    - {GOOD}\n    - {entry}\n")
    assert main(["table", str(sw), "--claims"]) == 2
    line = _one_error_line(capsys)
    assert re.search(message, line), line
    assert "experiment.yaml: report.claims[1]" in line


def test_claims_that_name_an_unknown_axis_or_leave_one_varying_are_refused(tmp_path, capsys):
    sw = _sweep(tmp_path, "report:\n  claims:\n    - {claim: a, paper: p, metric: eval/accuracy, expect: lower, "
                          "treatment: {algo: r3}, baseline: {algo: grpo}}\n")
    assert main(["table", str(sw), "--claims"]) == 2
    line = _one_error_line(capsys)
    assert "report.claims[0]: unknown axis 'algo'" in line and "'algorithm'" in line
    sw.joinpath("experiment.yaml").write_text(
        "report:\n  claims:\n    - {claim: a, paper: p, metric: eval/accuracy, expect: lower, "
        "treatment: {algorithm: r3}, baseline: {algorithm: grpo}}\n")
    assert main(["table", str(sw), "--claims"]) == 2
    line = _one_error_line(capsys)
    assert "axis 'ministep' varies among the treatment (algorithm=r3) runs (multi, single)" in line
    assert "where: {ministep: multi}" in line


def test_log_scale_claim_on_non_positive_values_is_a_one_line_error(tmp_path, capsys):
    sw = _sweep(tmp_path, "report:\n  claims:\n    - {claim: a, paper: p, metric: eval/accuracy, expect: lower, "
                          "treatment: {algorithm: r3}, baseline: {algorithm: grpo}, where: {ministep: multi}, "
                          "scale: log, agg: min}\n")
    assert main(["table", str(sw), "--claims"]) == 2
    assert "report.claims[0]: scale log needs values > 0, but the treatment of seed 0 is 0" in _one_error_line(capsys)


def test_parse_claims_defaults():
    (c,) = parse_claims([{"claim": "a", "paper": "p", "metric": "m:lower", "treatment": {"k": 16},
                          "baseline": {"k": 0}, "expect": "higher"}])
    assert c.scale == "linear" and c.agg is None and c.where == {} and c.explain == ""
    assert c.metric == "m" and c.higher_is_better is False and c.treatment == {"k": "16"}
    assert parse_claims(None) == []
    with pytest.raises(ValueError, match=r"report\.claims must be a list"):
        parse_claims({"claim": "a"})


# ------------------------------------------------------------------------------ end to end: a sweep, then claims
EXP = """
name: tiny
seeds: [0, 1, 2]
base:
  preset: [tis]
  trainer: {steps: 3}
grid:
  algorithm:
    grpo: {preset: [grpo]}
    unclipped: {preset: [unclipped]}
  staleness: {key: buffer.staleness, values: [0, 2]}
report:
  claims:
    - claim: "staleness 2 raises the fake reward"
      paper: "+0.002 by construction"
      metric: reward/mean
      treatment: {staleness: 2}
      baseline: {staleness: 0}
      where: {algorithm: grpo}
      expect: higher
    - claim: "the same, read the wrong way round"
      paper: "-"
      metric: reward/mean
      treatment: {staleness: 2}
      baseline: {staleness: 0}
      where: {algorithm: grpo}
      expect: lower
    - claim: "unclipped changes the fake reward"
      paper: "-"
      metric: reward/mean
      treatment: {algorithm: unclipped}
      baseline: {algorithm: grpo}
      where: {staleness: 0}
      expect: higher
      explain: "the fake trainer ignores the loss"
    - claim: "ppo beats grpo"
      paper: "-"
      metric: reward/mean
      treatment: {algorithm: ppo}
      baseline: {algorithm: grpo}
      where: {staleness: 0}
      expect: higher
"""


def test_sweep_then_claims_end_to_end(tmp_path, capsys):
    exp = tmp_path / "tiny.yaml"
    exp.write_text(EXP)
    out = tmp_path / "sw"
    res = run_sweep(exp, out=out, train_cmd=FAKE, jobs=2, progress=False, log=lambda s: None)
    assert res.counts == {"completed": 10, "failed": 2}      # the fake trainer fails unclipped seed 1
    assert main(["table", str(out), "--claims", "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    by_claim = {r[0]: r for r in rows[1:]}
    # reward = 0.1 seed + 0.01 step + 0.001 staleness: +0.002 in every seed (a zero-width interval)
    up = by_claim["staleness 2 raises the fake reward"]
    assert up[4] == f"+0.002 [+0.002, +0.002]{MARKER}" and up[5] == "3" and up[6] == "reproduced"
    assert by_claim["the same, read the wrong way round"][6] == "opposite"
    same = by_claim["unclipped changes the fake reward"]
    assert same[4] == "+0 [+0, +0]" and same[5] == "2 (1 unpaired)"
    assert same[6] == "not resolved — the fake trainer ignores the loss"
    assert by_claim["ppo beats grpo"][6].startswith("no runs: no treatment (algorithm=ppo, staleness=0) run")


# ------------------------------------------------------------------- equivalence (expect same) and one-sample claims
SAME_AND_ONE_SAMPLE = """
report:
  claims:
    - {claim: tis matches grpo, paper: p, metric: eval/accuracy, treatment: {algorithm: tis},
       baseline: {algorithm: grpo}, where: {ministep: multi}, expect: same, margin: 0.2}
    - {claim: tis matches grpo closely, paper: p, metric: eval/accuracy, treatment: {algorithm: tis},
       baseline: {algorithm: grpo}, where: {ministep: multi}, expect: same, margin: 0.1}
    - {claim: r3 matches grpo exactly, paper: p, metric: eval/accuracy, treatment: {algorithm: r3},
       baseline: {algorithm: grpo}, where: {ministep: multi}, expect: same, margin: 0.001}
    - {claim: r3 keeps the KL within 1.5x, paper: p, metric: mismatch/k3_kl, treatment: {algorithm: r3},
       baseline: {algorithm: grpo}, where: {ministep: multi}, expect: same, margin: 1.5, scale: log}
    - {claim: r3 beats 0.5, paper: p, metric: eval/accuracy, treatment: {algorithm: r3}, baseline_value: 0.5,
       where: {ministep: single}, expect: higher}
    - {claim: r3 KL below 1e-3, paper: p, metric: mismatch/k3_kl, treatment: {algorithm: r3},
       baseline_value: 1.0e-3, where: {ministep: single}, expect: lower, scale: log}
    - {claim: tis sits at 0.3, paper: p, metric: eval/accuracy, treatment: {algorithm: tis}, baseline_value: 0.3,
       where: {ministep: multi}, expect: same, margin: 0.01}
    - {claim: pr2 skill below 1, paper: p, metric: eval/accuracy, treatment: {algorithm: pr2}, baseline_value: 1,
       where: {ministep: multi}, expect: lower}
"""


def test_same_and_one_sample_claims_by_hand(tmp_path):
    sw = _sweep(tmp_path, SAME_AND_ONE_SAMPLE)
    res = evaluate_claims(sw, report_spec(sw).claims, "final")
    loose, close, exact, kl_same, above, kl_low, flat, pr2 = res
    # tis - grpo, multi: 0, -0.05, -0.1 -> mean -0.05, sd 0.05, half 4.302653 * 0.05 / sqrt(3) = 0.124207
    assert loose.comparison.lo == pytest.approx(-0.174207, abs=1e-6)
    assert loose.comparison.hi == pytest.approx(0.074207, abs=1e-6)
    assert loose.verdict == REPRODUCED and close.verdict == NOT_RESOLVED       # inside ±0.2; pokes out of ±0.1
    # r3 - grpo, multi: [+0.002324, +0.031009], wholly above +0.001
    assert exact.comparison.lo == pytest.approx(0.002324, abs=1e-6) and exact.verdict == OPPOSITE
    # KL r3 / grpo, multi: 1 in every seed, a point interval at ratio 1 inside [1/1.5, 1.5]
    assert kl_same.comparison.estimate == pytest.approx(1.0) and kl_same.verdict == REPRODUCED
    # r3 single accuracy 0.52, 0.61, 0.60 vs 0.5: diffs 0.02, 0.11, 0.10, mean 0.076667, sd 0.049329,
    # half 4.302653 * 0.049329 / sqrt(3) = 0.122540 -> [-0.045873, +0.199206]: not resolved
    assert above.comparison.n == 3 and above.comparison.estimate == pytest.approx(0.076667, abs=1e-6)
    assert above.comparison.lo == pytest.approx(-0.045873, abs=1e-6) and above.verdict == NOT_RESOLVED
    # r3 single KL 1e-5, 3e-5, 2e-5 vs 1e-3: ratios 0.01, 0.03, 0.02, geometric mean (6e-6)^(1/3) = 0.018171;
    # log10 ratios mean -1.740616, sd 0.241272, half 0.599352 -> hi 10^-1.141264 = 0.072233 < 1
    assert kl_low.comparison.estimate == pytest.approx((6e-6) ** (1 / 3), rel=1e-9)
    assert kl_low.comparison.hi == pytest.approx(0.072233, rel=1e-5) and kl_low.verdict == REPRODUCED
    assert flat.comparison.lo == flat.comparison.hi == pytest.approx(0.0) and flat.verdict == REPRODUCED
    assert pr2.verdict == NO_RUNS and pr2.reason == "no treatment (algorithm=pr2, ministep=multi) run"
    rows = list(csv.reader(io.StringIO(render_claims(res, "csv", notes=False))))[1:]
    assert rows[4] == ["r3 beats 0.5", "p", "0.577", "0.5 (fixed)", "+0.0767 [-0.0459, +0.199]", "3",
                       "not resolved"]
    assert rows[5][3:] == ["0.001 (fixed)", f"×0.0182 [×0.00457, ×0.0722]{MARKER}", "3", "reproduced"]
    assert rows[7][2:6] == ["–", "1 (fixed)", "–", "0"]               # the constant shows even without runs
    assert rows[0][4:] == ["-0.05 [-0.174, +0.0742]", "3", "reproduced"]
    notes = render_claims(res, "md")
    assert "Claim 1: eval/accuracy, agg final, linear scale, expect same within ±0.2; treatment algorithm=tis vs " \
           "baseline algorithm=grpo; where ministep=multi" in notes
    assert "expect same within ×/÷1.5" in notes and "vs baseline value 0.001; where ministep=single" in notes
    assert "one-sample claim" in notes and "wholly outside" in notes


BAD_NEW = [
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: same}",
     r"report\.claims\[1\]: expect same needs margin"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: higher, "
     "margin: 0.1}", r"report\.claims\[1\]\.margin is only for expect same, not expect higher"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: same, "
     "margin: 0}", r"report\.claims\[1\]\.margin must be a number > 0, got 0"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, expect: same, "
     "margin: 0.5, scale: log}", r"report\.claims\[1\]\.margin on scale log is a ratio factor and must be > 1"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, expect: lower}",
     r"report\.claims\[1\]: give exactly one of baseline .* or baseline_value .*, got neither"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline: {algorithm: grpo}, baseline_value: 1, "
     "expect: lower}", r"report\.claims\[1\]: give exactly one of baseline .*, got both"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline_value: one, expect: lower}",
     r"report\.claims\[1\]\.baseline_value must be a finite number, got 'one'"),
    ("{claim: a, paper: p, metric: m, treatment: {algorithm: r3}, baseline_value: 0, expect: lower, scale: log}",
     r"report\.claims\[1\]\.baseline_value must be > 0 on scale log, got 0"),
]


@pytest.mark.parametrize("entry,message", BAD_NEW, ids=[m.split("]")[-1][:30] for _, m in BAD_NEW])
def test_bad_same_and_one_sample_specs_are_one_line_errors(tmp_path, capsys, entry, message):
    sw = _sweep(tmp_path, f"report:\n  claims:\n    - {GOOD}\n    - {entry}\n")
    assert main(["table", str(sw), "--claims"]) == 2
    line = _one_error_line(capsys)
    assert re.search(message, line), line


def test_parse_one_sample_and_same_claims():
    one, same = parse_claims([
        {"claim": "a", "paper": "p", "metric": "m", "treatment": {"k": 1}, "baseline_value": 1, "expect": "lower"},
        {"claim": "b", "paper": "p", "metric": "m", "treatment": {"k": 1}, "baseline": {"k": 0}, "expect": "same",
         "margin": 2, "scale": "log"}])
    assert one.baseline_value == 1.0 and one.one_sample and one.baseline == {} and one.margin is None
    assert same.margin == 2.0 and not same.one_sample and same.baseline == {"k": "0"}


# ------------------------------------------------------------------------- plan-time validation by `sweep`
def _plan_exp(tmp_path, claims: str) -> Path:
    p = tmp_path / "tiny.yaml"
    p.write_text(EXP.split("report:")[0] + "report:\n  claims:\n" + claims)
    return p


PLAN_BAD = [
    ("    - {claim: a, paper: p, metric: reward/mean, treatment: {staleness: 2}, baseline: {staleness: 0}, "
     "expct: higher}\n", r"tiny\.yaml: report\.claims\[0\]: unknown key\(s\) \['expct'\]"),
    ("    - {claim: a, paper: p, metric: reward/mean, treatment: {staleness: 2}, baseline: {staleness: 0}, "
     "expect: same}\n", r"tiny\.yaml: report\.claims\[0\]: expect same needs margin"),
    ("    - {claim: a, paper: p, metric: reward/mean, treatment: {staleness: 2}, baseline: {staleness: 0}, "
     "expect: up}\n", r"report\.claims\[0\]\.expect must be one of higher, lower, got 'up' \(or same"),
    ("    - {claim: a, paper: p, metric: reward/mean, treatment: {staleness: 2}, baseline_value: 0.1, "
     "expect: higher, where: {algoritm: grpo}}\n",
     r"tiny\.yaml: report\.claims\[0\]\.where: unknown axis 'algoritm': not a grid axis \(algorithm, staleness, "
     r"seed\) nor a config key\. Did you mean 'algorithm'"),
]


@pytest.mark.parametrize("claims,message", PLAN_BAD, ids=["key", "margin", "expect", "axis"])
@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "run"])
def test_sweep_refuses_bad_claims_before_any_run(tmp_path, capsys, monkeypatch, claims, message, dry):
    exp = _plan_exp(tmp_path, claims)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("FAKE_TRAIN_LOG", str(calls))
    out = tmp_path / "sw"
    rc = main(["sweep", str(exp), "--out", str(out), "--train-cmd", " ".join(FAKE), "--no-progress"]
              + (["--dry-run"] if dry else []))
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("offpolicy-moe sweep: error: "), err
    assert re.search(message, err[0]), err[0]
    assert not calls.exists() and not out.exists() and "planned" not in cap.out   # nothing ran, nothing written


def test_sweep_accepts_config_keys_and_warns_about_unknown_labels(tmp_path, capsys):
    exp = _plan_exp(tmp_path, "    - {claim: a, paper: p, metric: reward/mean, treatment: {algorithm: ppo}, "
                              "baseline: {algorithm: grpo}, where: {trainer.steps: 3, seed: 0}, expect: higher}\n"
                              "    - {claim: b, paper: p, metric: reward/mean, treatment: {staleness: 2}, "
                              "baseline_value: 0, expect: same, margin: 0.5}\n")
    assert main(["sweep", str(exp), "--out", str(tmp_path / "sw"), "--dry-run", "--seeds", "0"]) == 0
    out = capsys.readouterr().out
    assert ("warning: " + str(exp) + ": report.claims[0].treatment: grid axis 'algorithm' has no label 'ppo' "
            "(labels: grpo, unclipped); the claim will read 'no runs'") in out
    assert "report.claims: 1 seed (0); every claim will read 'n too small'" in out
    assert "12 runs planned" not in out and "4 runs planned" in out


def test_check_claim_axes_directly():
    (c,) = parse_claims([{"claim": "a", "paper": "p", "metric": "m", "treatment": {"algo": "x"},
                          "baseline": {"algo": "y"}, "expect": "lower"}])
    assert check_claim_axes([c], {"algo": ["x", "y"]}, configs=iter(())) == []
    assert check_claim_axes([c], {"algo": ["x"]}) == [
        "report.claims[0].baseline: grid axis 'algo' has no label 'y' (labels: x); the claim will read 'no runs'"]
    with pytest.raises(ValueError, match=r"report\.claims\[0\]\.treatment: unknown axis 'algo': not a grid axis "
                                         r"\(algorithm, seed\) nor a config key\. Did you mean 'algo\.lr'"):
        check_claim_axes([c], {"algorithm": ["x"]}, configs=[{"algo": {"lr": 1}}])
    assert check_claim_axes([c], {}, configs=[{"algo": 3}]) == []     # a config leaf key is an axis too
