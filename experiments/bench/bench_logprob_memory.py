"""Peak memory and time of the log-prob head's forward + backward at a real vocabulary: ``token_logprobs`` (blocks,
a backward that recomputes the softmax from the logits as they came) against plain autograd through the same
blocked float32 arithmetic (which keeps each block's float32 copy for the backward).

Each cell is a fresh process: hidden states ``[rows, T, hidden]`` (requiring grad) times an output embedding
``[V, hidden]`` give the logits, an intermediate as in a model; then the log-probs of random targets, their sum's
backward.  Peak RSS above the inputs (MiB) and the median wall time of ``--repeats`` after a warm-up; variants run
interleaved per dtype.

    python experiments/bench/bench_logprob_memory.py --rows 16 --dtypes bfloat16 float32
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _bench_job import peak_rss_mb


def autograd_logprobs(logits, targets, block_elements: int):
    """The reference: the same blocks, autograd through float32 ``gather - logsumexp``."""
    import torch

    step = max(1, block_elements // (logits.shape[1] * logits.shape[2]))
    outs = []
    for z, x in zip(logits.split(step, 0), targets.split(step, 0)):
        z = z.float()
        outs.append(z.gather(-1, x.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1))
    return torch.cat(outs, 0)


def cell(variant: str, dtype: str, args) -> dict:
    import torch

    from offpolicy_moe.models.token_logprobs import CPU_LOGPROB_BLOCK, token_logprobs

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    h = torch.randn(args.rows, args.response, args.hidden, generator=g).to(dt).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden ** 0.5).to(dt).requires_grad_()
    x = torch.randint(0, args.vocab, (args.rows, args.response), generator=g)
    block = max(CPU_LOGPROB_BLOCK, args.response * args.vocab)      # whole rows per block in both variants
    base = peak_rss_mb()
    times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        logits = h @ w.t()
        lp = token_logprobs(logits, x, block_elements=block) if variant == "ours" \
            else autograd_logprobs(logits, x, block)
        del logits
        lp.sum().backward()
        h.grad = w.grad = None
        if i:
            times.append(time.perf_counter() - t0)
    return {"variant": variant, "dtype": dtype, "peak_mib": round(peak_rss_mb() - base, 1),
            "s": round(statistics.median(times), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16])
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cell is not None:
        variant, dtype, rows = json.loads(args.cell)
        args.rows = rows
        print(json.dumps(cell(variant, dtype, args)))
        return
    print(f"# load average {os.getloadavg()}, {args.threads} thread(s), logits rows x {args.response} x "
          f"{args.vocab}, hidden {args.hidden}")
    print("| rows | dtype | logits MiB | autograd: peak MiB / s | token_logprobs: peak MiB / s |\n"
          "| --- | --- | --- | --- | --- |")
    for rows in args.rows:
        for dtype in args.dtypes:
            res = {}
            for variant in ("autograd", "ours"):
                out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--cell",
                                      json.dumps([variant, dtype, rows])], capture_output=True, text=True, check=True)
                res[variant] = json.loads(out.stdout.strip().splitlines()[-1])
            size = rows * args.response * args.vocab * (2 if dtype == "bfloat16" else 4) / 2 ** 20
            a, o = res["autograd"], res["ours"]
            print(f"| {rows} | {dtype} | {size:.0f} | {a['peak_mib']} / {a['s']} | {o['peak_mib']} / {o['s']} |",
                  flush=True)
    print(f"# load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
