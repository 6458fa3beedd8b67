"""Speed of a refactor: ``python experiments/refactor_check/ab.py OLD_TREE NEW_TREE PAIRS``.

Interleaved A/B (old, new, new, old, ...) of a tiny CLI job (16 steps, one step stale, TIS, two micro-batches;
``key=value`` arguments after PAIRS change it, e.g. ``buffer.mode=async rollout.workers=1``) in fresh processes: each run's median ``perf/time_step_s`` (the first step left out) and the CPU seconds of its
process; then the median over runs of each tree and new/old.  Prints ``uptime`` before and after."""
import argparse
import json, os, resource, statistics, subprocess, sys, tempfile
from pathlib import Path

parser = argparse.ArgumentParser(description="interleaved speed A/B of a tiny training job in two trees")
parser.add_argument("old", help="the tree before the change (a checkout)")
parser.add_argument("new", help="the tree after the change")
parser.add_argument("pairs", type=int, help="old/new pairs (runs = 2 x pairs)")
parser.add_argument("overrides", nargs="*", help="key=value settings over the job's (e.g. buffer.mode=async)")
opts = parser.parse_args()
old, new, pairs = opts.old, opts.new, opts.pairs
sys.path.insert(0, new)
from tests.tiny import TINY
args = [*TINY, "trainer.steps=16", "trainer.threads=1", "trainer.checkpoint_every=0", "buffer.staleness=1",
        "algo.correction.mode=truncate", "trainer.grad_accum=2", *opts.overrides]
work = Path(tempfile.mkdtemp(prefix="refactor_ab_"))
res = {"old": [], "new": []}
cpu = {"old": [], "new": []}
order = []
for i in range(pairs):
    order += ["old", "new"] if i % 2 == 0 else ["new", "old"]
print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
for n, arm in enumerate(order):
    tree = old if arm == "old" else new
    rd = work / f"{n}_{arm}"
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "offpolicy_moe", "train", "--quiet", "--run-dir", str(rd), *args],
                   env=env, cwd=tree, check=True, capture_output=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu[arm].append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
    rows = [json.loads(x) for x in open(rd / "metrics.jsonl")]
    steps = [r["perf/time_step_s"] for r in rows if "perf/time_step_s" in r][1:]     # the first step warms up
    res[arm].append(statistics.median(steps))
    print(f"{n:2d} {arm}: median step {res[arm][-1] * 1000:.1f} ms, process CPU {cpu[arm][-1]:.2f} s", flush=True)
print("uptime after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
mo, mn = statistics.median(res["old"]), statistics.median(res["new"])
print(f"old median of run medians {mo * 1000:.1f} ms, new {mn * 1000:.1f} ms, new/old {mn / mo:.3f}")
co, cn = statistics.median(cpu["old"]), statistics.median(cpu["new"])
print(f"old median process CPU {co:.2f} s, new {cn:.2f} s, new/old {cn / co:.3f}")
