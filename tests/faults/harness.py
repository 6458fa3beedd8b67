"""The non-finite fault harness: one tiny run through the CLI (in this process, so the test-only hook of
:mod:`offpolicy_moe.run.fault_injection` reaches it) with NaN injected at one stage of step 2, under one
``trainer.on_nan`` policy; what came out of it (:class:`Outcome`) and whether that is right (:func:`problems`).

Used by tests/faults/test_nonfinite_stages.py and experiments/nonfinite_faults.py (the stage x policy table).
"""
from __future__ import annotations

import contextlib
import io
import json
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch

from offpolicy_moe import cli
from offpolicy_moe.run import fault_injection as faults
from offpolicy_moe.run.checkpoint import latest_checkpoint, load_checkpoint
from tests.tiny import TINY

#: step 2 of 3 gets the NaN: step 1 leaves a finite checkpoint to fall back to, step 3 shows the run going on
STEP, STEPS = 2, 3
BASE = [*TINY, f"trainer.steps={STEPS}", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0",
        "trainer.threads=1"]

#: the config under which each stage runs (the old-log-prob pass runs unfused; the fused default only measures)
CASES: dict[str, list[str]] = {
    "generation": [],
    "old_logp": ["trainer.fuse_old_logp=false"],
    "metrics": [],
    "reference": ["algo.kl.coef=0.1"],
    "loss": [],
    "gradients": [],
    "optimizer": [],
    "evaluation": [f"trainer.eval_every={STEP}"],
    "generation/async": ["buffer.mode=async", "rollout.workers=1"],
    "old_logp/async": ["buffer.mode=async", "rollout.workers=1"],
    "old_logp/stream": ["buffer.mode=stream", "buffer.staleness=1", "rollout.stream_slots=8"],
}
POLICIES = ("skip", "stop")


@dataclass
class Outcome:
    """One run's result: exit code, ``summary.json`` status and counts, the error lines printed, the newest
    checkpoint and whether its weights are finite, and (after a ``stop``) the exit code and steps of ``--resume``."""

    case: str
    policy: str
    code: Optional[int]
    status: str = ""
    steps: int = 0
    skipped: float = 0.0
    stage_count: float = 0.0
    error_lines: list = field(default_factory=list)
    traceback: bool = False
    checkpoint_step: Optional[int] = None
    checkpoint_finite: Optional[bool] = None
    resume_code: Optional[int] = None
    resume_steps: Optional[int] = None

    def as_dict(self) -> dict:
        return asdict(self)


def _cli(argv: list[str]) -> tuple[Optional[int], str, bool]:
    """``offpolicy-moe`` in this process: (exit code, stderr, whether it ended in a traceback)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except BaseException:        # noqa: BLE001 - a traceback is the outcome being measured
            traceback.print_exc()
            return None, err.getvalue(), True
    return code, err.getvalue(), False


def finite_checkpoint(run_dir: Path) -> tuple[Optional[int], Optional[bool]]:
    """(step, all weights finite) of the newest checkpoint of ``run_dir``."""
    path = latest_checkpoint(Path(run_dir) / "checkpoints")
    if path is None:
        return None, None
    ck = load_checkpoint(path)
    ok = all(bool(torch.isfinite(t).all()) for t in ck.model.values() if t.is_floating_point())
    return int(ck.state["step"]), ok


def run_case(case: str, policy: str, run_dir: Path, *, resume: bool = True, extra: tuple = ()) -> Outcome:
    """Inject NaN at ``case``'s stage of step :data:`STEP` and train under ``policy``; after a ``stop`` with a
    checkpoint, ``--resume`` (nothing injected) must finish the run."""
    stage = case.split("/")[0]
    faults.arm(stage, STEP)
    try:
        code, err, tb = _cli(["train", *BASE, *CASES[case], *extra, f"trainer.on_nan={policy}",
                              "--run-dir", str(run_dir), "--quiet"])
    finally:
        faults.disarm()
    out = Outcome(case, policy, code, traceback=tb or "Traceback" in err,
                  error_lines=[x for x in err.splitlines() if ": error:" in x])
    summary_path = Path(run_dir) / "summary.json"
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        out.status, out.steps = s["status"], int(s["steps"])
        out.skipped = float(s["final"].get("actor/nan_skipped", 0.0))
        out.stage_count = float(s["final"].get(f"nan/{stage}", 0.0))
    out.checkpoint_step, out.checkpoint_finite = finite_checkpoint(run_dir)
    if resume and policy == "stop" and out.checkpoint_step is not None:
        out.resume_code, _, rtb = _cli(["train", "--resume", "--run-dir", str(run_dir), "--quiet"])
        out.traceback = out.traceback or rtb
        s = json.loads(summary_path.read_text())
        out.resume_steps = int(s["steps"])
    return out


def problems(o: Outcome) -> list[str]:
    """What is wrong with an outcome (empty: right).  ``stop``: exit 1, status diverged, one error line naming
    the stage and step 2, a finite checkpoint of step 1, and ``--resume`` finishes the 3 steps.  ``skip``: exit 0,
    status completed, 3 steps, the skip counted in ``actor/nan_skipped`` and ``nan/<stage>``, finite weights."""
    stage = o.case.split("/")[0]
    bad = []
    if o.traceback:
        bad.append("ended in a traceback")
    if o.policy == "stop":
        if o.code != 1 or o.status != "diverged":
            bad.append(f"exit {o.code}, status {o.status!r} (want 1, 'diverged')")
        if len(o.error_lines) != 1 or f"at step {STEP}" not in o.error_lines[0] \
                or f"stage {stage})" not in o.error_lines[0]:
            bad.append(f"error lines {o.error_lines} (want one naming stage {stage} and step {STEP})")
        if o.checkpoint_step != STEP - 1 or not o.checkpoint_finite:
            bad.append(f"checkpoint of step {o.checkpoint_step}, finite={o.checkpoint_finite} (want step {STEP - 1})")
        if o.resume_code != 0 or o.resume_steps != STEPS:
            bad.append(f"--resume gave exit {o.resume_code} at step {o.resume_steps} (want 0 at {STEPS})")
    else:
        if o.code != 0 or o.status != "completed" or o.steps != STEPS:
            bad.append(f"exit {o.code}, status {o.status!r}, {o.steps} steps (want 0, 'completed', {STEPS})")
        if o.skipped < 1 or o.stage_count < 1:
            bad.append(f"actor/nan_skipped={o.skipped}, nan/{stage}={o.stage_count} (want >= 1)")
        if not o.checkpoint_finite:
            bad.append("final checkpoint holds non-finite weights")
    return bad
