"""Cost of the divergence guard (trainer/step_guard.py) on the optimizer step: ``optimizer.step()`` alone vs
``snapshot() + optimizer.step() + params_max_abs()`` (with its host sync), interleaved, median over ``--reps``.

    python experiments/bench/bench_step_guard.py [--reps 50] [--threads 1]

Prints the parameter count, both medians, their ratio and the load average (the machine may be shared).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from offpolicy_moe.config.schema import ModelConfig
from offpolicy_moe.trainer.optim import adamw
from offpolicy_moe.trainer.step_guard import StepGuard
from offpolicy_moe.models import load_policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_policy(ModelConfig(), seed=0)          # the default preset
    opt = adamw(model.parameters(), lr=1e-6)
    for q in model.parameters():
        q.grad = torch.randn_like(q) * 1e-3
    opt.step()                                              # optimizer state exists
    guard = StepGuard(opt)
    plain, guarded = [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        opt.step()
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        guard.snapshot()
        opt.step()
        float(guard.params_max_abs())
        guarded.append(time.perf_counter() - t0)
    a, b = statistics.median(plain), statistics.median(guarded)
    n = sum(q.numel() for q in model.parameters())
    print(f"params={n} threads={args.threads} step={a * 1e3:.3f} ms guarded={b * 1e3:.3f} ms ratio={b / a:.2f} "
          f"(+{(b - a) * 1e3:.3f} ms per update) loadavg={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
