"""Tables and plots on synthetic run folders, numbers checked against hand computation."""
import csv
import io
import json
import math
import struct

import pytest

from offpolicy_moe.cli import main
from offpolicy_moe.report.table import (
    aggregate_series,
    build_table,
    format_cell,
    parse_metrics,
    render_table,
)
from offpolicy_moe.report.plot import plot_curves, plot_staleness

# (algorithm, staleness, seed) -> accuracy series over steps 1..4;  kl series = [0.01 * (seed + 1)] * 4
SERIES = {
    ("grpo", "0", 0): [0.1, 0.5, 0.4, 0.3],
    ("grpo", "0", 1): [0.2, 0.6, 0.2, 0.5],
    ("grpo", "4", 0): [0.1, 0.2, 0.2, 0.2],
    ("grpo", "4", 1): [0.1, 0.1, 0.3, 0.4],
    ("m2po", "0", 0): [0.3, 0.3, 0.4, 0.6],
    ("m2po", "0", 1): [0.2, 0.4, 0.6, 0.6],
    # ("m2po", "4", *) missing entirely -> "–"
}


def _make(tmp_path, failed=True):
    sw = tmp_path / "sweep"
    for (alg, k, seed), acc in SERIES.items():
        d = sw / f"algorithm={alg}__staleness={k}__seed={seed}"
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"axes": {"algorithm": alg, "staleness": k}, "seed": seed}))
        (d / "summary.json").write_text(json.dumps({"status": "completed"}))
        (d / "config.yaml").write_text(f"seed: {seed}\nbuffer:\n  staleness: {k}\n")
        lines = [json.dumps({"step": i + 1, "eval/accuracy": a, "mismatch/k3_kl": 0.01 * (seed + 1)})
                 for i, a in enumerate(acc)]
        lines.insert(2, json.dumps({"step": 2.5, "reward/mean": 0.0}))  # a line without the metric
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if failed:
        d = sw / "algorithm=m2po__staleness=4__seed=0"
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"axes": {"algorithm": "m2po", "staleness": "4"}, "seed": 0,
                                                "status": "failed"}))
        (d / "summary.json").write_text(json.dumps({"status": "failed", "error": "exit code 3\nboom"}))
    (sw / "sweep.json").write_text(json.dumps({"axes": {"algorithm": ["m2po", "grpo"], "staleness": ["0", "4"]}}))
    return sw


def _sample_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@pytest.mark.parametrize(
    "agg,per_run",
    [
        ("final", lambda s: s[-1]),
        ("best", lambda s: max(s)),
        ("mean_last:2", lambda s: (s[-1] + s[-2]) / 2),
        ("mean_last:10", lambda s: sum(s) / len(s)),
    ],
)
def test_cell_values_match_hand_computation(tmp_path, agg, per_run):
    sw = _make(tmp_path)
    t = build_table(sw, "algorithm", "staleness", "eval/accuracy", agg)
    for alg, k in (("grpo", "0"), ("grpo", "4"), ("m2po", "0")):
        vals = [per_run(SERIES[(alg, k, s)]) for s in (0, 1)]
        cell = t.cells[(alg, f"staleness={k}")]
        assert cell.n == 2
        assert cell.mean == pytest.approx(sum(vals) / 2, abs=1e-12)
        assert cell.std == pytest.approx(_sample_std(vals), abs=1e-12)
    assert t.cells[("m2po", "staleness=4")].n == 0 and t.cells[("m2po", "staleness=4")].failed == 1


def test_final_table_markdown_exact(tmp_path):
    sw = _make(tmp_path)
    t = build_table(sw, "algorithm", "staleness", "eval/accuracy", "final")
    # rows in sweep.json order (m2po first); final: grpo s0 = (0.3, 0.5) -> 0.4 ± 0.141; s4 = (0.2, 0.4) -> 0.3 ± 0.141
    # m2po s0 = (0.6, 0.6) -> 0.6 ± 0 ; m2po s4: one failed run
    md = render_table(t, "md")
    assert "| algorithm \\ staleness | staleness=0 | staleness=4 |" in md
    assert "| m2po | **0.6 ± 0 (2)** | – (0; 1 failed) |" in md
    assert "| grpo | 0.4 ± 0.141 (2) | **0.3 ± 0.141 (2)** |" in md
    assert md.index("| m2po") < md.index("| grpo")
    assert "Failed runs (1): algorithm=m2po__staleness=4__seed=0 (exit code 3)" in md


def test_lower_is_better_best_and_formats(tmp_path):
    sw = _make(tmp_path, failed=False)
    t = build_table(sw, "algorithm", "staleness", "eval/accuracy:lower", "best")
    # best = min with lower-is-better: grpo s0 (0.1, 0.2) -> 0.15; m2po s0 (0.3, 0.2) -> 0.25; grpo s4 (0.1, 0.1)
    assert t.best == {("grpo", "staleness=0"), ("grpo", "staleness=4")}
    assert t.cells[("grpo", "staleness=0")].mean == pytest.approx(0.15)
    rows = list(csv.reader(io.StringIO(render_table(t, "csv"))))
    assert rows[0] == ["algorithm \\ staleness", "staleness=0", "staleness=4"]
    assert rows[1] == ["m2po", "0.25 ± 0.0707 (2)", "–"]
    assert rows[2] == ["grpo", "0.15 ± 0.0707 (2)*", "0.1 ± 0 (2)*"]
    tex = render_table(t, "latex")
    assert "\\begin{tabular}{lrr}" in tex and "\\toprule" in tex
    assert "grpo & \\textbf{0.15 $\\pm$ 0.0707 (2)} & \\textbf{0.1 $\\pm$ 0 (2)} \\\\" in tex
    assert "m2po & 0.25 $\\pm$ 0.0707 (2) & -- \\\\" in tex
    con = render_table(t, "console")
    assert "0.15 ± 0.0707 (2) *" in con and "0.25 ± 0.0707 (2) *" not in con


