"""Tables, claims and plots read the sampled held-out metrics (eval/avg@n, eval/pass@k, eval/maj@k) like any other:
beside greedy accuracy with a paired interval for each, as an experiment file's report.metric, in plot file names;
a metric the runs lack (runs trained without eval.samples) is one line naming it, what the runs log and the
eval.samples it needs; a report that reads one no planned run will log is refused before any run."""
from __future__ import annotations

import csv
import io
import math
import sys
from pathlib import Path

import pytest
import yaml
from scipy import stats

from offpolicy_moe.cli import main
from offpolicy_moe.config import ConfigError
from offpolicy_moe.report.names import logs_sampled, sampled_metric, sampled_requirement
from offpolicy_moe.report.plot import metric_filename
from offpolicy_moe.report.spec import metric_names, parse_report
from offpolicy_moe.sweep.execute import run_sweep
from offpolicy_moe.sweep.plan import check_report_metrics, parse_experiment, plan_runs

FAKE = [sys.executable, str(Path(__file__).with_name("fake_sampled_train.py"))]
BASE = {"trainer": {"steps": 2}, "logging": {"progress": False}}
GRID = {"algorithm": {"grpo": {"preset": ["grpo"]}, "m2po": {"preset": ["m2po"]}}}
CLAIM = {"claim": "M2PO samples better", "paper": "p", "treatment": {"algorithm": "m2po"},
         "baseline": {"algorithm": "grpo"}, "expect": "higher"}
# fake_sampled_train.py, last evaluation: avg@4 = mean over the 2 problems of (correct samples / 4)
AVG4 = {("grpo", 0): 1 / 8, ("grpo", 1): 2 / 8, ("m2po", 0): 4 / 8, ("m2po", 1): 6 / 8}
ACC = {("grpo", 0): 0.5, ("grpo", 1): 0.5, ("m2po", 0): 0.5, ("m2po", 1): 1.0}


def _sweep(out: Path, raw: dict) -> Path:
    """A real sweep (planner, executor, run folders) of fake_sampled_train.py runs."""
    res = run_sweep(parse_experiment(raw, source="exp.yaml"), out=out, train_cmd=FAKE, jobs=2, progress=False,
                    log=lambda s: None)
    assert not res.failed, [r.error for r in res.failed]
    return out


@pytest.fixture(scope="module")
def sampled_sweep(tmp_path_factory) -> Path:
    """grpo and m2po x seeds 0, 1, trained with eval.samples = 4; the report reads eval/avg@4 by default."""
    raw = {"name": "s", "seeds": [0, 1], "base": {**BASE, "eval": {"samples": 4}}, "grid": GRID,
           "report": {"metric": "eval/avg@4", "agg": "final", "tables": [{"rows": "algorithm", "baseline": "grpo"}],
                      "plots": [{"by": "algorithm"}], "claims": [CLAIM]}}
    return _sweep(tmp_path_factory.mktemp("sampled") / "sw", raw)


@pytest.fixture(scope="module")
def greedy_sweep(tmp_path_factory) -> Path:
    """One grpo run trained without eval.samples: greedy accuracy only."""
    raw = {"name": "g", "seeds": [0], "base": BASE, "grid": {"algorithm": {"grpo": {"preset": ["grpo"]}}}}
    return _sweep(tmp_path_factory.mktemp("greedy") / "sw", raw)


def _paired(diffs: list[float]) -> str:
    """``Δ +m [lo, hi] (n=N)`` of the paired differences, by hand: mean ± t(0.975, n−1)·sd/√n."""
    n, m = len(diffs), sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (n - 1))
    h = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return f"Δ {m:+.3g} [{m - h:+.3g}, {m + h:+.3g}] (n={n})"


def _cell(values: list[float]) -> str:
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return f"{m:.3g} ± {sd:.3g} ({len(values)})"


