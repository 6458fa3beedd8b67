"""Scaling of offpolicy_moe against TRL's GRPOTrainer with response length and group size.

For every (new tokens T, group size G) of the grid, the job of ``bench_vs_trl.py`` (same model, task, settings;
``--no-eos 1``: the end-of-sequence token is forbidden in both systems so every response runs to exactly ``T``
tokens and the nominal token count is the real one) runs as interleaved pairs (ours, TRL, ours, TRL, ...), each
run in a fresh process.  Reported per cell: median s/step and rollout tokens/s of each, the median of the per-pair
ratios, ours' and TRL's peak resident memory (``ru_maxrss`` of the process), ours' cost per token (s/step / (prompts
x G x T)), the same ratio in process CPU time (``cpu_ratio``: time stolen by other tenants of a shared machine does
not inflate it), which forward the cost model picked for ours' update (``perf/forward_*``), and the load average after the
cell, and each system's seconds per step inside generation (``gen_s_per_step``; the rest of the step is the update
and its bookkeeping).  TRL runs with its default activation checkpointing unless ``--trl-gradient-checkpointing 0``
(then both systems make the same compute/memory trade; ``bench_vs_trl.py``).  Writes JSON and a plot (ratio and
cost per token against T, one line per G).

With ``--threads`` > 1 a quick matmul calibration runs first: if 2 threads are not at least ``--min-speedup`` x
faster than 1 on a 512^3 matmul the cores are not really available and the run stops (a 2-thread run on a shared
machine once came out 12x slow with no sign in the load average).

    python experiments/bench/bench_scaling.py --lengths 8 32 64 128 256 --groups 4 8 16 --repeats 3 \\
        --out experiments/results/speed/scaling.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import bench_vs_trl
from _bench_job import add_job_args


def matmul_speedup(threads: int, n: int = 512, reps: int = 20) -> float:
    """Wall time of ``reps`` ``n x n`` float32 matmuls on 1 thread over the same on ``threads`` threads."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    times = {}
    for t in (1, threads):
        torch.set_num_threads(t)
        a @ b
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        times[t] = time.perf_counter() - t0
    torch.set_num_threads(1)
    return times[1] / times[threads]


def _steps_for(T: int, args) -> int:
    return args.steps if T <= args.long_from else args.steps_long


def run_cell(T: int, G: int, args) -> dict:
    """Interleaved pairs for one (T, G): medians, per-pair ratios, peak memory, ours' forward plan."""
    a = argparse.Namespace(**vars(args))
    a.max_new_tokens, a.group, a.steps, a.ours_set = T, G, _steps_for(T, args), list(args.ours_set)
    runs = {"ours": [], "trl": []}
    for _ in range(args.repeats):
        for system in ("ours", "trl"):
            runs[system].append(bench_vs_trl._spawn(system, a))
    n_tok = args.prompts * G * T
    med = {s: statistics.median(statistics.median(r["step_times"]) for r in rs) for s, rs in runs.items()}
    pairs = [statistics.median(t["step_times"]) / statistics.median(o["step_times"])
             for o, t in zip(runs["ours"], runs["trl"])]
    cpu_pairs = [statistics.median(t["cpu_step_times"]) / statistics.median(o["cpu_step_times"])
                 for o, t in zip(runs["ours"], runs["trl"])]
    gen = {s: statistics.median(statistics.median(r["gen_s"]) for r in rs) if all(r.get("gen_s") for r in rs)
           else None for s, rs in runs.items()}
    return {"T": T, "G": G, "steps": a.steps, "repeats": args.repeats,
            "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
            "trl_experts_implementation": args.trl_experts_implementation, "gen_s_per_step": gen,
            "s_per_step": med, "tokens_per_s": {s: n_tok / v for s, v in med.items()},
            "ratio": statistics.median(pairs), "pair_ratios": pairs,
            "cpu_ratio": statistics.median(cpu_pairs), "cpu_pair_ratios": cpu_pairs,
            "cpu_s_per_step": {s: statistics.median(statistics.median(r["cpu_step_times"]) for r in rs)
                               for s, rs in runs.items()},
            "ours_s_per_token_ms": 1e3 * med["ours"] / n_tok, "trl_s_per_token_ms": 1e3 * med["trl"] / n_tok,
            "peak_rss_mb": {s: max(r["peak_rss_mb"] for r in rs) for s, rs in runs.items()},
            "forward_plan": runs["ours"][-1].get("forward_plan", {}), "loadavg": os.getloadavg()}


