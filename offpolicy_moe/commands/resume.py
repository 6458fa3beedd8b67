"""What ``train --resume`` may do to a run folder, decided before any model is built.

The run's own ``config.yaml`` is the base; a YAML and ``key=value`` overrides may be given, and the resolved config
is compared with the saved one, key by key.  Keys that only extend or observe a run (:data:`EXTEND_KEYS`,
:data:`EXTEND_PREFIXES`) may change freely; any other change is refused with the keys named unless forced
(``--force-change``).  Nothing to resume is a :class:`ResumeError`, never a silent restart.

Every invocation of ``train`` on a run folder is one *segment*, appended to ``<run>/segments.jsonl``
(:func:`record_segment`); ``summary.json``'s ``wall_time_s`` is the sum over all segments.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from offpolicy_moe.commands.errors import UsageError
from offpolicy_moe.config.load import load_config, to_dict
from offpolicy_moe.config.schema import TrainConfig
from offpolicy_moe.run.checkpoint import latest_checkpoint

SEGMENTS_FILE = "segments.jsonl"

#: keys that extend or observe a run without changing what it computes
EXTEND_KEYS = frozenset({
    "run_dir", "trainer.steps", "trainer.eval_every", "trainer.log_every", "trainer.checkpoint_every",
    "trainer.keep_checkpoints", "trainer.min_free_mb", "trainer.threads", "trainer.follow_threads",
    "trainer.eval_batch_size",
})
EXTEND_PREFIXES = ("logging.", "eval.")     # eval.*: the sampled evaluation observes (its own engine and seed)


class ResumeError(UsageError):
    """``--resume`` cannot do what was asked (nothing to resume, or a change of the run's meaning)."""


@dataclass
class ResumePlan:
    """The config to resume with, the checkpoint, and the keys that differ from the saved config."""

    config: TrainConfig
    checkpoint: Path
    from_step: int
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)   # key -> (saved, new)
    forced: list[str] = field(default_factory=list)                     # the meaning-changing keys among them


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists are leaves)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def extends_only(key: str) -> bool:
    """True for a key whose change extends or observes a run (see :data:`EXTEND_KEYS`)."""
    return key in EXTEND_KEYS or key.startswith(EXTEND_PREFIXES)


def config_changes(saved: TrainConfig, new: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Every dotted key whose value differs between two configs, as ``key -> (saved, new)``."""
    a, b = flatten(to_dict(saved)), flatten(to_dict(new))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def checkpoint_step(path: Path) -> int:
    """The step of a ``step_<n>`` checkpoint folder."""
    return int(path.name.rsplit("_", 1)[-1])


def plan_resume(run_dir: str | os.PathLike, config: Optional[str], overrides: Sequence[str] = (),
                presets: Sequence[str] = (), force_change: bool = False) -> ResumePlan:
    """The config ``run_dir`` resumes with (``config`` None: the run's own ``config.yaml`` plus ``overrides``).
    :class:`ResumeError` names the problem: no such folder, no saved config, no checkpoint, a step budget already
    reached, or meaning-changing keys without ``force_change``."""
    rd = Path(run_dir)
    if not rd.is_dir():
        raise ResumeError(f"--resume: run folder '{rd}' does not exist; nothing to resume (drop --resume to start "
                          "a new run there)")
    saved_path = rd / "config.yaml"
    if not saved_path.is_file():
        raise ResumeError(f"--resume: '{rd}' holds no config.yaml, so no run to resume")
    ck = latest_checkpoint(rd / "checkpoints")
    if ck is None:
        raise ResumeError(f"--resume: nothing to resume in '{rd}': it holds no complete checkpoint (the run stopped "
                          "before its first checkpoint; see trainer.checkpoint_every). Start it again without "
                          "--resume into a new --run-dir")
    saved = load_config(saved_path)
    new = load_config(config if config is not None else saved_path, overrides, presets=list(presets))
    new.run_dir = str(rd)
    saved.run_dir = str(rd)
    step = checkpoint_step(ck)
    changed = config_changes(saved, new)
    meaning = [k for k in changed if not extends_only(k)]
    if meaning and not force_change:
        listed = ", ".join(f"{k}: {changed[k][0]!r} -> {changed[k][1]!r}" for k in meaning)
        raise ResumeError(f"--resume would change what the run means ({listed}); only keys that extend a run may "
                          "change (trainer.steps, logging, eval/checkpoint cadence); pass --force-change to "
                          "continue anyway (recorded in segments.jsonl), or start a new --run-dir")
    if new.trainer.steps <= step:
        raise ResumeError(f"--resume: nothing to resume in '{rd}': its checkpoint is at step {step} and "
                          f"trainer.steps={new.trainer.steps}; pass trainer.steps=N with N > {step} to extend it")
    return ResumePlan(new, ck, step, changed, meaning)


def read_segments(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``<run>/segments.jsonl`` (empty when absent)."""
    p = Path(run_dir) / SEGMENTS_FILE
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def prior_wall_time(run_dir: str | os.PathLike) -> float:
    """Wall seconds of the run's earlier segments: ``summary.json``'s ``wall_time_s`` (cumulative), else 0."""
    try:
        return float(json.loads((Path(run_dir) / "summary.json").read_text()).get("wall_time_s") or 0.0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def record_segment(run_dir: str | os.PathLike, summary: dict, *, prior_wall_s: float, started: float,
                   plan: Optional[ResumePlan], threads: dict) -> dict:
    """Append this invocation to ``segments.jsonl`` and make ``summary.json``'s ``wall_time_s`` cover every segment
    (``summary``'s own is this segment's); the updated summary is written back atomically and returned."""
    rd = Path(run_dir)
    segments = read_segments(rd)
    seg_wall = float(summary.get("wall_time_s") or 0.0)
    record = {
        "segment": len(segments),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": summary.get("status"),
        "from_step": plan.from_step if plan else 0,
        "to_step": summary.get("steps"),
        "wall_time_s": round(seg_wall, 3),
        "threads": threads,
    }
    if plan is not None and plan.changed:
        record["changed"] = {k: list(v) for k, v in plan.changed.items() if k != "run_dir"}
        if plan.forced:
            record["forced"] = True
            record["forced_keys"] = plan.forced
    with open(rd / SEGMENTS_FILE, "a") as fh:
        fh.write(json.dumps(record, default=str) + "\n")
    out = dict(summary)
    out["wall_time_s"] = prior_wall_s + seg_wall
    out["segments"] = len(segments) + 1
    tmp = rd / ".summary.json.tmp"
    tmp.write_text(json.dumps(out, indent=2, sort_keys=True))
    os.replace(tmp, rd / "summary.json")
    return out
