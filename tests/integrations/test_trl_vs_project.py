"""R3 under TRL does what it does in the project's own trainer: with the same tiny MoE shape and the same fixed
generation-router perturbation, replaying the generation's routes lowers the k3 KL between the trainer's log-probs
and the generation-time ones, in both trainers (the project's through its CLI, in a subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from offpolicy_moe.models.presets import build_preset
from offpolicy_moe.tasks.tokenizer import build_char_tokenizer
from trl_fixtures import trainer

SHAPE = dict(num_layers=1, hidden_size=32, num_experts=4)
SIGMA = 2.0


@pytest.mark.slow
def test_r3_lowers_the_mismatch_in_trl_as_in_the_project_trainer(tmp_path):
    run_dir = tmp_path / "project"
    argv = [sys.executable, "-m", "offpolicy_moe", "train", "--run-dir", str(run_dir), "--quiet",
            f"model.num_layers={SHAPE['num_layers']}", f"model.hidden_size={SHAPE['hidden_size']}",
            f"model.num_experts={SHAPE['num_experts']}", "task.eval_size=16", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "rollout.max_new_tokens=3", "trainer.eval_every=0", "trainer.sft_warmup_steps=0",
            "trainer.min_free_mb=1", "trainer.steps=1", "algo.routing.replay=r3", f"rollout.router_perturb={SIGMA}"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ours = next(r for r in rows if "mismatch/k3_kl_r3" in r)

    tok = build_char_tokenizer()
    model = build_preset("tiny-qwen3-moe", len(tok), seed=0, special_ids=dict(
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id), **SHAPE)
    tr = trainer(tmp_path, model=model, per_device_train_batch_size=16, num_generations=4, max_completion_length=3,
                 routing_replay="r3", router_perturb=SIGMA)
    tr.train()
    theirs = tr.state.log_history[0]
    print("project", ours["mismatch/k3_kl_r3"], ours["mismatch/k3_kl_no_r3"],
          "trl", theirs["mismatch/k3_kl_r3"], theirs["mismatch/k3_kl_no_r3"])
    assert ours["mismatch/k3_kl_r3"] < ours["mismatch/k3_kl_no_r3"]
    assert theirs["mismatch/k3_kl_r3"] < theirs["mismatch/k3_kl_no_r3"]