def plot(cells: list[dict], path: Path) -> None:
    """Two panels against T (log2 axis): ours / TRL speed ratio, and ms per generated token of each system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for G in sorted({c["G"] for c in cells}):
        cs = sorted((c for c in cells if c["G"] == G), key=lambda c: c["T"])
        Ts = [c["T"] for c in cs]
        ax1.plot(Ts, [c["ratio"] for c in cs], "o-", label=f"G={G} wall")
        ax1.plot(Ts, [c["cpu_ratio"] for c in cs], "s:", label=f"G={G} CPU time")
        ax2.plot(Ts, [c["ours_s_per_token_ms"] for c in cs], "o-", label=f"ours G={G}")
        ax2.plot(Ts, [c["trl_s_per_token_ms"] for c in cs], "x--", label=f"TRL G={G}")
    ax1.axhline(2.0, color="grey", lw=0.8, ls=":")
    ax1.set(xscale="log", xlabel="new tokens per response", ylabel="ours / TRL (tokens/s)", title="speed ratio")
    ax2.set(xscale="log", yscale="log", xlabel="new tokens per response", ylabel="ms per generated token",
            title="cost per token (whole RL step)")
    for ax in (ax1, ax2):
        ax.set_xticks(sorted({c["T"] for c in cells}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(cells: list[dict]) -> str:
    """Markdown table of the cells."""
    rows = ["| T | G | steps x pairs | ours s/step (generate) | TRL s/step (generate) | ours/TRL (wall) | ours/TRL (CPU) | "
            "ours ms/token | ours forward | peak RSS ours / TRL (MiB) | load avg |", "|" + " --- |" * 11]
    for c in sorted(cells, key=lambda c: (c["G"], c["T"])):
        fwd = [k.split("_")[-1] for k, v in c["forward_plan"].items() if v == 1.0 and "est" not in k]
        gen = c.get("gen_s_per_step") or {}
        phase = {s: f" ({gen[s]:.2f})" if gen.get(s) is not None else "" for s in ("ours", "trl")}
        rows.append(f"| {c['T']} | {c['G']} | {c['steps']} x {c['repeats']} | {c['s_per_step']['ours']:.2f}{phase['ours']} | "
                    f"{c['s_per_step']['trl']:.2f}{phase['trl']} | {c['ratio']:.2f}x | {c['cpu_ratio']:.2f}x | {c['ours_s_per_token_ms']:.3f} | "
                    f"{','.join(fwd) or '-'} | {c['peak_rss_mb']['ours']:.0f} / {c['peak_rss_mb']['trl']:.0f} | "
                    f"{c['loadavg'][0]:.2f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_job_args(p)
    p.set_defaults(layers=4, hidden=128, no_eos=1)
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    p.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--repeats", type=int, default=3, help="interleaved (ours, TRL) pairs per cell")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run up to --long-from new tokens")
    p.add_argument("--steps-long", type=int, default=2, help="timed steps per run beyond --long-from")
    p.add_argument("--long-from", type=int, default=64)
    p.add_argument("--min-speedup", type=float, default=1.5)
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE")
    bench_vs_trl.add_trl_args(p)
    p.add_argument("--out", type=str, default="experiments/results/speed/scaling.json")
    args = p.parse_args()
    if args.threads > 1:
        s = matmul_speedup(args.threads)
        print(f"{args.threads}-thread matmul calibration: {s:.2f}x over 1 thread", flush=True)
        if s < args.min_speedup:
            sys.exit(f"{args.threads} threads give only {s:.2f}x on a matmul (< {args.min_speedup}): the cores are "
                     "busy, a multi-thread figure would be meaningless")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cells = []
    print(f"load average at start: {os.getloadavg()}; TRL gradient checkpointing "
          f"{'on (its default)' if args.trl_gradient_checkpointing else 'off'}, TRL experts "
          f"{args.trl_experts_implementation}", flush=True)
    for G in args.groups:
        for T in args.lengths:
            c = run_cell(T, G, args)
            cells.append(c)
            print(f"T={T:4d} G={G:3d}: ours {c['s_per_step']['ours']:.2f} s/step, TRL {c['s_per_step']['trl']:.2f}"
                  f" s/step, ratio {c['ratio']:.2f}x (CPU {c['cpu_ratio']:.2f}x; pairs {', '.join(f'{r:.2f}' for r in c['pair_ratios'])}), "
                  f"peak RSS {c['peak_rss_mb']}, forward {c['forward_plan']}, load {c['loadavg']}", flush=True)
            out.write_text(json.dumps({"args": vars(args), "cells": cells, "date": time.strftime("%Y-%m-%d %H:%M"),
                                       }, indent=2))
    plot(cells, out.with_suffix(".png"))
    print(table(cells))
    print(f"plot: {out.with_suffix('.png')}; load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