def test_multiple_metrics_as_columns_and_where(tmp_path):
    sw = _make(tmp_path)
    t = build_table(sw, "algorithm", None, "eval/accuracy,mismatch/k3_kl:lower", "final",
                    where={"staleness": "0"})
    assert t.col_labels == ["eval/accuracy", "mismatch/k3_kl"]
    kl = t.cells[("grpo", "mismatch/k3_kl")]
    assert kl.mean == pytest.approx(0.015) and kl.std == pytest.approx(_sample_std([0.01, 0.02]))
    assert t.failed == []  # the failed run has staleness 4 and is filtered out


def test_unaccounted_varying_axis_and_unknown_axis_refused(tmp_path):
    sw = _make(tmp_path)
    with pytest.raises(ValueError, match=r"axis 'staleness' varies.*--where staleness=0"):
        build_table(sw, "algorithm", None, "eval/accuracy")
    with pytest.raises(ValueError, match="unknown axis 'algo'"):
        build_table(sw, "algo", "staleness", "eval/accuracy")
    # a config key works as an axis too
    t = build_table(sw, "algorithm", "buffer.staleness", "eval/accuracy", where={"staleness": "4"})
    # the failed run folder has no config.yaml, so its config-key value is unknown ("–")
    assert set(t.cells) == {("grpo", "buffer.staleness=4"), ("m2po", "buffer.staleness=–")}


def test_aggregate_series_and_format_edge_cases():
    assert aggregate_series([], "final") is None
    assert aggregate_series([3.0, 1.0, 2.0], "best", higher=False) == 1.0
    with pytest.raises(ValueError, match="mean_last"):
        aggregate_series([1.0], "mean_last:x")
    with pytest.raises(ValueError, match="unknown --agg"):
        aggregate_series([1.0], "median")
    assert format_cell(None) == "–"
    assert [m.higher for m in parse_metrics("a,b:lower,c:higher", default_higher=False)] == [False, False, True]


def _png_ok(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    assert w > 200 and h > 200 and len(data) > 5000
    return w, h


def test_plots_write_valid_pngs(tmp_path):
    sw = _make(tmp_path)
    paths = plot_curves(sw, "eval/accuracy,mismatch/k3_kl", by="algorithm", out_dir=tmp_path / "p")
    assert [p.name for p in paths] == ["eval_accuracy.png", "mismatch_k3_kl.png"]
    w1, _ = _png_ok(paths[0])
    one = plot_curves(sw, "eval/accuracy", by="algorithm", out_dir=tmp_path / "q", where={"staleness": "0"},
                      band="minmax")
    w2, _ = _png_ok(one[0])
    assert w1 > w2  # staleness varies -> two panels side by side
    st = plot_staleness(sw, "eval/accuracy", staleness_axis="staleness", by="algorithm", out_dir=tmp_path / "p")
    assert st[0].name == "staleness_eval_accuracy.png"
    _png_ok(st[0])
    with pytest.raises(ValueError, match="not logged"):
        plot_curves(sw, "nope/metric", by="algorithm", out_dir=tmp_path / "p")


def test_cli_table_and_plot(tmp_path, capsys):
    sw = _make(tmp_path)
    out = tmp_path / "t.md"
    assert main(["table", str(sw), "--rows", "algorithm", "--cols", "staleness", "--metric", "eval/accuracy",
                 "--agg", "mean_last:2", "--format", "md", "--out", str(out)]) == 0
    # mean_last:2, grpo s0: seed 0 (0.4+0.3)/2 = 0.35, seed 1 (0.2+0.5)/2 = 0.35 -> 0.35 ± 0; m2po s0: 0.5, 0.6
    assert "| grpo | 0.35 ± 0 (2) |" in out.read_text()
    assert "| m2po | **0.55 ± 0.0707 (2)** |" in out.read_text()
    assert main(["table", str(sw), "--rows", "algorithm", "--metric", "eval/accuracy"]) == 2
    assert "varies" in capsys.readouterr().err
    assert main(["plot", str(sw), "--metrics", "eval/accuracy", "--by", "algorithm", "--out", str(tmp_path / "pp"),
                 "--staleness-axis", "staleness"]) == 0
    assert (tmp_path / "pp" / "eval_accuracy.png").is_file()
    assert (tmp_path / "pp" / "staleness_eval_accuracy.png").is_file()


def test_runs_without_the_metric_are_summarised_one_line_per_cell():
    """A sweep where many runs lack the metric lists each (cell, metric) once with its count, not every run."""
    from offpolicy_moe.report.table import Table

    missing = [("grpo / 4", "m2po/m2_before", f"grpo_s4_seed{i}") for i in range(10)]
    missing += [("m2po / 4", "m2po/m2_before", "m2po_s4_seed0")]
    t = Table(row_header="algorithm", row_labels=[], col_labels=[], col_metrics=[],
              cells={}, best=set(), caption="", missing_metric=missing)
    notes = t.notes()
    assert notes[0] == "Runs without the metric (11), by cell:"
    assert notes[1:] == ["  grpo / 4: m2po/m2_before: 10 runs (grpo_s4_seed0, grpo_s4_seed1, grpo_s4_seed2, +7 more)",
                         "  m2po / 4: m2po/m2_before: 1 run (m2po_s4_seed0)"]
