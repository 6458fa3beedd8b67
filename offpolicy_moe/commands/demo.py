"""``offpolicy-moe demo``: the embedded CPU demo of the main job.

SFT warm start of the tiny Qwen3-MoE on the arithmetic task, then GRPO on stale rollouts (exact delay k=2) from a
bf16 rollout engine, with TIS correction and R3 routing replay.  Prints greedy accuracy before and after RL, and the
train/inference k3 KL and routing mismatch measured on the SAME rollout batches with and without R3 (the trainer
recomputes old log-probs both ways; the run itself uses the R3 ones).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from offpolicy_moe.commands.errors import RunFailed, warn
from offpolicy_moe.commands.train import build_config

#: the demo's settings on top of the schema defaults and the presets (key=value, overridable on the command line)
DEMO_OVERRIDES = [
    "preset=[grpo,tis,r3]",
    "buffer.staleness=2",
    "rollout.dtype=bfloat16",
    "rollout.prompts_per_step=16",
    "rollout.group_size=8",
    "rollout.max_new_tokens=3",          # answers of the default task are <= 2 characters, + eos
    "task.num_terms=3",                  # 1-digit, 3-term sums: 1,000 problems, a real held-out split
    "trainer.sft_warmup_steps=60",       # partially solved start (held-out greedy accuracy ~0.15-0.35)
    "trainer.eval_every=50",
    "trainer.log_every=50",
    "trainer.checkpoint_every=0",
    "optim.lr=3e-4",
    "trainer.threads=1",                 # the tiny model is dispatch-bound: 1 thread is ~4x faster than 2 on 2 cores
]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--steps 0`` or ``-5`` is refused on one line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=positive_int, default=250, help="RL steps (trained steps, >= 1; default 250)")
    p.add_argument("--run-dir", default=None, help="run folder (default runs/demo-<time>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", default=[], help="extra key=value overrides")


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(run_dir: str | Path) -> dict:
    """Before/after accuracy and mean mismatch figures of a finished run folder (reads metrics.jsonl only)."""
    rows = [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl")]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    trained = [r for r in rows if r["step"] > 0]
    return {
        "accuracy_before": evals[0]["eval/accuracy"] if evals else None,
        "accuracy_after": evals[-1]["eval/accuracy"] if evals else None,
        "train_accuracy_before": evals[0].get("eval/train_accuracy") if evals else None,
        "train_accuracy_after": evals[-1].get("eval/train_accuracy") if evals else None,
        "kl_no_r3": _mean(trained, "mismatch/k3_kl_no_r3"),
        "kl_r3": _mean(trained, "mismatch/k3_kl_r3"),
        "extreme_frac_no_r3": _mean(trained, "mismatch/extreme_frac_no_r3"),
        "extreme_frac_r3": _mean(trained, "mismatch/extreme_frac_r3"),
        "routing_decision_mismatch": _mean(trained, "routing/decision_mismatch"),
        "routing_token_mismatch": _mean(trained, "routing/token_mismatch"),
        "reward_first": _mean(trained[:10], "reward/mean"),
        "reward_last": _mean(trained[-10:], "reward/mean"),
        "gen_tokens_per_s": _mean(trained, "perf/gen_tokens_per_s"),
        "update_tokens_per_s": _mean(trained, "perf/update_tokens_per_s"),
    }


def run(args: argparse.Namespace) -> int:
    # the engine loads torch: imported when the demo runs, so `offpolicy-moe --help` stays fast
    from offpolicy_moe.trainer.launch import train

    run_dir = args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = DEMO_OVERRIDES + [f"trainer.steps={args.steps}", f"seed={args.seed}"]
    if args.quiet:
        overrides.append("logging.progress=false")
    cfg = build_config(None, overrides + list(args.overrides), run_dir)
    from offpolicy_moe.trainer.checks import check_config

    checked = check_config(cfg)    # a config mistake stops here: one line, exit code 2, no folder written
    for w in checked.warnings:
        warn(w)
    print(f"offpolicy-moe demo: tiny {cfg.model.num_experts}-expert top-{cfg.model.top_k} Qwen3-MoE, "
          f"{cfg.task.num_terms}-term arithmetic; SFT {cfg.trainer.sft_warmup_steps} steps, then "
          f"{cfg.trainer.steps} RL steps of {'+'.join(cfg.preset)} with staleness k={cfg.buffer.staleness} "
          f"and a {cfg.rollout.dtype} engine -> {run_dir}", flush=True)
    t0 = time.perf_counter()
    summary = train(cfg, checked=checked)
    wall = time.perf_counter() - t0
    if summary["status"] != "completed":
        raise RunFailed(f"demo run {summary['status']}: {summary.get('error', '')}")
    s = summarize(run_dir)

    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    print()
    print(f"accuracy (greedy, held-out): before RL {f(s['accuracy_before'], '.3f')} -> after RL "
          f"{f(s['accuracy_after'], '.3f')}")
    print(f"accuracy (greedy, training prompts): before RL {f(s['train_accuracy_before'], '.3f')} -> after RL "
          f"{f(s['train_accuracy_after'], '.3f')}")
    print(f"sampled reward (mean of 10 steps): first {f(s['reward_first'], '.3f')} -> last {f(s['reward_last'], '.3f')}")
    print("train/inference mismatch on the same rollout batches (bf16 engine vs fp32 trainer, mean over steps):")
    print(f"  k3 KL          without R3 {f(s['kl_no_r3'], '.3e')}   with R3 {f(s['kl_r3'], '.3e')}")
    print(f"  extreme tokens without R3 {f(s['extreme_frac_no_r3'], '.2e')}   with R3 {f(s['extreme_frac_r3'], '.2e')}")
    print(f"  routing mismatch (engine vs trainer's own top-k): decisions {f(s['routing_decision_mismatch'], '.2%')}, "
          f"tokens with >=1 flipped layer {f(s['routing_token_mismatch'], '.2%')}; with R3 replay: 0 by construction")
    print(f"throughput: generation {f(s['gen_tokens_per_s'], '.0f')} tok/s, update "
          f"{f(s['update_tokens_per_s'], '.0f')} tok/s; wall time {wall:.0f}s")
    return 0
