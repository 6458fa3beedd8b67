"""The ``trainer.max_nan_skips``-th skip in a row happening at the optimizer stage: the run stops as diverged with
its last finite state.  Before the step became a transaction the non-finite optimizer update stayed applied, and
the "last finite state" checkpoint held NaN parameters."""
from __future__ import annotations

import json

import torch

from offpolicy_moe.run import fault_injection
from offpolicy_moe.run.checkpoint import load_checkpoint
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import tiny_config


def test_the_last_skip_at_the_optimizer_stage_leaves_finite_weights_in_the_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path / "run", "trainer.steps=4", "trainer.on_nan=skip", "trainer.max_nan_skips=1",
                      "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0", "trainer.threads=1")
    fault_injection.disarm()
    fault_injection.arm("optimizer", 2)
    try:
        tr = Trainer(cfg)
        try:
            tr.run()
        except Exception:          # a diverged run may end with an error; what matters is what it left on disk
            pass
    finally:
        fault_injection.disarm()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "diverged"
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert ckpts, "a diverged run keeps its last finite state"
    last = load_checkpoint(ckpts[-1])
    bad = [k for k, v in last.model.items() if torch.is_floating_point(v) and not torch.isfinite(v).all()]
    assert bad == [], f"non-finite parameters in the last checkpoint: {bad[:3]}"
    after_step_1 = load_checkpoint(tmp_path / "run" / "checkpoints" / "step_1")
    assert all(torch.equal(after_step_1.model[k], last.model[k]) for k in last.model)   # step 2 was undone
