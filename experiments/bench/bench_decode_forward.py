"""The lean decode forward (``rollout.decode_forward=lean``, rollout/decode_step.py) against ``model(...)``.

Three levels, each lean and model interleaved in one run, on the same weights, 1 thread by default:

* **one decode forward**: ``rows`` new tokens against ``columns`` cached positions (the engine's copy: single-query
  attention, pre-allocated cache, cut back after each call), median ms over ``--repeats`` of each, and the ratio;
* **the engine's generation**: ``HFRolloutEngine.generate`` on the task's prompts (``--prompts`` x ``--group``,
  ``--max-new-tokens``), the two engines alternating for ``--rounds`` rounds (round 0 warms up); median seconds a
  call, response tokens per second, and the median of the per-round ratios; the two must sample the same tokens;
* **greedy evaluation**: ``greedy_completions`` on the held-out split, alternating; identical completions asserted.

The model is the embedded preset (random weights) unless ``--model-path`` names a Hugging Face folder (a warm start
exported by ``bench_tta.py --warm-cache``); ``--set`` takes config overrides (``task.name=longtail``, ...).

    python experiments/bench/bench_decode_forward.py --model-path WARM --set task.name=longtail \\
        task.estimate_share=0.5 --max-new-tokens 225
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from _bench_model import bench_policy
from _machine import cpu_model
from offpolicy_moe.rollout.decode_attention import use_single_query_decode
from offpolicy_moe.rollout.decode_step import DecodeForward
from offpolicy_moe.rollout.engine import HFRolloutEngine
from offpolicy_moe.rollout.greedy import greedy_completions
from offpolicy_moe.rollout.kv_cache import preallocated_cache

WAYS = ("lean", "model")


def forward_ms(model: torch.nn.Module, rows: int, columns: int, repeats: int) -> dict[str, float]:
    """Median ms of one decode forward per way, the two alternating call by call."""
    model = copy.deepcopy(model).eval()
    use_single_query_decode(model)
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    ids, nxt = torch.randint(4, vocab, (rows, columns), generator=gen), torch.randint(4, vocab, (rows, 1), generator=gen)
    pos, mask = torch.full((rows, 1), columns), torch.ones(rows, columns + 1, dtype=torch.long)
    steps = {w: DecodeForward(model, lean=w == "lean") for w in WAYS}
    caches = {w: preallocated_cache(model.config, columns + 1) for w in WAYS}
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    with torch.no_grad():
        for w in WAYS:
            model(input_ids=ids, use_cache=True, cache=caches[w])
        for i in range(repeats + 3):
            for w in WAYS:
                t0 = time.perf_counter()
                steps[w](nxt, mask, pos, caches[w])
                if i >= 3:
                    times[w].append(time.perf_counter() - t0)
                caches[w].crop(-1)
    assert steps["lean"].lean_calls and not steps["model"].lean_calls, steps["lean"].refusal
    return {w: 1e3 * statistics.median(t) for w, t in times.items()}


def generation(cfg, model, tok, task, args) -> None:
    """The engine's ``generate``, lean and model alternating (module docstring)."""
    engines = {w: HFRolloutEngine(model, tok, type(cfg.rollout)(**{**vars(cfg.rollout), "decode_forward": w}))
               for w in WAYS}
    secs: dict[str, list[float]] = {w: [] for w in WAYS}
    tokens = []
    for r in range(args.rounds + 1):
        rows = task.sample_prompts(r, args.prompts)
        prompts, answers = [x["prompt"] for x in rows], [x["answer"] for x in rows]
        out = {}
        for w, eng in engines.items():
            t0 = time.perf_counter()
            out[w] = eng.generate(prompts, answers, group_size=args.group, seed=r)
            if r:
                secs[w].append(time.perf_counter() - t0)
        assert torch.equal(out["lean"].input_ids, out["model"].input_ids), "the two ways sampled different tokens"
        if r:
            tokens.append(int(out["lean"].response_mask.sum()))
    ratio = statistics.median(m / l for m, l in zip(secs["model"], secs["lean"]))
    print(f"\ngeneration ({args.prompts} x {args.group}, up to {args.max_new_tokens} tokens, {args.rounds} rounds, "
          f"median {statistics.median(tokens)} response tokens a call)\n")
    print("| way | s a call | tokens/s |\n| --- | --- | --- |")
    for w in WAYS:
        s = statistics.median(secs[w])
        print(f"| {w} | {s:.4f} | {statistics.median(tokens) / s:,.0f} |")
    print(f"\nmodel / lean (median of per-round ratios): {ratio:.2f}x")


def evaluation(model, tok, task, args) -> None:
    """Greedy evaluation of the held-out split, lean and model alternating."""
    prompts = list(task.eval_prompts)
    secs: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(args.rounds + 1):
        out = {}
        for w in WAYS:
            t0 = time.perf_counter()
            out[w] = greedy_completions(model, tok, prompts, max_new_tokens=args.max_new_tokens, lean=w == "lean")
            if r:
                secs[w].append(time.perf_counter() - t0)
        assert out["lean"] == out["model"], "the two ways decoded different completions"
    ratio = statistics.median(m / l for m, l in zip(secs["model"], secs["lean"]))
    print(f"\ngreedy evaluation of {len(prompts)} held-out prompts: lean {statistics.median(secs['lean']):.4f} s, "
          f"model {statistics.median(secs['model']):.4f} s; model / lean {ratio:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="a Hugging Face folder (default: the embedded preset)")
    p.add_argument("--set", nargs="*", default=[], help="config overrides, e.g. task.name=longtail")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    p.add_argument("--columns", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.rows + args.columns) < 1 or min(args.repeats, args.prompts, args.group, args.rounds,
                                                args.max_new_tokens) < 1:
        p.error("--rows, --columns, --repeats, --prompts, --group, --rounds and --max-new-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    cfg, task, model, tok = bench_policy(args)
    print(f"{cpu_model()}; torch {torch.__version__}, {args.threads} thread(s); model {args.model_path or 'embedded'}; "
          f"load average {os.getloadavg()}")
    print("\none decode forward, ms (lean / model, ratio)\n")
    print("| rows \\ KV columns | " + " | ".join(map(str, args.columns)) + " |")
    print("| --- |" + " --- |" * len(args.columns))
    for r in args.rows:
        cells = [forward_ms(model, r, c, args.repeats) for c in args.columns]
        print(f"| {r} | " + " | ".join(f"{c['lean']:.3f} / {c['model']:.3f} ({c['model'] / c['lean']:.2f}x)"
                                      for c in cells) + " |")
    with torch.no_grad():
        generation(cfg, model, tok, task, args)
        evaluation(model, tok, task, args)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
