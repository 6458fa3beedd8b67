"""Run an experiment grid: one subprocess ``train`` per (grid point, seed), into one sweep folder.

Layout::

    <sweep>/experiment.yaml        copy of the experiment file (tables/plots read its `report:` section)
    <sweep>/sweep.json             axes (ordered labels), seeds, one record per run (status, return code, time)
    <sweep>/<axis=label>__...__seed=<s>/
        config.yaml                resolved config (written here, re-saved by the trainer)
        run.json                   axis labels, seed, status, return code, wall time, command  (written here)
        train.log                  the trainer's stdout and stderr
        metrics.jsonl summary.json env.json   written by the trainer

A run is completed iff the command exits 0 and ``summary.json`` says ``"status": "completed"``; otherwise it is
recorded as failed (with the log's tail) and the sweep goes on.  ``resume=True`` skips completed runs and restarts
the others from scratch.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import yaml

from offpolicy_moe.config.load import save_resolved
from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.sources.modes import validate_run
from offpolicy_moe.sweep.plan import (Experiment, RunSpec, check_claims, check_report_metrics, load_experiment,
                                      plan_runs)
from offpolicy_moe.report.runs import read_json

TRAIN_CMD_ENV = "OFFPOLICY_MOE_TRAIN_CMD"
OWN_FILES = ("config.yaml", "run.json", "train.log")


@dataclass
class RunResult:
    name: str
    status: str  # completed | failed | skipped | planned (dry run)
    returncode: Optional[int] = None
    wall_s: float = 0.0
    error: Optional[str] = None


@dataclass
class SweepResult:
    sweep_dir: Path
    results: list[RunResult] = field(default_factory=list)

    @property
    def failed(self) -> list[RunResult]:
        return [r for r in self.results if r.status == "failed"]

    @property
    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status] = out.get(r.status, 0) + 1
        return out


def default_train_cmd() -> list[str]:
    """``$OFFPOLICY_MOE_TRAIN_CMD`` (shell-split) or ``[sys.executable, -m, offpolicy_moe, train]``."""
    env = os.environ.get(TRAIN_CMD_ENV)
    return shlex.split(env) if env else [sys.executable, "-m", "offpolicy_moe", "train"]


def read_status(run_dir: Path) -> Optional[str]:
    """``status`` of ``summary.json`` in ``run_dir`` (None when absent or unreadable)."""
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def run_sweep(
    experiment: str | Path | Experiment,
    *,
    out: Optional[str | Path] = None,
    seeds: Optional[Sequence[int]] = None,
    overrides: Sequence[str] = (),
    jobs: int = 1,
    threads: int = 1,
    resume: bool = False,
    overwrite: bool = False,
    train_cmd: Optional[Sequence[str] | str] = None,
    timeout: Optional[float] = None,
    progress: bool = True,
    dry_run: bool = False,
    log: Callable[[str], None] = print,
) -> SweepResult:
    """Plan, validate (all runs, before any compute) and execute a sweep.

    Each run gets ``threads`` CPU threads (``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` unless already set): the small CPU
    models gain nothing from more, and several multi-threaded runs on a few cores oversubscribe them, so ``jobs`` is
    the parallelism.  Raises :class:`ConfigError` for an invalid run config or ``report.claims`` entry, a sampled
    metric of the report that no run logs (:func:`~offpolicy_moe.sweep.plan.check_report_metrics`), or a sweep
    folder that already holds runs without ``resume`` or ``overwrite``.
    """
    exp = experiment if isinstance(experiment, Experiment) else load_experiment(experiment)
    runs = plan_runs(exp, seeds=seeds, overrides=overrides)
    _validate_runs(exp, runs, log)
    for w in check_claims(exp, runs):      # report.claims' axis names, before any run (keys: load_experiment)
        log(f"warning: {w}")
    for w in check_report_metrics(exp, runs):      # sampled metrics the report reads vs the runs' eval.samples
        log(f"warning: {w}")
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    sweep_dir = Path(out) if out is not None else Path("runs") / exp.name
    cmd = shlex.split(train_cmd) if isinstance(train_cmd, str) else list(train_cmd or default_train_cmd())
    if dry_run:
        return _dry_run(exp, runs, sweep_dir, cmd, log)
    _prepare_folder(exp, runs, sweep_dir, resume=resume, overwrite=overwrite)
    state = _SweepState(sweep_dir, exp, runs)
    result = SweepResult(sweep_dir)
    todo: list[RunSpec] = []
    for spec in runs:
        rd = sweep_dir / spec.name
        if resume and read_status(rd) == "completed":
            r = RunResult(spec.name, "skipped")
            state.record(spec, r, prev_status="completed", prev=read_json(rd / "run.json"))
            result.results.append(r)
            continue
        todo.append(spec)
    state.write()
    if not todo:
        log(f"sweep '{exp.name}': all {len(runs)} runs already completed ({sweep_dir})")
        return result
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, str(threads))
    _execute_all(todo, sweep_dir, cmd, env, timeout, jobs, state, result, progress=progress, log=log,
                 desc=f"sweep {exp.name}")
    c = result.counts
    log(
        f"sweep '{exp.name}': {c.get('completed', 0)} completed, {c.get('failed', 0)} failed, "
        f"{c.get('skipped', 0)} skipped -> {sweep_dir}"
    )
    return result


def _validate_runs(exp: Experiment, runs: list[RunSpec], log: Callable[[str], None]) -> None:
    """Every run's config, before any compute (the error names the run)."""
    for spec in runs:
        try:
            for w in validate_run(spec.config):
                log(f"warning [{spec.name}]: {w}")
        except ConfigError as exc:
            raise ConfigError(f"experiment '{exp.name}', run {spec.name}: {exc}") from None


def _dry_run(exp: Experiment, runs: list[RunSpec], sweep_dir: Path, cmd: list[str],
             log: Callable[[str], None]) -> SweepResult:
    """Print each run's command (finished ones marked), execute nothing."""
    result = SweepResult(sweep_dir)
    for spec in runs:
        rd = sweep_dir / spec.name
        done = read_status(rd) == "completed"
        log(f"{'[done] ' if done else ''}{spec.name}: {shlex.join([*cmd, str(rd / 'config.yaml'), f'run_dir={rd}'])}")
        result.results.append(RunResult(spec.name, "completed" if done else "planned"))
    log(f"sweep '{exp.name}': {len(runs)} runs planned, all configs valid (dry run, nothing executed)")
    return result


def _prepare_folder(exp: Experiment, runs: list[RunSpec], sweep_dir: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse a folder that already holds these runs (unless resume / overwrite); copy the experiment file in."""
    existing = [s for s in runs if (sweep_dir / s.name).exists()]
    if existing and not (resume or overwrite):
        raise ConfigError(
            f"sweep folder '{sweep_dir}' already holds {len(existing)} of these runs; pass --resume to skip "
            "finished runs (and redo the others) or --overwrite to start again"
        )
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if exp.source is not None:
        shutil.copyfile(exp.source, sweep_dir / "experiment.yaml")
    else:
        (sweep_dir / "experiment.yaml").write_text(yaml.safe_dump(exp.raw, sort_keys=False))


def _execute_all(todo: list[RunSpec], sweep_dir: Path, cmd: list[str], env: dict, timeout: Optional[float],
                 jobs: int, state: "_SweepState", result: SweepResult, *, progress: bool,
                 log: Callable[[str], None], desc: str) -> None:
    """Run ``todo`` on ``jobs`` worker threads (one subprocess each), recording each result as it ends."""
    bar = _progress(len(todo), enabled=progress, desc=desc)
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futs = {pool.submit(_execute, spec, sweep_dir / spec.name, cmd, env, timeout): spec for spec in todo}
            for fut in as_completed(futs):
                spec = futs[fut]
                r = fut.result()
                state.record(spec, r)
                state.write()
                result.results.append(r)
                if r.status == "failed":
                    log(f"run {spec.name} FAILED (rc={r.returncode}): {(r.error or '').splitlines()[-1:]}")
                if bar is not None:
                    c = result.counts
                    bar.set_postfix(ok=c.get("completed", 0), failed=c.get("failed", 0), refresh=False)
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _execute(spec: RunSpec, run_dir: Path, cmd: list[str], env: dict, timeout: Optional[float]) -> RunResult:
    """Run one training subprocess into a clean ``run_dir``; never raises for a failing run."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cfg_path = save_resolved(spec.config, run_dir)
    argv = [*cmd, str(cfg_path), f"run_dir={run_dir}"]
    info = {
        "name": spec.name,
        "axes": spec.axes,
        "seed": spec.seed,
        "status": "running",
        "command": argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    _write_json(run_dir / "run.json", info)
    t0 = time.monotonic()
    rc: Optional[int]
    error = None
    try:
        with open(run_dir / "train.log", "wb") as logf:
            proc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc, error = None, f"timed out after {timeout} s"
    except OSError as exc:  # command not found, etc.
        rc, error = None, f"could not start {argv[0]!r}: {exc}"
    wall = time.monotonic() - t0
    status = read_status(run_dir)
    if error is None and rc != 0:
        error = f"exit code {rc}"
    elif error is None and status != "completed":
        error = f"summary.json status is {status!r}, expected 'completed'"
    if error is not None:
        tail = _tail(run_dir / "train.log")
        full = f"{error}\n{tail}".rstrip()
        summary = read_json(run_dir / "summary.json") or {}
        summary.update({"status": "failed", "returncode": rc, "error": full})
        _write_json(run_dir / "summary.json", summary)
        res = RunResult(spec.name, "failed", rc, wall, full)
    else:
        res = RunResult(spec.name, "completed", rc, wall)
    info.update(status=res.status, returncode=rc, wall_s=round(wall, 3), error=res.error,
                finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
    _write_json(run_dir / "run.json", info)
    return res


class _SweepState:
    """``sweep.json``: written after every finished run (thread-safe, atomic rename)."""

    def __init__(self, sweep_dir: Path, exp: Experiment, runs: list[RunSpec]):
        self.path = sweep_dir / "sweep.json"
        self.lock = threading.Lock()
        self.data = {
            "name": exp.name,
            "description": exp.description,
            "experiment": str(exp.source) if exp.source else None,
            "axes": {a.name: [lab for lab in a.labels] for a in exp.axes},
            "seeds": sorted({r.seed for r in runs}),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "runs": {r.name: {"axes": r.axes, "seed": r.seed, "status": "pending"} for r in runs},
        }

    def record(self, spec: RunSpec, r: RunResult, prev_status: Optional[str] = None, prev: Optional[dict] = None):
        with self.lock:
            entry = self.data["runs"][spec.name]
            entry["status"] = prev_status or r.status
            if r.status == "skipped":
                entry["skipped_on_resume"] = True
                if prev:
                    entry["wall_s"] = prev.get("wall_s")
            else:
                entry.update(returncode=r.returncode, wall_s=round(r.wall_s, 3))
                if r.error:
                    entry["error"] = r.error.splitlines()[0]

    def write(self):
        with self.lock:
            runs = self.data["runs"].values()
            self.data["counts"] = {s: sum(1 for e in runs if e["status"] == s) for s in ("completed", "failed", "pending")}
            self.data["failed_runs"] = [n for n, e in self.data["runs"].items() if e["status"] == "failed"]
            self.data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            _write_json(self.path, self.data)


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True)


def _tail(path: Path, n: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