def test_a_sampled_metric_beside_greedy_accuracy_with_a_paired_interval_each(sampled_sweep, capsys):
    assert main(["table", str(sampled_sweep), "--rows", "algorithm", "--metric", "eval/accuracy",
                 "--metric", "eval/avg@4", "--baseline", "grpo", "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["algorithm", "eval/accuracy", "eval/avg@4"]
    table = {r[0]: r[1:] for r in rows[1:]}
    grpo = [[table_of[("grpo", s)] for s in (0, 1)] for table_of in (ACC, AVG4)]
    m2po = [[table_of[("m2po", s)] for s in (0, 1)] for table_of in (ACC, AVG4)]
    assert table["grpo"] == [_cell(grpo[0]), _cell(grpo[1])]
    # m2po: the best mean of both columns (starred in csv), each with its own paired difference from grpo
    assert table["m2po"] == [f"{_cell(m)}; {_paired([a - b for a, b in zip(m, g)])}*" for m, g in zip(m2po, grpo)]
    assert table["m2po"][1] == "0.625 ± 0.177 (2); Δ +0.438 [-0.357, +1.23] (n=2)*"


def test_pass_at_k_and_maj_at_k_are_columns_too(sampled_sweep, capsys):
    assert main(["table", str(sampled_sweep), "--rows", "algorithm", "--metric", "eval/pass@4,eval/pass@1",
                 "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    # pass@4 of 4 samples: a problem with any correct sample counts 1; pass@1 = avg@4
    assert rows[1] == ["grpo", "0.5 ± 0 (2)", _cell([AVG4[("grpo", 0)], AVG4[("grpo", 1)]])]
    assert rows[2] == ["m2po", "1 ± 0 (2)*", _cell([AVG4[("m2po", 0)], AVG4[("m2po", 1)]]) + "*"]


def test_the_experiment_files_report_metric_drives_its_tables_claims_and_plots(sampled_sweep, capsys, tmp_path):
    assert main(["table", str(sampled_sweep), "--format", "md"]) == 0
    text = capsys.readouterr().out
    assert "*eval/avg@4 (higher is better); agg final;" in text
    assert "Claim 1: eval/avg@4, agg final" in text
    # the claim: m2po - grpo per seed 0.375, 0.5 -> reproduced? the 95% interval [-0.357, +1.23] contains 0
    assert "| M2PO samples better | p | 0.625 | 0.188 | +0.438 [-0.357, +1.23] | 2 | not resolved |" in text
    assert main(["plot", str(sampled_sweep), "--out", str(tmp_path / "p")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'p' / 'eval_avg@4.png'}"


def test_plot_files_keep_the_sampled_metrics_name(sampled_sweep, tmp_path, capsys):
    assert metric_filename("eval/pass@4") == "eval_pass@4" and metric_filename("reward/mean") == "reward_mean"
    assert main(["plot", str(sampled_sweep), "--metric", "eval/pass@2", "--metric", "eval/maj@4", "--by",
                 "algorithm", "--out", str(tmp_path / "p")]) == 0
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["eval_maj@4.png", "eval_pass@2.png"]


def test_runs_without_sampled_evaluation_are_refused_in_one_line(greedy_sweep, capsys, tmp_path):
    assert main(["table", str(greedy_sweep), "--rows", "algorithm", "--metric", "eval/accuracy,eval/avg@16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["offpolicy-moe table: error: unknown metric 'eval/avg@16': not logged by any selected run. "
                   "(the runs log eval/accuracy; 2 metrics in all); eval/avg@16 is logged only by runs trained "
                   "with eval.samples = 16"]
    assert main(["plot", str(greedy_sweep), "--metric", "eval/pass@4", "--by", "algorithm", "--out",
                 str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("eval/pass@4 is logged only by runs trained with eval.samples >= 4")


def test_a_sampled_metric_the_runs_lack_suggests_the_ones_they_log(sampled_sweep, capsys):
    assert main(["table", str(sampled_sweep), "--rows", "algorithm", "--metric", "eval/avg@8"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("offpolicy-moe table: error: unknown metric 'eval/avg@8': not logged by any selected "
                           "run. Did you mean 'eval/avg@4'")
    assert line.endswith("(the runs log eval/accuracy, eval/avg@4, eval/maj@1, eval/maj@2, eval/maj@4, "
                         "eval/no_answer, eval/pass@1, eval/pass@2, eval/pass@4, eval/scored_problems, "
                         "eval/unscorable_refs; 12 metrics in all); eval/avg@8 is logged only by runs trained with "
                         "eval.samples = 8")


def test_a_claim_on_a_metric_no_run_logged_says_which_samples_it_needs(greedy_sweep, capsys):
    (greedy_sweep / "experiment.yaml").write_text(yaml.safe_dump({"report": {"metric": "eval/maj@8", "claims": [
        {**CLAIM, "treatment": {"algorithm": "grpo"}, "baseline": None, "baseline_value": 0.5}]}}))
    try:
        assert main(["table", str(greedy_sweep), "--claims", "--format", "md"]) == 0
    finally:
        (greedy_sweep / "experiment.yaml").unlink()
    assert ("no runs: no treatment (algorithm=grpo) run logged eval/maj@8 (logged only by runs trained with "
            "eval.samples >= 8)") in capsys.readouterr().out


def test_sampled_names_and_the_samples_that_log_them():
    assert sampled_metric("eval/avg@16") == ("avg", 16) and sampled_metric("eval/maj@3") == ("maj", 3)
    assert sampled_metric("eval/accuracy") is None and sampled_metric("eval/pass@0") is None
    assert sampled_metric("eval/train_avg@4") is None
    # report_ks(16) = 1, 2, 4, 8, 16; report_ks(12) = 1, 2, 4, 8, 12
    assert [k for k in range(1, 17) if logs_sampled(f"eval/pass@{k}", 16)] == [1, 2, 4, 8, 16]
    assert [k for k in range(1, 17) if logs_sampled(f"eval/maj@{k}", 12)] == [1, 2, 4, 8, 12]
    assert [n for n in range(0, 20) if logs_sampled("eval/avg@16", n)] == [16]
    assert not logs_sampled("eval/pass@1", 0) and not logs_sampled("eval/accuracy", 16)
    assert sampled_requirement("eval/avg@8") == "eval.samples = 8"
    assert sampled_requirement("eval/pass@8") == "eval.samples >= 8"
    assert sampled_requirement("eval/maj@12") == "eval.samples = 12"
    assert sampled_requirement("eval/accuracy") is None


def test_report_metric_fills_every_entry_that_names_none():
    spec = parse_report({"metric": "eval/avg@16", "tables": [{"rows": "algorithm"},
                                                             {"rows": "algorithm", "metric": "reward/mean"}],
                         "plots": [{"by": "algorithm"}, {"by": "algorithm", "metrics": ["eval/accuracy"]}],
                         "claims": [CLAIM, {**CLAIM, "metric": "eval/pass@4"}]}, "exp.yaml")
    assert spec.metric == "eval/avg@16"
    assert [t.metric for t in spec.tables] == ["eval/avg@16", "reward/mean"]
    assert [p.metrics for p in spec.plots] == ["eval/avg@16", ["eval/accuracy"]]
    assert [c.metric for c in spec.claims] == ["eval/avg@16", "eval/pass@4"]
    assert metric_names(spec) == {"eval/avg@16": ["report.tables[0]", "report.plots[0]", "report.claims[0]"],
                                  "reward/mean": ["report.tables[1]"], "eval/accuracy": ["report.plots[1]"],
                                  "eval/pass@4": ["report.claims[1]"]}
    plain = parse_report({"tables": [{"rows": "a", "metric": "eval/accuracy"}]}, "exp.yaml")
    assert plain.metric is None and plain.tables[0].metric == "eval/accuracy"


@pytest.mark.parametrize("report, says", [
    ({"metric": "eval/accuracy,eval/avg@4"}, "exp.yaml: report.metric must name one metric (e.g. eval/avg@16), got "
                                             "'eval/accuracy,eval/avg@4'"),
    ({"metric": ["eval/avg@4"]}, "exp.yaml: report.metric must name one metric"),
    ({"metric": 16}, "exp.yaml: report.metric must name one metric"),
    ({"tables": [{"rows": "a"}]}, "exp.yaml: report.tables[0]: missing key(s) ['metric'] (or give report.metric"),
    ({"plots": [{"by": "a"}]}, "exp.yaml: report.plots[0]: missing key(s) ['metrics'] (or give report.metric"),
    ({"claims": [CLAIM]}, "exp.yaml: report.claims[0]: missing key(s) ['metric'] (or give report.metric"),
    ({"tables": [{"rows": "a", "metric": 3}]}, "exp.yaml: report.tables[0].metric must be a metric name"),
    ({"tables": [{"rows": "a", "metric": " , "}]}, "exp.yaml: report.tables[0].metric names no metric"),
    ({"plots": [{"by": "a", "metrics": []}]}, "exp.yaml: report.plots[0].metrics must be a metric name"),
])
def test_report_metric_keys_are_checked_in_one_line(report, says):
    with pytest.raises(ValueError) as e:
        parse_report(report, "exp.yaml")
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def _plan(report: dict, base_eval: dict | None = None, grid: dict | None = None):
    raw = {"seeds": [0], "base": {**BASE, **({"eval": base_eval} if base_eval else {})}, "grid": grid or GRID,
           "report": report}
    exp = parse_experiment(raw, source="exp.yaml")
    return exp, plan_runs(exp)


def test_a_report_metric_no_planned_run_logs_is_refused_before_any_run(tmp_path, capsys):
    exp, runs = _plan({"metric": "eval/avg@16", "tables": [{"rows": "algorithm"}]})
    with pytest.raises(ConfigError) as e:
        check_report_metrics(exp, runs)
    assert str(e.value) == ("exp.yaml: report.tables[0]: metric 'eval/avg@16' is logged only by runs trained with "
                            "eval.samples = 16, and no planned run is (eval.samples: 0); set it in base: or on the "
                            "command line")
    with pytest.raises(ConfigError, match="report.claims.0.: metric 'eval/pass@4' is logged only by runs trained "
                                          "with eval.samples >= 4, and no planned run is .eval.samples: 2."):
        check_report_metrics(*_plan({"claims": [{**CLAIM, "metric": "eval/pass@4"}]}, {"samples": 2}))
    # the sweep command refuses it too, with nothing written: one line, exit code 2, --dry-run or not
    with pytest.raises(ConfigError, match="eval.samples = 16"):
        run_sweep(exp, out=tmp_path / "sw", train_cmd=FAKE, progress=False, log=lambda s: None)
    assert not (tmp_path / "sw").exists()
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp.raw))
    assert main(["sweep", str(path), "--dry-run", "--out", str(tmp_path / "sw")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(f"{path}: report.tables[0]: metric 'eval/avg@16' is logged only by runs trained with "
                         f"eval.samples = 16, and no planned run is (eval.samples: 0); set it in base: or on the "
                         f"command line")
    assert not (tmp_path / "sw").exists()


def test_a_report_metric_the_runs_log_passes_and_a_partial_grid_warns():
    assert check_report_metrics(*_plan({"metric": "eval/pass@4", "tables": [{"rows": "algorithm"}]},
                                       {"samples": 16})) == []
    assert check_report_metrics(*_plan({"tables": [{"rows": "algorithm", "metric": "eval/accuracy"}]})) == []
    grid = {**GRID, "samples": {"key": "eval.samples", "values": [0, 8]}}
    warnings = check_report_metrics(*_plan({"metric": "eval/maj@8", "tables": [{"rows": "algorithm"}]},
                                           grid=grid))
    assert warnings == ["exp.yaml: report.tables[0]: metric 'eval/maj@8' is logged only by runs trained with "
                        "eval.samples >= 8; 2 of 4 planned runs are not (algorithm=grpo__samples=0__seed=0, "
                        "algorithm=m2po__samples=0__seed=0)"]
