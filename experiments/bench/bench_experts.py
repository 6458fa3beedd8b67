"""Routed experts on the CPU: transformers' ``grouped_mm`` against the family's own per-expert loop (``eager``, what
``model.experts_implementation=auto`` runs on the CPU: offpolicy_moe/models/experts.py), forward and forward +
backward of one layer's experts of the anchor model (hidden 128, 8 experts, intermediate 128, top-2) for N tokens.

The tokens' routes come from the layer's own router on random hidden states; rounds alternate the implementations;
the figure is the median over rounds of the CPU time per call, and the ratio grouped_mm / auto (> 1: auto faster).

    python experiments/bench/bench_experts.py --tokens 1024 8448 33664 --rounds 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers.integrations.moe import grouped_mm_experts_forward

from offpolicy_moe.config.schema import ModelConfig
from offpolicy_moe.models import load_policy
from offpolicy_moe.models.experts import auto_experts_forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8448, 33664],
                   help="tokens per call (8448 / 33664: 128 rows x (7 + 59 / 256) positions)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_policy(ModelConfig(num_layers=1, hidden_size=args.hidden, num_experts=args.experts,
                                       top_k=args.top_k), seed=0)
    moe = model.model.layers[0].mlp
    experts = moe.experts
    eager = type(experts).forward.__wrapped__          # the class's own loop, before the dispatching wrapper
    impls = {"grouped_mm": grouped_mm_experts_forward, "auto": auto_experts_forward, "eager": eager}
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()}")
    print("| tokens | pass | grouped_mm ms | auto ms | eager ms | grouped_mm / auto | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in args.tokens:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, args.hidden, generator=g)
        with torch.no_grad():
            _, w, idx = moe.gate(x)
        grad = torch.randn(n, args.hidden, generator=g)
        diff = (impls["auto"](experts, x, idx, w) - impls["grouped_mm"](experts, x, idx, w)).abs().max().item()
        for backward in (False, True):
            times: dict[str, list[float]] = {k: [] for k in impls}
            for _ in range(args.rounds):
                for name, fn in impls.items():
                    xi = x.clone().requires_grad_(backward)
                    t0 = time.process_time()
                    out = fn(experts, xi, idx, w)
                    if backward:
                        out.backward(grad)
                    times[name].append(time.process_time() - t0)
                    experts.zero_grad(set_to_none=True)
            med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            print(f"| {n} | {'fwd+bwd' if backward else 'fwd'} | {med['grouped_mm']:.1f} | {med['auto']:.1f} | "
                  f"{med['eager']:.1f} | {med['grouped_mm'] / med['auto']:.2f}x | {diff:.1e} |", flush=True)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
