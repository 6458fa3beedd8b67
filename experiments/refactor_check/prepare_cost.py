"""The trainer's own cost of a two-version batch, in one process: ``python experiments/refactor_check/prepare_cost.py
TREE [--calls N]`` with TREE's package first on the path (run it once per tree: a checkout before the change, one
after).

Builds the tiny asynchronous job's trainer, samples one batch whose first two tokens come from version 0 and the
rest from version 1 (weights updated in flight), and times N calls of the preparation (old log-probs under each
token's version: ``PreparationStage.prepare`` now, ``prepare_at_versions`` before the stage existed) and of the
update on the prepared batch (weights put back after each), one thread; prints the medians (the first 3 calls left
out).  Unlike ``ab.py`` it leaves the rollout worker's share of the CPU out of the figure."""
import argparse
import copy
import statistics
import sys
import time

parser = argparse.ArgumentParser(description="per-call preparation and update cost of a two-version batch")
parser.add_argument("tree", help="a checkout whose package is measured")
parser.add_argument("--calls", type=int, default=25, help="timed calls of each (default 25)")
opts = parser.parse_args()
sys.path.insert(0, opts.tree)

import torch  # noqa: E402

from offpolicy_moe.rollout.seeds import iteration_seed  # noqa: E402
from offpolicy_moe.rollout.worker import build_engine, generate_iteration  # noqa: E402
from offpolicy_moe.trainer.trainer import Trainer  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

torch.set_num_threads(1)
cfg = tiny_config(f"/tmp/prepare_cost_{abs(hash(opts.tree))}", "rollout.max_new_tokens=4", "rollout.dtype=float32",
                  "algo.correction.mode=truncate", "buffer.mode=async", "buffer.staleness=1", "rollout.workers=1")
tr = Trainer(cfg)
v0 = {k: v.clone() for k, v in tr.unwrapped.state_dict().items()}
g = torch.Generator().manual_seed(1)
v1 = {k: (v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()) for k, v in v0.items()}
engine = build_engine(cfg, copy.deepcopy(tr.unwrapped), tr.tok)
engine.sync(v0, 0)
calls = {"n": 0}


def switch(e):
    calls["n"] += 1
    if calls["n"] == 2:
        e.sync(v1, 1)


engine.between_tokens = switch
batch = generate_iteration(engine, tr.task, cfg.rollout, iteration=0, seed=iteration_seed(cfg.seed, 0))
tr.unwrapped.load_state_dict(v1)
if hasattr(tr, "stage"):
    tr.stage.keep(0, v0)
    tr.stage.keep(1, v1)

    def prepare():
        return tr.stage.prepare(batch, current=1).batch
else:       # before the preparation stage: the per-version pass loaded past weights into the live model
    from offpolicy_moe.sources.versions import VersionRing, prepare_at_versions
    ring = VersionRing(2)
    ring.add(0, v0)
    ring.add(1, v1)

    def prepare():
        b = copy.copy(batch)
        b.old_logp, b.extras = None, {}
        prepare_at_versions(b, ring, current=1, model=tr.unwrapped, prepare=tr.prepare)
        return b

t_prep, t_update = [], []
for _ in range(opts.calls):
    t0 = time.perf_counter()
    b = prepare()
    t_prep.append(time.perf_counter() - t0)
    b.answers = [c if j % 2 == 0 else a for j, (a, c) in enumerate(zip(b.answers, b.completions))]
    state = {k: v.clone() for k, v in tr.unwrapped.state_dict().items()}
    t0 = time.perf_counter()
    tr.update(b)
    t_update.append(time.perf_counter() - t0)
    tr.unwrapped.load_state_dict(state)
print(f"{opts.tree}: prepare {statistics.median(t_prep[3:]) * 1000:.1f} ms, "
      f"update {statistics.median(t_update[3:]) * 1000:.1f} ms (median of {opts.calls - 3} calls)")
