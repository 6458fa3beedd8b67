"""A stand-in for `offpolicy-moe train` used by the sweep tests: `fake_train.py CONFIG run_dir=DIR`.

Writes metrics.jsonl (reward = 0.1 * seed + 0.01 * step + 0.001 * staleness), summary.json, env.json.
Exits 3 without a summary when the config has algo.loss.name == "unclipped" and seed == 1 (a failing run).
Appends one line per invocation to $FAKE_TRAIN_LOG.
"""
import json
import os
import sys
from pathlib import Path

import yaml

cfg_path, run_arg = sys.argv[1], sys.argv[2]
assert run_arg.startswith("run_dir=")
run_dir = Path(run_arg[len("run_dir="):])
cfg = yaml.safe_load(Path(cfg_path).read_text())
if os.environ.get("FAKE_TRAIN_LOG"):
    with open(os.environ["FAKE_TRAIN_LOG"], "a") as f:
        f.write(run_dir.name + "\n")
seed, k = cfg["seed"], cfg["buffer"]["staleness"]
if cfg["algo"]["loss"]["name"] == "unclipped" and seed == 1:
    print("boom: loss exploded at step 3", file=sys.stderr)
    sys.exit(3)
run_dir.mkdir(parents=True, exist_ok=True)
with open(run_dir / "metrics.jsonl", "w") as f:
    for step in range(1, cfg["trainer"]["steps"] + 1):
        f.write(json.dumps({"step": step, "reward/mean": 0.1 * seed + 0.01 * step + 0.001 * k}) + "\n")
(run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": cfg["trainer"]["steps"]}))
(run_dir / "env.json").write_text(json.dumps({"python": sys.version}))
print("done")
