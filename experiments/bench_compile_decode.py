"""Does ``torch.compile`` speed up the sampling loop's decode steps on this machine?  The engine's decode forward
(the bench_vs_trl model: Qwen3-MoE, ``--layers``/``--hidden``, 8 experts top-2; single-query decode attention,
pre-allocated KV cache, ``experts_implementation=auto``) run eagerly and through ``torch.compile(model,
dynamic=True)``, ``--rows`` sequences decoding ``--lengths`` new tokens after a 7-token prompt.

Reported per length: the compiled variant's first run (tracing + compilation + one decode), and the median time
per decode step of each variant over ``--rounds`` rounds run interleaved (eager, compiled, eager, ...), with the
ratio eager / compiled.  The 1-minute load average is printed at the start and the end.

    python experiments/bench_compile_decode.py --lengths 64 256 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from offpolicy_moe.config.load import load_config
from offpolicy_moe.engine.decode_attention import use_single_query_decode
from offpolicy_moe.engine.kv_cache import preallocated_cache
from offpolicy_moe.models import load_policy


def decode_seconds(model: torch.nn.Module, fwd, rows: int, prompt: int, new: int) -> float:
    """Seconds of ``new - 1`` decode steps (after an untimed prefill) through ``fwd``."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 20, (rows, prompt), generator=g)
    am = torch.ones(rows, prompt + new, dtype=torch.long)
    cache = preallocated_cache(model.config, prompt + new)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=am[:, :prompt], position_ids=torch.arange(prompt).expand(rows, -1),
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        t0 = time.perf_counter()
        for t in range(new - 1):
            out = fwd(input_ids=nxt[:, None], attention_mask=am[:, :prompt + t + 1],
                      position_ids=torch.full((rows, 1), prompt + t), past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
            nxt = torch.multinomial(out.logits[:, -1].float().softmax(-1), 1, generator=g).squeeze(1)
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(None, [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
                             "model.num_experts=8"])
    model, _ = load_policy(cfg.model, seed=0)
    model.eval()
    use_single_query_decode(model)
    compiled = torch.compile(model, dynamic=True)
    print(f"# load average {os.getloadavg()}, {args.threads} thread(s), torch {torch.__version__}, "
          f"{args.rows} rows, {args.layers} layers, hidden {args.hidden}")
    print("| new tokens | compile + first run s | eager ms/step | compiled ms/step | eager / compiled |")
    print("| --- | --- | --- | --- | --- |")
    for new in args.lengths:
        t0 = time.perf_counter()
        decode_seconds(model, compiled, args.rows, 7, new)          # compiles (or recompiles) for this length
        first = time.perf_counter() - t0
        decode_seconds(model, model, args.rows, 7, new)             # eager warm-up
        eager, comp = [], []
        for _ in range(args.rounds):
            eager.append(decode_seconds(model, model, args.rows, 7, new) / (new - 1))
            comp.append(decode_seconds(model, compiled, args.rows, 7, new) / (new - 1))
        e, c = statistics.median(eager) * 1e3, statistics.median(comp) * 1e3
        print(f"| {new} | {first:.1f} | {e:.3f} | {c:.3f} | {e / c:.2f} |", flush=True)
    print(f"# load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
