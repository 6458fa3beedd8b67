"""End-to-end: a real tiny sweep (2 configs x 2 seeds x 2 steps) with the real trainer -> table and plot."""
import struct

from offpolicy_moe.cli import main

EXP = """
name: e2e
seeds: [0, 1]
base:
  trainer: {steps: 2, sft_warmup_steps: 0, eval_every: 2, log_every: 1}
  rollout: {prompts_per_step: 2, group_size: 4, max_new_tokens: 3}
  task: {eval_size: 4}
  logging: {progress: false}
grid:
  algorithm:
    grpo: {preset: [grpo]}
    gspo+r3: {preset: [gspo, r3]}
"""


def test_tiny_real_sweep_table_plot(tmp_path, capsys):
    exp = tmp_path / "e2e.yaml"
    exp.write_text(EXP)
    out = tmp_path / "sw"
    assert main(["sweep", str(exp), "--out", str(out), "--jobs", "2", "--no-progress"]) == 0
    for run in ("algorithm=grpo__seed=0", "algorithm=gspo+r3__seed=1"):
        for f in ("config.yaml", "metrics.jsonl", "summary.json", "env.json", "run.json"):
            assert (out / run / f).is_file(), (run, f)
    capsys.readouterr()
    assert main(["table", str(out), "--rows", "algorithm", "--metric", "reward/mean", "--format", "md"]) == 0
    text = capsys.readouterr().out
    assert text.count(" (2)") == 2 and " ± " in text and "| grpo |" in text and "| gspo+r3 |" in text
    assert main(["plot", str(out), "--metrics", "reward/mean", "--by", "algorithm", "--out", str(tmp_path / "p")]) == 0
    png = (tmp_path / "p" / "reward_mean.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 200 and len(png) > 5000
    # resume: everything completed -> nothing re-runs
    assert main(["sweep", str(exp), "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "all 4 runs already completed" in capsys.readouterr().out
