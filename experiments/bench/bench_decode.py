"""Decode throughput of the rollout engine against ``model.generate`` on the same model.

The anchor model (tiny Qwen3-MoE: 4 layers, hidden 128, 8 experts top-2, random init), 16 prompts x 8 samples, the
end-of-sequence token forbidden (logit -1e9) so every response runs to exactly T tokens; temperature 1, no top-p.
Three ways of sampling, each its own ``HFRolloutEngine`` on a copy of the same weights:

* ``native``: the engine's own KV-cache loop (shared prompt prefill, pre-allocated cache, single-query decode
  attention: ``rollout.decode_attention=single_query``, the default);
* ``native-sdpa``: the same loop with transformers' SDPA kernel in the decode steps;
* ``generate``: ``rollout.sampler=hf``, i.e. ``model.generate`` with the same sampling settings.

Rounds alternate the three; the figure is response tokens per second of process CPU time (prompts x G x T / CPU
seconds of one ``generate`` call), median over rounds, and the ratio of each to ``generate``.

    python experiments/bench/bench_decode.py --lengths 64 128 256 512 --dtypes float32 bfloat16 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from _bench_job import forbid_token
from offpolicy_moe.config.schema import ModelConfig, RolloutConfig, TaskConfig
from offpolicy_moe.rollout.engine import HFRolloutEngine
from offpolicy_moe.models import load_policy
from offpolicy_moe.tasks import make_task

WAYS = {"native": dict(sampler="native", decode_attention="single_query"),
        "native-sdpa": dict(sampler="native", decode_attention="sdpa"),
        "generate": dict(sampler="hf")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    task = make_task(TaskConfig())
    model, tok = load_policy(ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_experts=args.experts),
                             seed=0, task=task)
    rows = task.sample_prompts(0, args.prompts)
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.prompts} x {args.group} sequences, "
          f"load average {os.getloadavg()}")
    print("| dtype | T | native tok/s | native-sdpa tok/s | generate tok/s | native / generate | "
          "native-sdpa / generate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in args.dtypes:
        for T in args.lengths:
            engines = {}
            for name, kw in WAYS.items():
                eng = HFRolloutEngine(model, tok, RolloutConfig(dtype=dtype, max_new_tokens=T,
                                                                 batch_size=args.prompts * args.group, **kw))
                forbid_token(eng.model, tok.eos_token_id)
                engines[name] = eng
            n_tok = args.prompts * args.group * T
            rates: dict[str, list[float]] = {k: [] for k in engines}
            for r in range(args.rounds + 1):            # round 0 warms up
                for name, eng in engines.items():
                    t0 = time.process_time()
                    batch = eng.generate(prompts, answers, group_size=args.group, seed=r)
                    dt = time.process_time() - t0
                    assert int(batch.response_mask.sum()) == n_tok, "a response ended early"
                    if r:
                        rates[name].append(n_tok / dt)
            med = {k: statistics.median(v) for k, v in rates.items()}
            print(f"| {dtype} | {T} | {med['native']:.0f} | {med['native-sdpa']:.0f} | {med['generate']:.0f} | "
                  f"{med['native'] / med['generate']:.2f}x | {med['native-sdpa'] / med['generate']:.2f}x |",
                  flush=True)
    print(f"load average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
