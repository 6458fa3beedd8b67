"""Peak memory and time of the old-logp recompute pass (a forward without gradient over a whole batch) in one
forward against the update's micro-batches (``trainer.micro_batch_tokens``), as the batch grows.

Each cell runs in a fresh process (peak RSS is per process): a Qwen3-MoE of ``--layers``/``--hidden`` with a
vocabulary of ``--vocab`` tokens (a real tokenizer's size: the logits ``[rows, T, V]`` are what grows), ``rows``
sequences of ``--prompt`` + ``--response`` tokens, ``RoutedForward.logp_pieces`` under ``torch.no_grad``.  Reported:
the process's peak RSS above its RSS after building the model and batch (MiB), and the pass's wall time (median of
``--repeats`` after one warm-up pass).  Cells are run interleaved (whole, pieces, whole, ...) so machine load hits both alike.

    python experiments/bench/bench_no_grad_pass.py --rows 16 32 64 128 --vocab 32000
    python experiments/bench/bench_no_grad_pass.py --blocks --rows 32      # token_logprobs' block size alone

``--blocks``: ``token_logprobs`` on random logits ``[rows, response + 1, vocab]`` with blocks of 2^18 .. 2^26
elements and in one piece (median of ``--repeats`` after a warm-up call, blocks interleaved round by round).
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


def cell(rows: int, cap: int | None, args) -> dict:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from offpolicy_moe.rollout.batch import RolloutBatch
    from offpolicy_moe.logprobs.micro_batch import MicroBatching
    from offpolicy_moe.logprobs.forward import RoutedForward

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    H = args.hidden
    config = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=H, num_hidden_layers=args.layers,
                            num_attention_heads=H // 16, num_key_value_heads=max(1, H // 32), head_dim=16,
                            intermediate_size=4 * H, moe_intermediate_size=H, num_experts=8, num_experts_per_tok=2,
                            max_position_embeddings=4096, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).eval()
    P, T = args.prompt, args.response
    ids = torch.randint(0, args.vocab, (rows, P + T))
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(rows, T),
                         behav_logp=torch.zeros(rows, T), group_ids=torch.arange(rows) // 8,
                         answers=[""] * rows, completions=[""] * rows, prompt_len=P, version=0)
    fwd = RoutedForward(device=torch.device("cpu"), controller=None, replay="none", share_prompt=False,
                        temperature=1.0, micro_batching=MicroBatching(1, 1, cap))
    base = peak_rss_mb()
    times = []
    for i in range(args.repeats + 1):       # the first pass is a warm-up (page faults of fresh memory)
        t0 = time.perf_counter()
        with torch.no_grad():
            lp = fwd.logp_pieces(model, batch)
        if i:
            times.append(time.perf_counter() - t0)
    assert torch.isfinite(lp).all()
    return {"rows": rows, "cap": cap, "pieces": len(fwd.micro_batching.pieces(rows, P + T)),
            "peak_mib": round(peak_rss_mb() - base, 1), "s": round(statistics.median(times), 4)}


def blocks(args) -> None:
    import torch

    from offpolicy_moe.models.token_logprobs import token_logprobs

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(args.rows[0], args.response + 1, args.vocab, generator=g)
    x = torch.randint(0, args.vocab, z.shape[:2], generator=g)
    sizes = [1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26, z.numel()]
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for b in sizes:
        token_logprobs(z, x, block_elements=b)
    for _ in range(args.repeats):
        for b in sizes:
            t0 = time.perf_counter()
            token_logprobs(z, x, block_elements=b)
            times[b].append(time.perf_counter() - t0)
    print(f"# load average {os.getloadavg()}, {args.threads} thread(s), logits {tuple(z.shape)}")
    print("| block elements | s |\n| --- | --- |")
    for b in sizes:
        label = "one piece" if b == z.numel() else f"2^{b.bit_length() - 1}"
        print(f"| {label} | {statistics.median(times[b]):.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--prompt", type=int, default=7)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--cap", type=int, default=16384, help="trainer.micro_batch_tokens of the 'pieces' cells")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--blocks", action="store_true", help="time token_logprobs' block sizes instead")
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.blocks:
        blocks(args)
        return
    if args.cell is not None:
        rows, cap = json.loads(args.cell)
        print(json.dumps(cell(rows, cap, args)))
        return
    print(f"# load average {os.getloadavg()}, {args.threads} thread(s), vocab {args.vocab}, "
          f"{args.prompt}+{args.response} tokens, {args.layers} layers, hidden {args.hidden}")
    print("| rows | padded positions | whole: peak MiB | pieces: n | pieces: peak MiB | whole s | pieces s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    argv = [a for a in sys.argv[1:]]
    for rows in args.rows:
        res = {}
        for cap in (None, args.cap):       # interleaved: whole then pieces at each size
            out = subprocess.run([sys.executable, __file__, *argv, "--cell", json.dumps([rows, cap])],
                                 capture_output=True, text=True, check=True)
            res[cap] = json.loads(out.stdout.strip().splitlines()[-1])
        w, c = res[None], res[args.cap]
        print(f"| {rows} | {rows * (args.prompt + args.response)} | {w['peak_mib']} | {c['pieces']} | "
              f"{c['peak_mib']} | {w['s']} | {c['s']} |", flush=True)
    print(f"# load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
