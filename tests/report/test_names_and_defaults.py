"""Tables and plots refuse names the runs do not know (with a did-you-mean), share one default aggregation, tick
staleness plots at the grid values, and escape LaTeX once."""
import json

import pytest

from offpolicy_moe.cli import main
from offpolicy_moe.report.plot import plot_staleness
from offpolicy_moe.report.spec import default_agg
from offpolicy_moe.report.table import DEFAULT_AGG, _latex_escape, build_table

ACC = {("grpo", 0, 0): [0.1, 0.9, 0.2, 0.2], ("grpo", 0, 1): [0.3, 0.9, 0.2, 0.4],
       ("m2po", 0, 0): [0.5, 0.5, 0.5, 0.5], ("m2po", 0, 1): [0.3, 0.3, 0.3, 0.3],
       ("grpo", 4, 0): [0.1] * 4, ("m2po", 4, 0): [0.2] * 4, ("grpo", 16, 0): [0.3] * 4, ("m2po", 16, 0): [0.4] * 4}


def _sweep(tmp_path, report_agg=None):
    sw = tmp_path / "sweep"
    for (alg, k, seed), acc in ACC.items():
        d = sw / f"algorithm={alg}__staleness={k}__seed={seed}"
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"axes": {"algorithm": alg, "staleness": str(k)}, "seed": seed}))
        (d / "summary.json").write_text(json.dumps({"status": "completed"}))
        (d / "config.yaml").write_text(f"seed: {seed}\nalgo:\n  loss:\n    name: {alg}\nbuffer:\n  staleness: {k}\n")
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "eval/accuracy": a}) + "\n"
                                                 for i, a in enumerate(acc)))
    (sw / "sweep.json").write_text(json.dumps({"axes": {"algorithm": ["grpo", "m2po"], "staleness": ["0", "4", "16"]}}))
    if report_agg:
        (sw / "experiment.yaml").write_text(f"report:\n  agg: \"{report_agg}\"\n")
    return sw


def _one_error_line(capsys, command):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"offpolicy-moe {command}: error: "), err[0]
    return err[0]


def test_unknown_metric_is_refused_with_did_you_mean(tmp_path, capsys):
    sw = _sweep(tmp_path)
    with pytest.raises(ValueError, match=r"unknown metric 'eval/acc'.*Did you mean 'eval/accuracy'"):
        build_table(sw, "algorithm", "staleness", "eval/acc")
    assert main(["table", str(sw), "--rows", "algorithm", "--cols", "staleness", "--metric", "eval/acc"]) == 2
    assert "Did you mean 'eval/accuracy'" in _one_error_line(capsys, "table")


def test_unknown_axis_and_config_section_refused_with_did_you_mean(tmp_path, capsys):
    sw = _sweep(tmp_path)
    # 'algo' is a config SECTION (a dict): before, its dict dump became the row label / legend
    assert main(["table", str(sw), "--rows", "algo", "--cols", "staleness", "--metric", "eval/accuracy"]) == 2
    line = _one_error_line(capsys, "table")
    assert "unknown axis 'algo'" in line and "'algorithm'" in line
    assert main(["plot", str(sw), "--metrics", "eval/accuracy", "--by", "algo", "--out", str(tmp_path / "p")]) == 2
    line = _one_error_line(capsys, "plot")
    assert "unknown axis 'algo'" in line and "'algorithm'" in line
    assert not (tmp_path / "p").exists()
    # a config LEAF is an axis
    t = build_table(sw, "algo.loss.name", "staleness", "eval/accuracy", where={"algorithm": "m2po"})
    assert t.row_labels == ["m2po"]


def test_missing_sweep_folder_is_one_line(tmp_path, capsys):
    assert main(["table", str(tmp_path / "nope"), "--rows", "algorithm", "--metric", "eval/accuracy"]) == 2
    _one_error_line(capsys, "table")
    assert main(["plot", str(tmp_path / "nope"), "--metrics", "eval/accuracy", "--by", "algorithm"]) == 2
    _one_error_line(capsys, "plot")


def test_tables_and_plots_share_the_sweeps_default_aggregation(tmp_path, capsys):
    assert default_agg(_sweep(tmp_path / "a")) == DEFAULT_AGG
    sw = _sweep(tmp_path / "b", report_agg="mean_last:3")
    assert default_agg(sw) == "mean_last:3"
    assert main(["table", str(sw), "--rows", "algorithm", "--cols", "staleness", "--metric", "eval/accuracy",
                 "--format", "csv"]) == 0
    out = capsys.readouterr().out
    # grpo staleness 0: mean_last:3 per seed = (0.9+0.2+0.2)/3 and (0.9+0.2+0.4)/3 -> mean 0.467 (final would be 0.3)
    assert "0.467 ± " in out and "agg" not in out
    assert main(["table", str(sw), "--rows", "algorithm", "--cols", "staleness", "--metric", "eval/accuracy",
                 "--agg", "final", "--format", "csv"]) == 0
    assert "0.3 ± 0.141 (2)" in capsys.readouterr().out


def test_staleness_plot_ticks_at_grid_values(tmp_path, monkeypatch):
    import matplotlib.figure

    sw = _sweep(tmp_path)
    seen = []
    real = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **k):
        seen.append([list(ax.get_xticks()) for ax in fig.axes])
        return real(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    plot_staleness(sw, "eval/accuracy", "staleness", "algorithm", tmp_path / "p", agg="final")
    assert seen == [[[0.0, 4.0, 16.0]]]


def test_latex_escape_is_one_pass():
    assert _latex_escape("a\\b_{c}%") == "a\\textbackslash{}b\\_\\{c\\}\\%"
