"""Benchmark of the loss library (not a test).

1. Forward + backward time of each objective with TIS weights on a B x T fp32 batch
   (default 256 x 4096 tokens, random response lengths).
1b. GRPO and GSPO (value checks ON) against the same math written the way verl's ``vanilla`` and
   ``gspo`` policy losses are published (float mask multiplied in, masked means for the metrics),
   interleaved round by round, median per side; the values and gradients are asserted equal first.
2. ``m2po_mask`` (and ``m2po_adaptive_cap``) on 1M / 4M / 16M tokens against the time of ONE
   ``torch.sort`` of the same number of float32 values: the floor of any exact selection.

Prints a markdown table (median of ``--repeats`` runs after one warm-up); ``--json PATH`` also
writes the numbers.  Example::

    python experiments/bench/bench_losses.py --repeats 5 --json runs/bench_losses.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import warnings
from typing import Callable

import torch

from _machine import cpu_model
from offpolicy_moe.losses import (
    cispo_loss,
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
        ("cispo", cispo_loss, {}),
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


def verl_style_vanilla(logp, old, adv, fmask, weights, clip=0.2, clip_c=3.0):
    """PPO clipped surrogate with dual clip, written as verl's ``vanilla`` loss is published.

    ``r = exp(clamp(logp - old, +-20))``; ``l1 = max(-A r, -A clip(r))``; for ``A < 0`` also
    ``min(l1, -A c)``; times the TIS weights; token-mean by a float mask; the clip fractions and
    the approximate KL are masked means.
    """
    a = adv.unsqueeze(-1)
    neg_kl = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    n = fmask.sum()
    ppo_kl = (-neg_kl * fmask).sum() / n
    pg1 = -a * ratio
    pg2 = -a * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    l1 = torch.maximum(pg1, pg2)
    clipfrac = (torch.gt(pg2, pg1).float() * fmask).sum() / n
    pg3 = -a * clip_c
    l2 = torch.min(pg3, l1)
    lower = (torch.gt(l1, pg3) * (a < 0)).float()
    clipfrac_lower = (lower * fmask).sum() / n
    pg = torch.where(a < 0, l2, l1) * weights
    loss = (pg * fmask).sum() / n
    return loss, {"clipfrac": clipfrac.detach(), "ppo_kl": ppo_kl.detach(), "clipfrac_lower": clipfrac_lower.detach()}


def verl_style_gspo(logp, old, adv, fmask, weights, clip_low=3e-4, clip_high=4e-4):
    """GSPO-token as verl's ``gspo`` loss is published: sequence log-ratio (masked mean, capped at
    10) attached to each token with a stop-gradient, PPO clip, TIS weights, seq-mean-token-mean."""
    a = adv.unsqueeze(-1)
    neg_kl = logp - old
    lengths = fmask.sum(-1).clamp(min=1)
    seq = (neg_kl * fmask).sum(-1) / lengths
    log_s = logp - logp.detach() + seq.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    pg1 = -a * s
    pg2 = -a * torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    n = fmask.sum()
    clipfrac = (torch.gt(pg2, pg1).float() * fmask).sum() / n
    ppo_kl = (-neg_kl.detach() * fmask).sum() / n
    pg = pg * weights
    per_seq = (pg * fmask).sum(-1) / fmask.sum(-1)
    loss = per_seq.mean()
    return loss, {"clipfrac": clipfrac.detach(), "ppo_kl": ppo_kl.detach()}


def bench_vs_verl(B: int, T: int, device: torch.device, repeats: int) -> list[dict]:
    """Ours (value checks on) vs the verl-style math, interleaved; values and gradients checked equal."""
    logp0, old, behav, adv, mask = make_batch(B, T, device)
    weights, _ = correction_weights(old, behav, mask, level="token", mode="truncate", high=2.0)
    fmask = mask.to(logp0.dtype)
    cases = [
        ("grpo (dual clip 3)", lambda lp: grpo_loss(lp, old, adv, mask, weights=weights, dual_clip=3.0),
         lambda lp: verl_style_vanilla(lp, old, adv, fmask, weights)),
        ("gspo", lambda lp: gspo_loss(lp, old, adv, mask, weights=weights),
         lambda lp: verl_style_gspo(lp, old, adv, fmask, weights)),
    ]
    rows = []
    for name, ours, theirs in cases:
        grads = []
        for fn in (ours, theirs):
            leaf = logp0.clone().requires_grad_(True)
            loss, _ = fn(leaf)
            loss.backward()
            grads.append((loss.detach(), leaf.grad))
        torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-9)
        leaf = logp0.clone().requires_grad_(True)

        def step(fn) -> None:
            loss, _ = fn(leaf)
            loss.backward()
            leaf.grad = None

        step(ours), step(theirs)
        t_ours, t_theirs = [], []
        for _ in range(repeats):
            for fn, out in ((ours, t_ours), (theirs, t_theirs)):
                _sync(device)
                t0 = time.perf_counter()
                with value_checks(True):
                    step(fn)
                _sync(device)
                out.append((time.perf_counter() - t0) * 1e3)
        m_ours, m_theirs = statistics.median(t_ours), statistics.median(t_theirs)
        rows.append({"objective": name, "ms_ours_checks_on": m_ours, "ms_verl_style": m_theirs,
                     "ratio": m_ours / m_theirs, "load_avg": os.getloadavg()})
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
    p.add_argument("--only-verl", action="store_true", help="run only the comparison with the verl-style math")
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
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    machine["load_avg_start"] = os.getloadavg()
    vs = bench_vs_verl(args.batch, args.seq_len, device, args.repeats)
    obj = [] if args.only_verl else bench_objectives(args.batch, args.seq_len, device, args.repeats)
    msk = [] if args.only_verl else bench_mask(sizes, args.seq_len, device, args.repeats)
    machine["load_avg_end"] = os.getloadavg()

    print(f"\nLoss benchmark: {machine['device']}, torch {machine['torch']}, {machine['threads']} threads, "
          f"{machine['date']}, median of {args.repeats}\n")
    print(f"Load average (1/5/15 min): start {machine['load_avg_start']}, end {machine['load_avg_end']}\n")
    print(f"Ours (value checks on) vs verl-style math, forward + backward, TIS weights, {args.batch} x "
          f"{args.seq_len} fp32 tokens, interleaved:\n")
    print("| objective | ours ms | verl-style ms | ours / verl |")
    print("| --- | ---: | ---: | ---: |")
    for r in vs:
        print(f"| {r['objective']} | {r['ms_ours_checks_on']:.1f} | {r['ms_verl_style']:.1f} | {r['ratio']:.2f} |")
    print(f"\nForward + backward with TIS weights, {args.batch} x {args.seq_len} fp32 tokens:\n")
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
    result = {"machine": machine, "args": vars(args), "vs_verl": vs, "objectives": obj, "m2po_mask": msk}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
