"""Is a refactor pure?  ``python experiments/refactor_check/compare.py OLD_TREE NEW_TREE [CASE ...]``

Runs each tiny case of ``runner.py`` (every case when none is named: NaN at every stage under skip and stop,
resume, TIS/MIS/OPSM, KL, proximal, PR2, dynamic sampling, async, Ray, ...) in fresh processes, once with the
package of OLD_TREE first on the path and once with NEW_TREE's (two checkouts, e.g. ``git worktree add``), and
compares every metric row (timings left out), the run summary, every checkpoint (model, optimizer, modules,
state) and the final weights with ``torch.equal``.  Prints IDENTICAL or what differs per case; exit 1 if any
differs.  ``--cache DIR`` keeps OLD_TREE's results there and reuses them.  ``--removed-key NAME`` (repeatable)
leaves out a key that the change removed from the checkpointed state on purpose (the verdict names it).  The Ray
case needs Ray.
"""
import json, os, subprocess, sys, tempfile
from pathlib import Path
import torch

import argparse

parser = argparse.ArgumentParser(description="run runner.py's tiny cases in two trees and compare them bit for bit")
parser.add_argument("old", help="the tree before the change (a checkout)")
parser.add_argument("new", help="the tree after the change")
parser.add_argument("cases", nargs="*", help="case names (default: every case of runner.py)")
parser.add_argument("--cache", type=Path, default=None, help="keep (and reuse) the old tree's results here")
parser.add_argument("--removed-key", action="append", default=[],
                    help="a key the change removed from checkpointed state on purpose: left out of the old side")
parser.add_argument("--added-key-prefix", action="append", default=[],
                    help="metric keys the change added on purpose (a prefix): left out of the new side; the old "
                         "side must not hold them")
opts = parser.parse_args()
cache_dir, old, new = opts.cache, opts.old, opts.new
py = sys.executable
RUNNER = str(Path(__file__).resolve().parent / "runner.py")
def run(tree, case, out):
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    r = subprocess.run([py, RUNNER, case, str(out)], env=env, cwd=tree, capture_output=True, text=True)
    if r.returncode: print(r.stdout[-2000:], r.stderr[-3000:])
    return r.returncode

def without(x, keys):
    """``x`` with every dict entry named in ``keys`` left out, at any depth."""
    if isinstance(x, dict):
        return {k: without(v, keys) for k, v in x.items() if k not in keys}
    if isinstance(x, (list, tuple)):
        return type(x)(without(v, keys) for v in x)
    return x

def without_prefix(x, prefixes):
    """``x`` with every dict entry whose key starts with one of ``prefixes`` left out, at any depth."""
    if isinstance(x, dict):
        return {k: without_prefix(v, prefixes) for k, v in x.items()
                if not (isinstance(k, str) and k.startswith(tuple(prefixes)))}
    if isinstance(x, (list, tuple)):
        return type(x)(without_prefix(v, prefixes) for v in x)
    return x

def eq(a, b, path=""):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) or [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b): return [path + f" keys {set(a) ^ set(b) if isinstance(b, dict) else type(b)}"]
        bad = []
        for k in a:
            r = eq(a[k], b[k], f"{path}/{k}")
            if r is not True: bad += r
        return bad or True
    if isinstance(a, (list, tuple)):
        if len(a) != len(b): return [path + " len"]
        bad = []
        for i, (x, y) in enumerate(zip(a, b)):
            r = eq(x, y, f"{path}[{i}]")
            if r is not True: bad += r
        return bad or True
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b: return True
    return True if a == b else [f"{path}: {a!r} != {b!r}"]

cases = opts.cases or subprocess.run([py, RUNNER, "--list", "x"], env=dict(os.environ, PYTHONPATH=new), cwd=new, capture_output=True, text=True).stdout.split()
work = Path(tempfile.mkdtemp(prefix="cmp36_"))
fails = 0
for c in cases:
    safe = c.replace(":", "_").replace("/", "_")
    cached = cache_dir / safe if cache_dir else None
    if cached is not None and not (cached / "w.pt").exists():
        run(old, c, cached)
    if cached is not None and (cached / "w.pt").exists():          # the old tree never changes: its results are reused
        (work / "old").mkdir(parents=True, exist_ok=True)
        if not (work / "old" / safe).exists():
            (work / "old" / safe).symlink_to(cached)
        ra = 0
    else:
        ra = run(old, c, work / "old" / safe)
    rb = run(new, c, work / "new" / safe)
    if ra or rb:
        print(f"{c}: RUNNER FAILED old={ra} new={rb}"); fails += 1; continue
    ma, mb = [json.loads((work / t / safe / "metrics.json").read_text()) for t in ("old", "new")]
    wa, wb = [torch.load(work / t / safe / "w.pt", weights_only=False) for t in ("old", "new")]
    removed = set(opts.removed_key)
    if removed:          # only the old side may hold them: the new side must not
        wa = without(wa, removed)
    added = tuple(opts.added_key_prefix)
    if added:            # only the new side may hold them: the old side must not
        mb, wb = without_prefix(mb, added), without_prefix(wb, added)
    r1, r2 = eq(ma, mb), eq(wa, wb)
    ok = r1 is True and r2 is True
    fails += not ok
    n_ck = len(wa["ckpts"]); status = ma["summary"]["status"]
    note = (f", old side without {sorted(removed)}" if removed else "") + (
        f", new side without keys {list(added)}*" if added else "")
    print(f"{c}: {'IDENTICAL' if ok else 'DIFFERENT'} (rows {len(ma['rows'])}, checkpoints {n_ck}, status {status}{note})"
          + ("" if ok else f" {(r1 if r1 is not True else [])[:5]} {(r2 if r2 is not True else [])[:5]}"), flush=True)
print(f"{len(cases) - fails}/{len(cases)} identical; work dir {work}")
sys.exit(1 if fails else 0)
