"""The non-finite fault table (issue 31): NaN injected at every stage of a step, under each ``trainer.on_nan``
policy, plus one real divergence (a huge learning rate) per policy; what each run did.

Each injected cell is one 3-step tiny run through the CLI in this process (the injection hook,
offpolicy_moe/run/fault_injection.py, is test-only: no config key reaches it), NaN at one stage of step 2, with the
harness of tests/faults/harness.py: exit code, ``summary.json`` status, the error line, the newest checkpoint and
whether its weights are finite, and after a ``stop`` whether ``--resume`` finishes the run.  The real divergences run
``python -m offpolicy_moe train`` as a user would (``optim.lr=1e15`` on the tiny job).

Usage::

    python experiments/nonfinite_faults.py [--out experiments/results/nonfinite_faults] [--no-async]

Writes ``table.md`` (the stage x policy table, shown in docs/faults.md) and ``results.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REAL = ["optim.lr=1e15", "trainer.steps=3", "trainer.checkpoint_every=1", "trainer.threads=1"]


def real_divergence(policy: str, run_dir: Path) -> dict:
    """``offpolicy-moe train`` with a diverging lr under ``policy`` (a subprocess, as a user runs it); after a stop,
    ``--resume``."""
    from tests.faults.harness import finite_checkpoint
    from tests.tiny import TINY

    cmd = [sys.executable, "-m", "offpolicy_moe", "train", *TINY, *REAL, f"trainer.on_nan={policy}",
           "--run-dir", str(run_dir), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    s = json.loads((run_dir / "summary.json").read_text())
    step, finite = finite_checkpoint(run_dir)
    out = {"case": "real: optim.lr=1e15", "policy": policy, "code": r.returncode, "status": s["status"],
           "steps": s["steps"], "error_lines": [x for x in r.stderr.splitlines() if ": error:" in x],
           "traceback": "Traceback" in r.stderr, "checkpoint_step": step, "checkpoint_finite": finite,
           "skipped": s["final"].get("actor/nan_skipped", 0.0)}
    if policy == "stop":
        rr = subprocess.run([sys.executable, "-m", "offpolicy_moe", "train", "--resume", "--run-dir", str(run_dir),
                             "--quiet"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        s = json.loads((run_dir / "summary.json").read_text())
        out.update(resume_code=rr.returncode, resume_steps=s["steps"], resume_status=s["status"],
                   traceback=out["traceback"] or "Traceback" in rr.stderr)
    return out


def _message(lines: list) -> str:
    if not lines:
        return "-"
    text = lines[0].split(": error: ", 1)[-1]
    return text.split("; the last finite state")[0].replace("|", "/")


def render(rows: list[dict]) -> str:
    """The markdown table."""
    out = ["| case | policy | exit | status | steps | skipped | error line (up to the checkpoint path) | "
           "checkpoint (finite) | `--resume` | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ck = "-" if r.get("checkpoint_step") is None else f"step_{r['checkpoint_step']} ({r['checkpoint_finite']})"
        res = "-" if r.get("resume_code") is None else f"exit {r['resume_code']}, {r['resume_steps']} steps"
        if r.get("resume_status"):
            res += f", {r['resume_status']}"
        verdict = "ok" if not r.get("problems") else "; ".join(r["problems"])
        out.append(f"| {r['case']} | {r['policy']} | {r['code']} | {r['status']} | {r.get('steps', '-')} | "
                   f"{r.get('skipped', 0):g} | {_message(r['error_lines'])} | {ck} | {res} | {verdict} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "nonfinite_faults"),
                    help="folder for table.md and results.json")
    ap.add_argument("--no-async", action="store_true", help="leave out the async worker cases")
    args = ap.parse_args()

    from tests.faults.harness import CASES, POLICIES, problems, run_case

    load0 = os.getloadavg()[0]
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if args.no_async and case.endswith("/async"):
                continue
            for policy in POLICIES:
                o = run_case(case, policy, Path(tmp) / f"{case.replace('/', '_')}_{policy}")
                row = {**o.as_dict(), "problems": problems(o)}
                rows.append(row)
                print(f"{case:18s} {policy:4s} exit={o.code} {o.status:9s} "
                      f"{'ok' if not row['problems'] else row['problems']}", flush=True)
        for policy in POLICIES:
            r = real_divergence(policy, Path(tmp) / f"real_{policy}")
            r["problems"] = ["ended in a traceback"] if r["traceback"] else []
            rows.append(r)
            print(f"real lr=1e15       {policy:4s} exit={r['code']} {r['status']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python experiments/nonfinite_faults.py", "wall_s": round(time.time() - t0, 1),
            "load_before": load0, "load_after": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                      time.gmtime())}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "table.md").write_text(f"<!-- {json.dumps(meta)} -->\n" + render(rows))
    print(f"wrote {out / 'table.md'} ({meta['wall_s']} s, load {load0:.1f} -> {meta['load_after']:.1f})")


if __name__ == "__main__":
    main()
