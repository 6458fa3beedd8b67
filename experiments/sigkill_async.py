"""SIGKILL soak of an asynchronous run (``buffer.mode=async``, docs/async.md): start the training command, SIGKILL
a process at a random moment — the trainer, a rollout worker or the fork server that starts workers — then
``--resume`` (with ``rollout.on_worker_death=stop`` a killed worker stops the run with a checkpoint), until the run
completes.  At the end every step must be logged once and every iteration trained once, in order
(``offpolicy/generated_at``), with no token lagging more than ``k``.  Prints the number of kills of each kind.

    python experiments/sigkill_async.py --kills 10 --steps 12 --seed 0
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from offpolicy_moe.config.load import load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]


def _children(proc: subprocess.Popen) -> tuple[list, list]:
    """(fork servers, workers) of the trainer process: the fork server is the trainer's child that runs
    ``multiprocessing.forkserver``; the workers are the fork server's children (forked, same command line)."""
    try:
        kids = psutil.Process(proc.pid).children()
        servers = [k for k in kids if "forkserver" in " ".join(k.cmdline())]
        workers = [w for srv in servers for w in srv.children()]
    except psutil.NoSuchProcess:
        return [], []
    return servers, workers


def _check(run_dir: Path, steps: int, k: int) -> None:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl") if line.strip()]
    if [r["step"] for r in rows] != list(range(steps + 1)):
        raise SystemExit(f"FAIL: logged steps {[r['step'] for r in rows]}")
    if [r["offpolicy/generated_at"] for r in rows[1:]] != [float(i) for i in range(steps)]:
        raise SystemExit(f"FAIL: trained iterations {[r['offpolicy/generated_at'] for r in rows[1:]]}")
    if any(r["offpolicy/staleness_max"] > k for r in rows[1:]):
        raise SystemExit("FAIL: a token lagged more than k")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=10, help="SIGKILLs to deliver (fewer if the run ends first)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="seed of the kill times and targets")
    p.add_argument("--max-delay", type=float, default=8.0, help="a kill comes U(0.5, max-delay) s after a start")
    args = p.parse_args()
    rng = random.Random(args.seed)
    run_dir = Path(tempfile.mkdtemp(prefix="sigkill_async_")) / "run"
    cfg = load_config(None, [f"run_dir={run_dir}", "buffer.mode=async", f"buffer.staleness={args.staleness}",
                             f"trainer.steps={args.steps}", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0",
                             "trainer.sft_warmup_steps=0", "trainer.eval_every=0", "trainer.threads=1",
                             "logging.progress=false", "rollout.update_in_flight=true", "rollout.on_worker_death=stop",
                             "algo.correction.mode=truncate", "algo.routing.replay=r3"])
    yaml_path = run_dir.parent / "cfg.yaml"
    yaml_path.write_text(to_yaml(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    base = [sys.executable, "-m", "offpolicy_moe", "train", str(yaml_path)]
    kills = {"trainer": 0, "worker": 0, "forkserver": 0}
    starts = 0
    while True:
        resume = ["--resume"] if run_dir.exists() else []     # a kill can come before the run folder exists
        proc = subprocess.Popen(base + resume, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        starts += 1
        if sum(kills.values()) < args.kills:
            kind = rng.choice(["trainer", "worker", "forkserver"])
            deadline = time.time() + rng.uniform(0.5, args.max_delay)
            while proc.poll() is None:           # the kill comes once the delay passed and the target exists
                servers, workers = _children(proc)
                target = {"trainer": [proc.pid], "worker": [w.pid for w in workers],
                          "forkserver": [f.pid for f in servers]}[kind]
                if time.time() >= deadline and target:
                    try:
                        os.kill(target[0], signal.SIGKILL)
                        kills[kind] += 1
                    except ProcessLookupError:
                        pass
                    break
                time.sleep(0.05)
        _, err = proc.communicate(timeout=900)
        summary = run_dir / "summary.json"
        status = json.loads(summary.read_text())["status"] if summary.exists() else "killed"
        if status == "completed":
            break
        if starts > 4 * args.kills + 10:
            raise SystemExit(f"FAIL: no completion after {starts} starts; last stderr: {err.decode()[-2000:]}")
        if summary.exists():
            summary.unlink()     # a run stopped by a worker death: resume it
    _check(run_dir, args.steps, args.staleness)
    print(f"OK: {sum(kills.values())} SIGKILLs ({kills}), {starts} starts, {args.steps} steps each logged once, "
          f"every iteration trained once in order, lag <= {args.staleness}; run folder {run_dir}")


if __name__ == "__main__":
    main()
