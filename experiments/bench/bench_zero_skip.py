"""Speed of ``trainer.skip_zero_advantage``: the update's time with and without the skip, at a chosen share of
zero-advantage groups (25 / 50 / 75 % by default), on the same batches.

The task's reward is replaced by a rule that gives a fixed share of each batch's groups one reward for every sample
(zero advantage) and the other groups alternating rewards, so the share is exact and the same for both arms.  Each
cell runs the two arms interleaved (off, on, off, on, ...) for ``--rounds`` rounds of ``--steps`` steps, in fresh
trainers, and reports the median of the update phase (``perf/time_update_s``) per arm, the ratio off / on, and
whether the final weights agree (max |difference|; bit for bit when the zero groups fill whole micro-batches,
``--group-micro-batches``).  Speed figures only: run it on a quiet machine and quote the load average it prints.

    python experiments/bench/bench_zero_skip.py --shares 0.25 0.5 0.75 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from offpolicy_moe.config.load import load_config
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.tasks import RewardScores
from offpolicy_moe.trainer.trainer import Trainer


def share_rewards(group: int, share: float):
    """A reward rule: the first ``round(share * groups)`` groups of a batch score 1 for every sample, the others
    alternate 0 / 1 (non-zero advantages)."""
    def reward(completions, answers):
        n_groups = len(completions) // group
        constant = round(share * n_groups)
        return [1.0 if i // group < constant else float(i % 2) for i in range(len(completions))]
    return reward


def run(args, share: float, skip: bool, seed: int) -> tuple[list[float], dict]:
    """One fresh run; the update seconds of each step after the first, and the final weights."""
    overrides = [f"trainer.steps={args.steps}", f"rollout.prompts_per_step={args.prompts}",
                 f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", "rollout.dtype=float32",
                 "buffer.staleness=1", "trainer.sft_warmup_steps=0", "trainer.eval_every=0",
                 "trainer.checkpoint_every=0", "trainer.export_final=false", "trainer.threads=1", f"seed={seed}",
                 "algo.routing.metrics=false", "trainer.mismatch_metrics=false", "logging.progress=false",
                 "logging.loggers=[jsonl]", f"trainer.skip_zero_advantage={str(skip).lower()}"]
    if args.group_micro_batches:
        overrides.append(f"trainer.grad_accum={args.prompts}")
    times: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config(overrides=overrides + [f"run_dir={d}/run"])
        tr = Trainer(cfg, callbacks=[FunctionCallback(on_step_end=lambda t, step, m: times.append(
            m["perf/time_update_s"]))])
        rule = share_rewards(args.group, share)
        tr.task.score = lambda completions, answers, **columns: RewardScores(rule(completions, answers))
        tr.run()
        weights = {k: v.clone() for k, v in tr.unwrapped.state_dict().items()}
    return times[1:], weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--group-micro-batches", action="store_true",
                   help="one micro-batch per group (trainer.grad_accum = prompts): the skip is bit-exact")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"# bench_zero_skip {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.2f}, 1 thread; {args.prompts} prompts x {args.group}, {args.max_new_tokens} new "
          f"tokens, {args.layers} layers x {args.hidden}; grad_accum="
          f"{args.prompts if args.group_micro_batches else 1}")
    print("| zero-advantage groups | update s, no skip | update s, skip | speed-up | max abs weight diff |")
    print("|---|---|---|---|---|")
    for share in args.shares:
        off, on, diffs = [], [], []
        for r in range(args.rounds):
            t_off, w_off = run(args, share, False, seed=r)
            t_on, w_on = run(args, share, True, seed=r)
            off += t_off
            on += t_on
            diffs.append(max((w_off[k] - w_on[k]).abs().max().item() for k in w_off))
        m_off, m_on = statistics.median(off), statistics.median(on)
        print(f"| {share:.0%} | {m_off:.4f} | {m_on:.4f} | {m_off / m_on:.2f}x | {max(diffs):.2e} |", flush=True)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
