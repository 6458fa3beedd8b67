"""The update forward+backward of one batch under each trainer forward: plain rows, the cost model's choice
(``share_prompt=True``), packed groups and the shared-prompt KV cache, against response length and group size.

Anchor-size model (4 layers, hidden 128, 8 experts top-2), 16 prompts of 7 tokens x G samples of T tokens, fp32, one
thread.  Ways are interleaved within each repeat; the figure is the median process CPU time of ``response_logprobs``
+ ``backward`` (CPU time: time stolen by other tenants of a shared machine does not inflate it).  "auto / plain"
<= 1 at every length is the claim of :mod:`offpolicy_moe.models.forward_plan`.  Packing is skipped where its dense
mask would exceed ``--max-mask`` entries.

    python experiments/bench/bench_share_prompt.py --lengths 8 32 64 128 256 --groups 4 8 16 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from offpolicy_moe.config.schema import ModelConfig
from offpolicy_moe.models.response_logprobs import plan_shared_forward, response_logprobs
from offpolicy_moe.models.prompt_packing import plan_group_packing
from offpolicy_moe.models import load_policy

WAYS = ("plain", "auto", "pack", "cache")


def batch(U: int, G: int, P: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``U`` prompts x ``G`` samples, random ids, no padding."""
    g = torch.Generator().manual_seed(0)
    pid = torch.randint(3, 19, (U, P), generator=g).repeat_interleave(G, 0)
    ids = torch.cat([pid, torch.randint(3, 19, (U * G, T), generator=g)], 1)
    return ids, torch.ones_like(ids)


def timed(model, ids, am, P, way, max_mask) -> float:
    """CPU seconds of one forward+backward under ``way``."""
    kw = {"share_prompt": {"plain": False, "auto": True, "cache": "cache"}.get(way, False)}
    t0 = time.process_time()
    if way == "pack":
        kw["packing"] = plan_group_packing(ids, am, P, max_mask_elements=max_mask)
    response_logprobs(model, ids, am, P, **kw).sum().backward()
    dt = time.process_time() - t0
    model.zero_grad(set_to_none=True)
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    p.add_argument("--groups", type=int, nargs="+", default=[8])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-mask", type=int, default=1 << 26)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, _ = load_policy(ModelConfig(num_layers=4, hidden_size=128, num_experts=8, top_k=2), seed=0)
    model.train()
    rows = []
    print("| G | T | auto picks | plain ms | auto ms | pack ms | cache ms | auto / plain | load avg |")
    print("|" + " --- |" * 9)
    for G in args.groups:
        for T in args.lengths:
            ids, am = batch(args.prompts, G, args.prompt_len, T)
            U, P = args.prompts, args.prompt_len
            ways = [w for w in WAYS if w != "pack" or U * (P + G * (T - 1)) ** 2 <= args.max_mask]
            plan, _ = plan_shared_forward(model, ids, am, P, True)
            res = {w: [] for w in ways}
            for w in ways:
                timed(model, ids, am, P, w, args.max_mask)            # warm-up
            for _ in range(args.repeats):
                for w in ways:
                    res[w].append(timed(model, ids, am, P, w, args.max_mask))
            med = {w: statistics.median(v) for w, v in res.items()}
            row = {"G": G, "T": T, "auto_mode": plan.mode, "samples_per_row": plan.samples_per_row,
                   "cpu_s": med, "auto_over_plain": med["auto"] / med["plain"], "loadavg": os.getloadavg()}
            rows.append(row)
            cell = lambda w: f"{1e3 * med[w]:.0f}" if w in med else "-"  # noqa: E731
            print(f"| {G} | {T} | {plan.mode}{f' c={plan.samples_per_row}' if plan.mode == 'pack' else ''} | "
                  f"{cell('plain')} | {cell('auto')} | {cell('pack')} | {cell('cache')} | "
                  f"{row['auto_over_plain']:.2f} | {row['loadavg'][0]:.1f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M")}, f, indent=2)


if __name__ == "__main__":
    main()
