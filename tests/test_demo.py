"""`offpolicy-moe demo` end to end at toy size (the real demo's learning is in the slow test / docs/benchmarks.md figures)."""
from __future__ import annotations

import argparse
import json

from offpolicy_moe.cli import main
from offpolicy_moe.commands import demo

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.num_experts=4", "task.eval_size=16",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=3",
        "trainer.sft_warmup_steps=2", "trainer.sft_batch_size=8", "trainer.min_free_mb=1", "trainer.threads=1"]


def test_demo_runs_and_prints_before_after_and_r3_figures(tmp_path, capsys):
    run_dir = tmp_path / "demo"
    rc = main(["demo", "--steps", "3", "--run-dir", str(run_dir), "--quiet", *TINY])
    out = capsys.readouterr().out
    assert rc == 0
    assert "before RL" in out and "after RL" in out
    assert "without R3" in out and "with R3" in out and "routing mismatch" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    cfg = (run_dir / "config.yaml").read_text()
    assert "staleness: 2" in cfg and "replay: r3" in cfg and "mode: truncate" in cfg and "dtype: bfloat16" in cfg
    s = demo.summarize(run_dir)
    assert s["kl_no_r3"] is not None and s["kl_r3"] is not None
    assert s["accuracy_before"] is not None and s["accuracy_after"] is not None


def test_demo_defaults_are_the_documented_recipe():
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    args = p.parse_args([])
    assert args.steps > 0
    joined = " ".join(demo.DEMO_OVERRIDES)
    for needle in ("tis", "r3", "buffer.staleness=2", "rollout.dtype=bfloat16", "trainer.sft_warmup_steps="):
        assert needle in joined
