"""Fault injection: SIGKILL ``offpolicy-moe train`` at random instants, resume, and check that nothing was lost.

Each trial trains one short tiny run (one thread, SFT warm start, staleness 1, R3 replay, a checkpoint every step)
in a fresh folder.  The run is started, killed with SIGKILL at a random point, resumed with ``--resume`` and
killed again, up to ``--kills-per-trial`` times, then resumed to the end.  A random point: with ``c`` steps
checkpointed (``c = 0`` for a fresh start; ``metrics.jsonl`` then holds ``b = c + 1`` lines once the resumed run
has cut it back, ``b = 0`` fresh), ``j`` is drawn uniformly from ``0..S - c``; ``j = 0`` kills after a uniform
delay of up to the reference's time to its first line (start-up, SFT, step 0), otherwise the killer waits until the
run has written the file (a change of its size) and it holds ``b + j`` lines, then a uniform delay of up to one step
(the reference run's mean ``perf/time_step_s``).  So kills fall into every phase of a step (generation, update, logging, checkpoint
write, rename, pruning) rather than mostly into the interpreter's start-up.  The finished run is compared with an
uninterrupted reference run of the same config:

* bit-identical: every tensor of the final weights ``torch.equal`` to the reference's;
* batches: ``metrics.jsonl`` must hold each step ``0..S`` exactly once (a missing step = a lost batch, a repeated one
  = a duplicated batch), every trained step must have consumed the batch generated at the same iteration as in the
  reference (``offpolicy/generated_at``), and every other logged value must equal the reference's.

Usage::

    python experiments/fault_injection.py --budget-s 600 [--steps 5] [--kills-per-trial 3] [--seed 0]

Prints one line per trial and a JSON summary (with the load average before and after: the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from offpolicy_moe.config.load import load_config, to_yaml
from offpolicy_moe.run.checkpoint import latest_checkpoint, load_checkpoint

REPO = Path(__file__).resolve().parents[1]

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "model.top_k=2", "task.eval_size=16",
        "task.reward=partial", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3",
        "rollout.batch_size=64", "trainer.eval_every=2", "trainer.log_every=100", "logging.progress=false",
        "logging.loggers=[jsonl]", "trainer.min_free_mb=1", "optim.lr=1e-2", "trainer.threads=1",
        "trainer.sft_warmup_steps=2", "trainer.sft_batch_size=8", "buffer.staleness=1", "trainer.checkpoint_every=1",
        "trainer.keep_checkpoints=2", "algo.routing.replay=r3", "rollout.dtype=bfloat16",
        "algo.correction.mode=truncate"]


def write_config(run_dir: Path, steps: int, path: Path) -> Path:
    cfg = load_config(None, TINY + [f"trainer.steps={steps}"])
    cfg.run_dir = str(run_dir)
    path.write_text(to_yaml(cfg))
    return path


def command(cfg_path: Path, run_dir: Path, resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "offpolicy_moe", "train", str(cfg_path), "--run-dir", str(run_dir)]
    return cmd + ["--resume"] if resume else cmd


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", WANDB_SILENT="true", HF_HUB_OFFLINE="1",
                PYTHONPATH=str(REPO))


def metric_rows(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.exists() else []


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ck = latest_checkpoint(run_dir / "checkpoints")
    if ck is None:
        raise RuntimeError(f"no checkpoint in {run_dir}")
    return load_checkpoint(ck).model


def folder_state(run_dir: Path) -> str:
    """What the run folder held at the kill: the newest checkpoint and the number of metrics lines."""
    ck = latest_checkpoint(run_dir / "checkpoints")
    return f"{ck.name if ck else 'no-ckpt'}/{len(metric_rows(run_dir))}lines"


def _line_count(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def _size(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").stat().st_size
    except OSError:
        return -1


def wait_for_kill_point(proc: subprocess.Popen, run_dir: Path, lines: int, delay_s: float) -> bool:
    """Wait (when ``lines`` > 0) until this process has changed ``metrics.jsonl`` and it has ``lines`` lines, then
    ``delay_s``; False when the process ended first."""
    initial, changed = _size(run_dir), False
    while lines > 0 and not (changed and _line_count(run_dir) >= lines):
        if proc.poll() is not None:
            return False
        changed = changed or _size(run_dir) != initial
        time.sleep(0.005)
    try:
        proc.wait(timeout=delay_s)
        return False
    except subprocess.TimeoutExpired:
        return True


def next_start(run_dir: Path, steps: int) -> str:
    """How the run continues after a kill, as a user would (``train --resume`` refuses a folder without a
    checkpoint, and one whose checkpoint is already the last step): ``resume``, ``fresh`` (the folder is removed:
    killed before its first checkpoint) or ``done`` (killed after the final checkpoint)."""
    ck = latest_checkpoint(run_dir / "checkpoints")
    if ck is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return "fresh"
    return "done" if ck.name == f"step_{steps}" else "resume"


def run_trial(cfg_path: Path, run_dir: Path, steps: int, first_s: float, step_s: float, kills: int,
              rng: random.Random) -> dict:
    """Kill up to ``kills`` times at random points (module docstring), then resume to the end."""
    killed, windows, how = 0, [], "fresh"
    while True:
        if how == "done":
            return {"kills": killed, "windows": windows, "rc": 0, "stderr": ""}
        proc = subprocess.Popen(command(cfg_path, run_dir, resume=how == "resume"), env=env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if killed < kills:
            ck = latest_checkpoint(run_dir / "checkpoints") if how == "resume" else None
            done = int(ck.name.split("_")[1]) if ck is not None else 0
            base = done + 1 if ck is not None else 0
            j = rng.randint(0, steps - done)
            delay = rng.uniform(0.0, first_s if j == 0 else step_s)
            if wait_for_kill_point(proc, run_dir, base + j if j else 0, delay):
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed += 1
                windows.append(folder_state(run_dir))
                how = next_start(run_dir, steps)
                continue
        err = proc.communicate()[1].decode()
        return {"kills": killed, "windows": windows, "rc": proc.returncode, "stderr": err[-400:]}


def check(run_dir: Path, ref_dir: Path, steps: int) -> dict:
    rows, ref_rows = metric_rows(run_dir), metric_rows(ref_dir)
    seen = [r["step"] for r in rows]
    lost = sorted(set(range(steps + 1)) - set(seen))
    duplicated = sorted({s for s in seen if seen.count(s) > 1})
    same_batches = [r.get("offpolicy/generated_at") for r in rows] == [r.get("offpolicy/generated_at")
                                                                        for r in ref_rows]
    ref_w, got_w = final_weights(ref_dir), final_weights(run_dir)
    identical = ref_w.keys() == got_w.keys() and all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)
    return {"bit_identical": identical, "lost_steps": lost, "duplicated_steps": duplicated,
            "same_batches": same_batches, "same_metrics": comparable(rows) == comparable(ref_rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=600.0, help="stop starting trials after this many seconds")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--kills-per-trial", type=int, default=3)
    p.add_argument("--max-trials", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="where the runs go (default: a temporary folder, removed)")
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fault_injection_"))
    work.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    ref_dir = work / "reference"
    shutil.rmtree(ref_dir, ignore_errors=True)
    cfg_ref = write_config(ref_dir, args.steps, work / "reference.yaml")
    proc = subprocess.Popen(command(cfg_ref, ref_dir, resume=False), env=env(), stdout=subprocess.DEVNULL)
    while _line_count(ref_dir) < 1 and proc.poll() is None:
        time.sleep(0.005)
    first_s = time.perf_counter() - t0           # start-up + SFT warm start + step 0
    if proc.wait() != 0:
        raise SystemExit("the reference run failed")
    ref_s = time.perf_counter() - t0
    step_s = sum(r["perf/time_step_s"] for r in metric_rows(ref_dir)[1:]) / args.steps   # in-loop time of a step
    print(f"reference: {args.steps} steps in {ref_s:.1f}s (first line after {first_s:.1f}s, {step_s:.2f}s/step; "
          f"load {load_before[0]:.1f})", flush=True)
    results = []
    while time.perf_counter() - t0 < args.budget_s and len(results) < args.max_trials:
        i = len(results)
        run_dir = work / f"trial_{i}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cfg = write_config(run_dir, args.steps, work / f"trial_{i}.yaml")
        res = run_trial(cfg, run_dir, args.steps, first_s, step_s, args.kills_per_trial, rng)
        if res["rc"] == 0:
            res.update(check(run_dir, ref_dir, args.steps))
        results.append(res)
        print(f"trial {i}: kills={res['kills']} at {res['windows']} rc={res['rc']} "
              f"bit_identical={res.get('bit_identical')} lost={res.get('lost_steps')} "
              f"duplicated={res.get('duplicated_steps')} same_metrics={res.get('same_metrics')}"
              + (f" stderr={res['stderr']!r}" if res["rc"] != 0 else ""), flush=True)
        if not args.workdir:
            shutil.rmtree(run_dir, ignore_errors=True)
    done = [r for r in results if r["rc"] == 0]
    summary = {
        "trials": len(results), "kills": sum(r["kills"] for r in results),
        "trials_with_kills": sum(r["kills"] > 0 for r in results),
        "finished_rc0": len(done),
        "bit_identical": sum(bool(r.get("bit_identical")) for r in done),
        "bit_identical_with_kills": sum(bool(r.get("bit_identical")) and r["kills"] > 0 for r in done),
        "same_metrics": sum(bool(r.get("same_metrics")) for r in done),
        "lost_batches": sum(len(r.get("lost_steps", [])) for r in done),
        "duplicated_batches": sum(len(r.get("duplicated_steps", [])) for r in done),
        "batch_order_differs": sum(not r.get("same_batches", True) for r in done),
        "kill_windows": sorted({w for r in results for w in r["windows"]}),
        "reference_s": ref_s, "reference_first_line_s": first_s, "reference_step_s": step_s, "wall_s": time.perf_counter() - t0,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "steps": args.steps, "kills_per_trial": args.kills_per_trial, "seed": args.seed,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "trials": results}, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    ok = summary["finished_rc0"] == summary["trials"] == summary["bit_identical"] and not summary["lost_batches"] \
        and not summary["duplicated_batches"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
