"""Does ``torch.compile`` speed up the sampling loop's decode steps, or the update's forward + backward, on this
machine?  The engine's decode forward
(the bench_vs_trl model: Qwen3-MoE, ``--layers``/``--hidden``, 8 experts top-2; single-query decode attention,
pre-allocated KV cache, ``experts_implementation=auto``) run eagerly and through ``torch.compile(model,
dynamic=True)``, ``--rows`` sequences decoding ``--lengths`` new tokens after a 7-token prompt.

Reported per length: the compiled variant's first run (tracing + compilation + one decode), and the median time
per decode step of each variant over ``--rounds`` rounds run interleaved (eager, compiled, eager, ...), with the
ratio eager / compiled.  ``--update`` measures the update instead: the training model's response log-probs
(``response_logprobs``, plain forward) and their backward over ``--rows`` sequences of 7 + ``--lengths`` tokens.
The 1-minute load average is printed at the start and the end.

    python experiments/bench/bench_compile.py --lengths 64 256 --rounds 3
    python experiments/bench/bench_compile.py --update --lengths 64 256 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from offpolicy_moe.config.load import load_config
from offpolicy_moe.rollout.decode_attention import use_single_query_decode
from offpolicy_moe.rollout.kv_cache import preallocated_cache
from offpolicy_moe.models.response_logprobs import response_logprobs
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


def update_seconds(model: torch.nn.Module, fwd, rows: int, prompt: int, new: int) -> float:
    """Seconds of one forward (through ``fwd``) + backward of the response log-probs' sum."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 20, (rows, prompt + new), generator=g)
    t0 = time.perf_counter()
    response_logprobs(fwd, ids, torch.ones_like(ids), prompt).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--update", action="store_true", help="the update's forward + backward instead of decoding")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(None, [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
                             "model.num_experts=8"])
    model, _ = load_policy(cfg.model, seed=0)
    if args.update:
        model.train()
        run, unit, per = update_seconds, "s/update", (lambda new: 1)
    else:
        model.eval()
        use_single_query_decode(model)
        run, unit, per = decode_seconds, "ms/step", (lambda new: (new - 1) / 1e3)
    compiled = torch.compile(model, dynamic=True)
    print(f"# load average {os.getloadavg()}, {args.threads} thread(s), torch {torch.__version__}, "
          f"{args.rows} rows, {args.layers} layers, hidden {args.hidden}")
    print(f"| new tokens | compile + first run s | eager {unit} | compiled {unit} | eager / compiled |")
    print("| --- | --- | --- | --- | --- |")
    for new in args.lengths:
        t0 = time.perf_counter()
        run(model, compiled, args.rows, 7, new)          # compiles (or recompiles) for this length
        first = time.perf_counter() - t0
        run(model, model, args.rows, 7, new)             # eager warm-up
        eager, comp = [], []
        for _ in range(args.rounds):
            eager.append(run(model, model, args.rows, 7, new) / per(new))
            comp.append(run(model, compiled, args.rows, 7, new) / per(new))
        e, c = statistics.median(eager), statistics.median(comp)
        print(f"| {new} | {first:.1f} | {e:.3f} | {c:.3f} | {e / c:.2f} |", flush=True)
    print(f"# load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
