"""Reading run folders (the only input of tables and plots; never wandb).  Axis values come from ``run.json``;
any other name is looked up as a dotted key of ``config.yaml``, so plain run folders can be tabulated by config key
too.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

FAILED_STATUSES = ("failed", "error", "crashed", "interrupted", "nan", "stopped")


@dataclass
class RunRecord:
    name: str
    path: Path
    axes: dict[str, str] = field(default_factory=dict)
    seed: Optional[int] = None
    status: str = "unknown"
    error: Optional[str] = None
    _metrics: Optional[list[dict]] = None
    _config: Optional[dict] = None
    _summary: Optional[dict] = None

    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def failed(self) -> bool:
        return self.status in FAILED_STATUSES

    @property
    def rows(self) -> list[dict]:
        """The parsed ``metrics.jsonl`` lines (malformed lines skipped)."""
        if self._metrics is None:
            self._metrics = []
            p = self.path / "metrics.jsonl"
            if p.is_file():
                for line in p.read_text(errors="replace").splitlines():
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        obj = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        self._metrics.append(obj)
        return self._metrics

    @property
    def config(self) -> dict:
        if self._config is None:
            p = self.path / "config.yaml"
            try:
                self._config = yaml.safe_load(p.read_text()) or {} if p.is_file() else {}
            except yaml.constructor.ConstructorError as exc:   # a python/object tag: refused, never built
                raise ValueError(f"{p}: refused YAML tag: {str(exc).splitlines()[0]}") from None
            except yaml.YAMLError:
                self._config = {}
        return self._config

    @property
    def summary(self) -> dict:
        if self._summary is None:
            self._summary = read_json(self.path / "summary.json") or {}
        return self._summary

    def series(self, metric: str) -> list[tuple[float, float]]:
        """``(step, value)`` pairs of ``metric`` in logging order, finite values only; the ``summary.json`` value as a
        single point when the metric never appears in ``metrics.jsonl``."""
        out = []
        for i, row in enumerate(self.rows):
            v = row.get(metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                step = row.get("step", i)
                out.append((float(step) if isinstance(step, (int, float)) else float(i), float(v)))
        if not out:  # summary.json: top-level key, or the trainer's "final" metrics
            v = _lookup(self.summary, metric)
            if v is None and isinstance(self.summary.get("final"), dict):
                v = self.summary["final"].get(metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out.append((float("nan"), float(v)))
        return out

    def value_of(self, axis: str) -> Optional[str]:
        """Label of ``axis`` for this run: ``run.json`` axes, ``seed``, else the config's dotted key."""
        if axis in self.axes:
            return self.axes[axis]
        if axis == "seed":
            if self.seed is not None:
                return str(self.seed)
            s = self.config.get("seed")
            return None if s is None else str(s)
        v = _lookup(self.config, axis)
        if v is None or isinstance(v, dict):    # a config section ("algo") is not an axis; its leaves are
            return None
        return ",".join(map(str, v)) if isinstance(v, list) else str(v)


def load_runs(sweep_dir: str | Path) -> list[RunRecord]:
    """Every run folder directly inside ``sweep_dir`` (or ``sweep_dir`` itself if it is one), sorted by name."""
    d = Path(sweep_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"sweep folder '{d}' does not exist")
    cands = [d] if _is_run(d) else sorted(p for p in d.iterdir() if p.is_dir() and _is_run(p))
    runs = []
    for p in cands:
        info = read_json(p / "run.json") or {}
        summ = read_json(p / "summary.json") or {}
        axes = info.get("axes") if isinstance(info.get("axes"), dict) else _axes_from_name(p.name)
        seed = info.get("seed")
        if seed is None and "seed" in axes:
            seed = axes.get("seed")
        axes = {str(k): str(v) for k, v in axes.items() if k != "seed"}
        status = summ.get("status") or info.get("status") or ("unknown" if (p / "metrics.jsonl").exists() else "missing")
        if info.get("status") == "failed":
            status = "failed"
        err = summ.get("error") or info.get("error")
        runs.append(RunRecord(p.name, p, axes, int(seed) if seed is not None else None, str(status), err))
    return runs


def axis_order(sweep_dir: str | Path) -> dict[str, list[str]]:
    """Label order of each axis as declared in the sweep's ``sweep.json`` (empty if absent)."""
    data = read_json(Path(sweep_dir) / "sweep.json") or {}
    axes = data.get("axes")
    return {str(k): [str(x) for x in v] for k, v in axes.items()} if isinstance(axes, dict) else {}


def natural_sort(labels: list[str], order: Optional[list[str]] = None) -> list[str]:
    """Declared order first; remaining labels numerically when all numeric, else alphabetically."""
    labels = list(dict.fromkeys(labels))
    order = order or []
    head = [x for x in order if x in labels]
    rest = [x for x in labels if x not in head]

    def key(x: str):
        try:
            return (0, float(x), x)
        except ValueError:
            return (1, 0.0, x)

    return head + sorted(rest, key=key)


def _is_run(p: Path) -> bool:
    return any((p / f).exists() for f in ("run.json", "metrics.jsonl", "summary.json"))


def _axes_from_name(name: str) -> dict[str, str]:
    out = {}
    for part in name.split("__"):
        m = re.match(r"^([^=]+)=(.*)$", part)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _lookup(d: Any, dotted: str) -> Any:
    if isinstance(d, dict) and dotted in d:
        return d[dotted]
    cur = d
    for part in dotted.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return None
    return cur


def read_json(path: Path) -> Optional[dict]:
    """A JSON object file as a dict; None when absent, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
