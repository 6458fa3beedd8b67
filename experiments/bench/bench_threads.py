"""Wall time of the README's ``train`` example (20 steps) at ``trainer.threads`` = 1, 2 and 0 (auto), on an idle
machine and with one other busy process, interleaved in one run.  Used to choose the ``threads`` default.

    python experiments/bench/bench_threads.py --repeats 2

Each figure is the whole command (start-up, SFT warm start, 20 RL steps), as a user sees it; the load average is
recorded before each one.  ``OMP_NUM_THREADS`` is removed from the runs' environment so that the torch default is
what a user without it gets.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

COMMAND = [sys.executable, "-m", "offpolicy_moe", "train", "preset=[m2po,tis,r3]", "buffer.staleness=8",
           "trainer.steps=20", "logging.progress=false"]


def one_run(threads: str, workdir: str) -> float:
    """Seconds for one run of :data:`COMMAND` at ``trainer.threads=threads`` (a fresh run folder)."""
    run_dir = os.path.join(workdir, f"run-{threads}-{time.time_ns()}")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    t0 = time.perf_counter()
    proc = subprocess.run(COMMAND + [f"trainer.threads={threads}", f"run_dir={run_dir}"], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed: {proc.stderr[-1000:]}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", default="1,2,0", help="trainer.threads values to compare (0 = auto)")
    args = ap.parse_args()
    settings = args.settings.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for rep in range(args.repeats):
            for busy in (False, True):
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
                try:
                    if hog is not None:
                        time.sleep(2.0)
                    for t in settings:
                        load = os.getloadavg()
                        wall = one_run(t, work)
                        row = dict(rep=rep, busy=busy, threads=t, wall_s=round(wall, 2),
                                   loadavg=[round(x, 2) for x in load])
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
    for busy in (False, True):
        for t in settings:
            walls = [r["wall_s"] for r in rows if r["busy"] == busy and r["threads"] == t]
            print(f"{'busy' if busy else 'idle'} threads={t}: median {sorted(walls)[len(walls) // 2]:.1f}s {walls}")


if __name__ == "__main__":
    main()
