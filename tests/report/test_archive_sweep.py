"""experiments/archive_sweep.py: the archived runs keep every row and only the report's keys, and re-render the
same tables and claims as the sweep folder."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from offpolicy_moe.cli import main
from tests.report.test_claims import _sweep

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "archive_sweep.py"
spec = importlib.util.spec_from_file_location("archive_sweep", SCRIPT)
archive_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(archive_sweep)


def _render(folder: Path, capsys) -> str:
    assert main(["table", str(folder), "--format", "md"]) == 0
    return capsys.readouterr().out


def test_archive_keeps_rows_and_report_keys_and_renders_the_same(tmp_path, capsys):
    sw = _sweep(tmp_path)
    for run in sw.iterdir():                      # a key no table, plot or claim reads
        m = run / "metrics.jsonl"
        if m.is_file():
            rows = [json.loads(x) for x in m.read_text().splitlines()]
            m.write_text("".join(json.dumps(dict(r, **{"perf/time_step_s": 1.0})) + "\n" for r in rows))
    assert archive_sweep.report_metrics(sw / "experiment.yaml") == {"eval/accuracy", "mismatch/k3_kl"}
    out = tmp_path / "results"
    n = archive_sweep.archive(sw, out)
    runs = sorted(p for p in sw.iterdir() if (p / "run.json").is_file())
    assert n == len(runs) == 18
    for run in runs:
        before = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        after = [json.loads(x) for x in (out / "runs" / run.name / "metrics.jsonl").read_text().splitlines()]
        assert after == [{k: v for k, v in r.items() if k != "perf/time_step_s"} for r in before]
    assert _render(out / "runs", capsys) == _render(sw, capsys).replace(str(sw), str(out / "runs"))


def test_archive_keeps_a_run_that_logged_nothing_and_names_a_corrupt_line(tmp_path, capsys):
    sw = _sweep(tmp_path)
    failed = next(p for p in sorted(sw.iterdir()) if (p / "run.json").is_file())
    (failed / "metrics.jsonl").unlink()
    out = tmp_path / "results"
    assert archive_sweep.archive(sw, out) == 18
    assert (out / "runs" / failed.name / "run.json").is_file()
    assert not (out / "runs" / failed.name / "metrics.jsonl").exists()
    (failed / "metrics.jsonl").write_text('{"step": 1}\n{not json\n')
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2 is not a JSON line"):
        archive_sweep.archive(sw, out)


def test_archive_keeps_the_report_metric_of_entries_that_name_none(tmp_path):
    """report.metric is the metric of the entries that name none: the archive keeps it (its rows would otherwise
    lose the key the report's tables and claims read)."""
    exp = tmp_path / "experiment.yaml"
    exp.write_text("report:\n  metric: eval/avg@16\n  tables:\n    - {rows: algorithm}\n"
                   "    - {rows: algorithm, metric: 'eval/accuracy,mismatch/k3_kl:lower'}\n"
                   "  plots:\n    - {by: algorithm}\n")
    assert archive_sweep.report_metrics(exp) == {"eval/avg@16", "eval/accuracy", "mismatch/k3_kl"}
