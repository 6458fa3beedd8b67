"""Benchmark of the loss library (not a test).

1. Forward + backward time of each objective with TIS weights on a B x T fp32 batch
   (default 256 x 4096 tokens, random response lengths).
2. ``m2po_mask`` (and ``m2po_adaptive_cap``) on 1M / 4M / 16M tokens against the time of ONE
   ``torch.sort`` of the same number of float32 values: the floor of any exact selection.

Prints a markdown table (median of ``--repeats`` runs after one warm-up); ``--json PATH`` also
writes the numbers.  Example::

    python experiments/bench_losses.py --repeats 5 --json runs/bench_losses.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
import warnings
from typing import Callable

import torch

from offpolicy_moe.losses import (
    correction_weights,
    grpo_loss,
    gspo_loss,
    m2po_adaptive_cap,
    m2po_loss,
    m2po_mask,
    unclipped_loss,
    value_checks,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time in milliseconds over ``repeats`` runs, after one warm-up run."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_batch(B: int, T: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 4).to(device)
    old = logp + 0.05 * torch.randn(B, T, generator=g).to(device)
    behav = old + 0.02 * torch.randn(B, T, generator=g).to(device)
    lengths = torch.randint(1, T + 1, (B,), generator=g).to(device)
    mask = torch.arange(T, device=device)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g).to(device)
    return logp, old, behav, adv, mask


def bench_objectives(B: int, T: int, device: torch.device, repeats: int) -> list[dict]:
    logp0, old, behav, adv, mask = make_batch(B, T, device)
    weights, _ = correction_weights(old, behav, mask, level="token", mode="truncate", high=2.0)
    cases = [
        ("grpo", grpo_loss, {}),
        ("grpo (dual clip 3)", grpo_loss, {"dual_clip": 3.0}),
        ("gspo", gspo_loss, {}),
        ("m2po (mask)", m2po_loss, {}),
        ("m2po (adaptive_clip)", m2po_loss, {"variant": "adaptive_clip"}),
        ("unclipped", unclipped_loss, {}),
    ]
    rows = []
    for name, fn, opts in cases:
        leaf = logp0.clone().requires_grad_(True)

        def step(checks: bool) -> None:
            with value_checks(checks):
                loss, _ = fn(leaf, old, adv, mask, weights=weights, **opts)
                loss.backward()
            leaf.grad = None

        rows.append({
            "objective": name,
            "tokens": B * T,
            "ms_fwd_bwd": timeit(lambda: step(True), device, repeats),
            "ms_fwd_bwd_no_value_checks": timeit(lambda: step(False), device, repeats),
        })
    return rows


def bench_mask(sizes: list[int], T: int, device: torch.device, repeats: int) -> list[dict]:
    rows = []
    for n in sizes:
        B = max(n // T, 1)
        _, old, _, _, mask = make_batch(B, T, device, seed=1)
        g = torch.Generator(device="cpu").manual_seed(2)
        log_ratio = (0.3 * torch.randn(B, T, generator=g)).to(device)
        adv = torch.randn(B, generator=g).to(device)
        values = (log_ratio * log_ratio).reshape(-1).contiguous()
        t_sort = timeit(lambda: torch.sort(values), device, repeats)
        with value_checks(False):
            t_mask = timeit(lambda: m2po_mask(log_ratio, adv, mask, tau=0.04), device, repeats)
            t_cap = timeit(lambda: m2po_adaptive_cap(log_ratio, adv, mask, tau=0.04), device, repeats)
        rows.append({
            "tokens": B * T,
            "ms_sort": t_sort,
            "ms_m2po_mask": t_mask,
            "mask_over_sort": t_mask / t_sort,
            "ms_adaptive_cap": t_cap,
            "cap_over_sort": t_cap / t_sort,
        })
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=256, help="sequences in the objective benchmark")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--mask-sizes", type=str, default="1M,4M,16M", help="comma list; suffix K/M allowed")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--json", type=str, default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    warnings.simplefilter("ignore")

    def parse(s: str) -> int:
        s = s.strip().upper()
        mult = {"K": 2 ** 10, "M": 2 ** 20}.get(s[-1], 1)
        return int(float(s[:-1] if s[-1] in "KM" else s) * mult)

    sizes = [parse(s) for s in args.mask_sizes.split(",") if s.strip()]
    machine = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    obj = bench_objectives(args.batch, args.seq_len, device, args.repeats)
    msk = bench_mask(sizes, args.seq_len, device, args.repeats)

    print(f"\nLoss benchmark: {machine['device']}, torch {machine['torch']}, {machine['threads']} threads, "
          f"{machine['date']}, median of {args.repeats}\n")
    print(f"Forward + backward with TIS weights, {args.batch} x {args.seq_len} fp32 tokens:\n")
    print("| objective | ms (value checks on) | ms (value checks off) |")
    print("| --- | ---: | ---: |")
    for r in obj:
        print(f"| {r['objective']} | {r['ms_fwd_bwd']:.1f} | {r['ms_fwd_bwd_no_value_checks']:.1f} |")
    print("\nExact M2PO selection vs one `torch.sort` of the same number of float32 values:\n")
    print("| tokens | sort ms | m2po_mask ms | mask / sort | adaptive_cap ms | cap / sort |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in msk:
        size = f"{r['tokens'] / 2 ** 20:g}M" if r["tokens"] >= 2 ** 20 else f"{r['tokens'] / 2 ** 10:g}K"
        print(f"| {size} | {r['ms_sort']:.1f} | {r['ms_m2po_mask']:.1f} | "
              f"{r['mask_over_sort']:.2f} | {r['ms_adaptive_cap']:.1f} | {r['cap_over_sort']:.2f} |")
    result = {"machine": machine, "args": vars(args), "objectives": obj, "m2po_mask": msk}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
