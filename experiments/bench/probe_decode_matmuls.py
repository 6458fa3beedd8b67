"""Why single-query decode attention costs what it does on the CPU: the two batched matmuls of
``rollout/decode_attention.py`` (``q K^T`` then ``p V``, one ``[g, D] x [D, L]`` product per row and key/value head)
against reading the keys alone, with the cache hot (one layer's buffers reused) or cold (``--layers`` layers' buffers
cycled, more than the L3 cache at the default sizes), and against other ways of writing the same computation:
keys stored transposed, ``K q^T``, broadcast multiply-and-sum, rows in chunks, and (``--compile``) a
``torch.compile``'d multiply-and-sum.

Times are microseconds per layer call (keys and values of one layer), mean over the calls after a warm-up, variants
run one after the other; the 1-minute load average is printed.

    python experiments/bench/probe_decode_matmuls.py --lengths 135 263 --compile
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch


def bmm_attention(q, k, v):
    """The engine's formulation: ``softmax(q K^T) V`` as two batched matmuls."""
    return torch.matmul(torch.matmul(q, k.transpose(-1, -2)).softmax(-1), v)


def sum_attention(q, k, v):
    """The same values by broadcast multiply-and-sum."""
    s = (q.unsqueeze(3) * k.unsqueeze(2)).sum(-1)
    return (s.softmax(-1).unsqueeze(-1) * v.unsqueeze(2)).sum(-2)


def chunked(rows: int) -> Callable:
    def f(q, k, v):
        return torch.cat([bmm_attention(q[b:b + rows], k[b:b + rows], v[b:b + rows])
                          for b in range(0, q.shape[0], rows)])
    return f


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[135, 263])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--group", type=int, default=2, help="query heads per key/value head")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--calls", type=int, default=48)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    B, H, g, D = args.rows, args.kv_heads, args.group, args.head_dim
    cap = max(args.lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, g, D, generator=gen)
    bufs = [(torch.randn(B, H, cap, D, generator=gen), torch.randn(B, H, cap, D, generator=gen),
             torch.randn(B, H, D, cap, generator=gen)) for _ in range(args.layers)]
    compiled = torch.compile(sum_attention, dynamic=True) if args.compile else None
    print(f"# load average {os.getloadavg()}, {args.threads} thread(s), rows {B}, kv heads {H}, group {g}, "
          f"head size {D}, {args.layers} layers of buffers ({args.layers * 2 * B * H * cap * D * 4 / 2**20:.0f} MiB)")
    for L in args.lengths:
        def timed(fn: Callable, hot: bool = False) -> float:
            layers = bufs[:1] if hot else bufs
            ts = []
            for i in range(args.calls + len(layers)):
                k, v, kt = layers[i % len(layers)]
                t0 = time.perf_counter()
                fn(k[:, :, :L], v[:, :, :L], kt[..., :L])
                if i >= len(layers):
                    ts.append(time.perf_counter() - t0)
            return sum(ts) / len(ts) * 1e6

        ref = bmm_attention(q, bufs[0][0][:, :, :L], bufs[0][1][:, :, :L])
        variants = {
            "bmm, hot cache": (lambda k, v, kt: bmm_attention(q, k, v), True),
            "bmm, cold cache (the engine)": (lambda k, v, kt: bmm_attention(q, k, v), False),
            "read keys and values only": (lambda k, v, kt: (k.sum(), v.sum()), False),
            "keys stored transposed": (lambda k, v, kt: torch.matmul(torch.matmul(q, kt).softmax(-1), v), False),
            "K q^T": (lambda k, v, kt: torch.matmul(torch.matmul(k, q.transpose(-1, -2)).transpose(-1, -2)
                                                    .softmax(-1), v), False),
            "multiply-and-sum": (lambda k, v, kt: sum_attention(q, k, v), False),
            "rows in chunks of 16": (lambda k, v, kt: chunked(16)(q, k, v), False),
            "rows in chunks of 32": (lambda k, v, kt: chunked(32)(q, k, v), False),
        }
        if compiled is not None:
            t0 = time.perf_counter()
            out = compiled(q, bufs[0][0][:, :, :L], bufs[0][1][:, :, :L])
            print(f"# L={L}: compiled multiply-and-sum ready after {time.perf_counter() - t0:.1f} s, largest "
                  f"difference {float((out - ref).abs().max()):.1e}")
            variants["compiled multiply-and-sum"] = (lambda k, v, kt: compiled(q, k, v), False)
        print(f"\n| L = {L} | us per layer call |\n| --- | --- |")
        for name, (fn, hot) in variants.items():
            print(f"| {name} | {timed(fn, hot):.0f} |", flush=True)
    print(f"\n# load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
