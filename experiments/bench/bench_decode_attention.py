"""Decode-step attention: transformers' SDPA function against ``offpolicy_moe.rollout.decode_attention`` (one query
per row as two batched float32 matmuls), on the anchor model's attention shape (8 query heads, 4 key/value heads,
head size 16), for cached lengths L and decode batch sizes B, float32 and bfloat16.

Each call reads keys and values from views of pre-allocated ``[B, 4, capacity, 16]`` buffers (as the sampling loop's
cache hands them over), cycling over ``--layers`` sets of buffers so the cache is not served from the CPU's own
caches more than in a real decode step.  Rounds alternate the two functions; the figure is the median over rounds
of the mean time per call, and the ratio SDPA / ours of the medians (> 1: ours faster).  The largest absolute
difference of the outputs is printed beside it.

    python experiments/bench/bench_decode_attention.py --lengths 16 64 135 263 --batches 32 128 --rounds 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from offpolicy_moe.rollout.decode_attention import single_query_attention


def _module(heads: int, kv_heads: int) -> nn.Module:
    m = nn.Module()
    m.num_key_value_groups = heads // kv_heads
    m.is_causal = True
    return m


def measure(B: int, L: int, dtype: torch.dtype, args) -> dict:
    H, KV, D = args.heads, args.kv_heads, args.head_dim
    cap = max(args.lengths) + 8
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(B, KV, cap, D, generator=g).to(dtype) for _ in range(args.layers)]
    values = [torch.randn(B, KV, cap, D, generator=g).to(dtype) for _ in range(args.layers)]
    q = torch.randn(B, 1, H, D, generator=g).to(dtype).transpose(1, 2)
    mod = _module(H, KV)
    fns = {"sdpa": sdpa_attention_forward, "ours": single_query_attention}
    diff = max((fns["sdpa"](mod, q, k[:, :, :L], v[:, :, :L], None)[0].float()
                - fns["ours"](mod, q, k[:, :, :L], v[:, :, :L], None)[0].float()).abs().max().item()
               for k, v in zip(keys, values))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(args.calls):
                for k, v in zip(keys, values):
                    fn(mod, q, k[:, :, :L], v[:, :, :L], None)
            times[name].append((time.perf_counter() - t0) / (args.calls * args.layers))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"B": B, "L": L, "dtype": str(dtype).replace("torch.", ""), "ms": {k: 1e3 * v for k, v in med.items()},
            "sdpa_over_ours": med["sdpa"] / med["ours"], "max_abs_diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 135, 263])
    p.add_argument("--batches", type=int, nargs="+", default=[32, 128])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--layers", type=int, default=4, help="sets of cache buffers cycled through")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=5, help="passes over the layers per round and function")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {os.getloadavg()}")
    print("| dtype | B | L | SDPA ms | ours ms | SDPA / ours | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.dtypes:
        for B in args.batches:
            for L in args.lengths:
                r = measure(B, L, getattr(torch, name), args)
                print(f"| {r['dtype']} | {B} | {L} | {r['ms']['sdpa']:.3f} | {r['ms']['ours']:.3f} | "
                      f"{r['sdpa_over_ours']:.2f}x | {r['max_abs_diff']:.1e} |", flush=True)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
