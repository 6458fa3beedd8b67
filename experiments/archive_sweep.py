"""Archive a finished sweep into a results folder that `offpolicy-moe table` and `plot` can read again.

    python experiments/archive_sweep.py runs/r3_ablation experiments/results/r3_ablation

writes ``OUT/runs/`` (the sweep's ``experiment.yaml`` and ``sweep.json``; for every run its ``config.yaml``,
``run.json``, ``summary.json``, ``env.json`` and a ``metrics.jsonl`` that keeps every logged row but only the
keys the experiment's report reads: its tables, plots and claims, plus ``step``), then ``OUT/tables.md``
(``offpolicy-moe table OUT/runs --format md``: the report's tables and its claims table) and the report's plots
(``offpolicy-moe plot OUT/runs --out OUT``). Checkpoints and exports are left out. Re-rendering from ``OUT/runs``
gives the same tables as from the sweep folder, because the aggregations see the same rows of the same keys.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from offpolicy_moe.report.spec import metric_names, parse_report

RUN_FILES = ("config.yaml", "run.json", "summary.json", "env.json")
SWEEP_FILES = ("experiment.yaml", "sweep.json")


def report_metrics(experiment_yaml: Path) -> set[str]:
    """Every metric name the ``report:`` section reads (``:lower``/``:higher`` suffixes dropped; ``report.metric``
    for the entries that name none), as the report's own parser reads it."""
    raw = (yaml.safe_load(experiment_yaml.read_text()) or {}).get("report")
    return set(metric_names(parse_report(raw, str(experiment_yaml))))


def archive(sweep: Path, out: Path) -> int:
    """Copy the sweep's runs into ``out/runs`` (module docstring); returns the number of runs archived."""
    keep = report_metrics(sweep / "experiment.yaml") | {"step"}
    dest = out / "runs"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in SWEEP_FILES:
        shutil.copy2(sweep / name, dest / name)
    count = 0
    for run in sorted(p for p in sweep.iterdir() if (p / "run.json").is_file()):
        target = dest / run.name
        target.mkdir()
        for name in RUN_FILES:
            if (run / name).is_file():
                shutil.copy2(run / name, target / name)
        src_metrics = run / "metrics.jsonl"
        if not src_metrics.is_file():       # a run that failed before logging: its status says so in the tables
            count += 1
            continue
        with open(src_metrics) as src, open(target / "metrics.jsonl", "w") as dst:
            for lineno, line in enumerate(src, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise SystemExit(f"error: {src_metrics}:{lineno} is not a JSON line") from None
                dst.write(json.dumps({k: v for k, v in row.items() if k in keep}) + "\n")
        count += 1
    return count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path, help="the finished sweep folder (runs/<name>)")
    ap.add_argument("out", type=Path, help="the results folder (experiments/results/<name>)")
    args = ap.parse_args()
    if not (args.sweep / "experiment.yaml").is_file():
        print(f"error: {args.sweep} is not a sweep folder (no experiment.yaml)", file=sys.stderr)
        return 2
    n = archive(args.sweep, args.out)
    cli = [sys.executable, "-m", "offpolicy_moe"]
    tables = subprocess.run(cli + ["table", str(args.out / "runs"), "--format", "md"], check=True,
                            capture_output=True, text=True).stdout
    (args.out / "tables.md").write_text(tables)
    for old in args.out.glob("*.png"):
        old.unlink()
    subprocess.run(cli + ["plot", str(args.out / "runs"), "--out", str(args.out)], check=True)
    print(f"archived {n} runs -> {args.out}/runs; tables -> {args.out}/tables.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
