"""What exact top-k / top-p (sampling-mask replay) costs: the bytes of each sampled token's kept set, the engine's
time to record them per decode step, and the trainer's peak memory and time of the log-prob head with them.

Three parts (``--parts``):

* ``bytes``: kept sets of synthetic next-token distributions at a real vocabulary (Zipf-like logits
  ``-s log(rank) + N(0, 0.5)``, ``s`` from ``--zipf``; a larger ``s`` is a more peaked distribution; NOT a trained
  model's logits), through the engine's own code (``TopKLogitsWarper`` / ``TopPLogitsWarper``, then
  :func:`~offpolicy_moe.models.kept_tokens.step_support`): mean and largest ``|K|``, bytes per sampled token, against
  a bitmask (``V / 8``) and the bf16 scores (``2 V``).
* ``engine``: one decode step's sampling from ``[B, V]`` logits (temperature, top-p, softmax, multinomial) with and
  without recording its kept sets; interleaved repeats, median of the per-pair time ratios.
* ``trainer``: ``token_logprobs`` forward + backward on logits ``[rows, T, V]`` (hidden states times an output
  embedding, as in a model) without kept sets and with the kept sets of top-p on the same logits; each cell a fresh
  process that builds the same inputs and kept sets either way (peak RSS above them, MiB, from ``VmHWM``; median
  time of ``--repeats``), the two variants interleaved over
  ``--pairs`` pairs; ``--logit-scale`` sets how peaked the logits are (1: nearly flat, the largest kept sets).

    python experiments/bench/bench_top_p.py --parts bytes engine trainer --vocab 151936
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time



def peak_rss_mb() -> float:
    """This process's peak resident memory, MiB (``VmHWM``: unlike ``ru_maxrss``, not inherited from the parent
    across ``fork`` + ``exec``, so a cell started by a parent that held large arrays still measures its own)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status")


def zipf_logits(rows: int, vocab: int, s: float, seed: int):
    """``[rows, V]`` logits ``-s log(rank) + N(0, 0.5)`` over a random permutation of the vocabulary per row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rank = torch.arange(1, vocab + 1, dtype=torch.float32).log()
    z = -s * rank + 0.5 * torch.randn(rows, vocab, generator=g)
    perm = torch.argsort(torch.rand(rows, vocab, generator=g), dim=-1)
    return torch.empty_like(z).scatter_(1, perm, z)


def warpers(top_p: float, top_k: int, temperature: float = 1.0):
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    return procs


def part_bytes(args) -> None:
    import torch

    from offpolicy_moe.models.kept_tokens import index_dtype, segment_words, step_support

    V = args.vocab
    h = torch.iinfo(index_dtype(V)).bits // 8
    print(f"\n## bytes per sampled token, V = {V} ({h}-byte words, W = {segment_words(V)}), {args.positions} positions "
          "per row, synthetic Zipf-like logits\n")
    print("| zipf s | top_p | top_k | entropy (nats) | mean abs K | max abs K | bytes/token mean | bytes/token max | "
          "bitmask V/8 | bf16 scores 2V |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in args.zipf:
        z = zipf_logits(args.positions, V, s, seed=1)
        ent = float(-(z.log_softmax(-1).exp() * z.log_softmax(-1)).sum(-1).mean())
        for top_p, top_k in ((0.9, 0), (0.95, 0), (0.9, 50)):
            scores = warpers(top_p, top_k)(None, z.clone())
            counts, words = step_support(scores)
            c = counts.long()
            per = h + h * c.clamp(max=segment_words(V))
            assert int(per.sum()) == (counts.numel() + words.numel()) * h
            print(f"| {s} | {top_p} | {top_k} | {ent:.2f} | {float(c.float().mean()):.0f} | {int(c.max())} | "
                  f"{float(per.float().mean()):.0f} | {int(per.max())} | {V // 8} | {2 * V} |", flush=True)


def part_engine(args) -> None:
    import torch

    from offpolicy_moe.models.kept_tokens import step_support

    torch.set_num_threads(args.threads)
    V, B = args.vocab, args.batch
    procs = warpers(args.top_p, 0, 0.7)
    print(f"\n## one decode step, [B, V] = [{B}, {V}], temperature 0.7, top_p {args.top_p}, {args.threads} thread(s)\n")
    for s in args.zipf:
        z = zipf_logits(B, V, s, seed=2)
        live = torch.ones(B, dtype=torch.bool)

        def step(record: bool):
            t0 = time.perf_counter()
            scores = procs(None, z.clone())
            torch.multinomial(scores.softmax(-1), 1)
            if record:
                step_support(scores, live)
            return time.perf_counter() - t0

        step(True), step(False)                                     # warm-up
        pairs = []
        for i in range(args.pairs):
            order = (False, True) if i % 2 == 0 else (True, False)
            t = {r: step(r) for r in order}
            pairs.append((t[False], t[True]))
        base = statistics.median(p[0] for p in pairs)
        rec = statistics.median(p[1] for p in pairs)
        ratios = sorted(p[1] / p[0] for p in pairs)
        print(f"zipf s={s}: step without recording {base * 1e3:.1f} ms, with {rec * 1e3:.1f} ms; ratio median "
              f"{statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f}, {len(ratios)} pairs)",
              flush=True)


def cell(variant: str, dtype: str, args) -> dict:
    """One fresh-process measurement: ``token_logprobs`` forward + backward, with (``kept``) or without kept sets."""
    import torch

    from offpolicy_moe.models.kept_tokens import KeptTokens, step_support
    from offpolicy_moe.models.token_logprobs import token_logprobs

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, dtype)
    R, T, V, H = args.rows, args.response, args.vocab, args.hidden
    h = (torch.randn(R, T, H, generator=g) * args.logit_scale).to(dt).requires_grad_()
    w = (torch.randn(V, H, generator=g) / H ** 0.5).to(dt).requires_grad_()
    kept, x = None, None
    with torch.no_grad():       # the engine's part: top-p on the same logits, one step (column of positions) at a time
        procs = warpers(args.top_p, 0)
        steps, xs = [], []
        for t in range(T):
            scores = procs(None, (h[:, t] @ w.t()).float())
            xs.append(torch.multinomial(scores.softmax(-1), 1, generator=g).squeeze(1))
            steps.append(step_support(scores))      # both variants: the same allocations before the loop
        x = torch.stack(xs, 1)
        kept = KeptTokens.from_steps([c for c, _ in steps], [i for _, i in steps], V)
        del scores, procs, steps
    kept_mean = float(kept.counts.float().mean())
    kept_bytes = kept.nbytes
    use = kept if variant == "kept" else None
    base = peak_rss_mb()
    times = []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        logits = h @ w.t()
        lp = token_logprobs(logits, x, kept=use)
        del logits
        lp.sum().backward()
        h.grad = w.grad = None
        if i:
            times.append(time.perf_counter() - t0)
    return {"variant": variant, "dtype": dtype, "peak_mib": round(peak_rss_mb() - base, 1),
            "s": statistics.median(times), "kept_mean": kept_mean, "kept_bytes": kept_bytes}


def part_trainer(args) -> None:
    print(f"\n## trainer head: token_logprobs forward + backward, logits [{args.rows}, {args.response}, "
          f"{args.vocab}], hidden {args.hidden}, logit scale {args.logit_scale}, top_p {args.top_p}, "
          f"{args.threads} thread(s), {args.pairs} interleaved pairs of fresh processes\n")
    print("| dtype | mean abs K | kept bytes/token | full softmax: peak MiB / s | kept sets: peak MiB / s | "
          "time ratio median (range) | peak ratio median (range) |\n| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in args.dtypes:
        res = {"full": [], "kept": []}
        for i in range(args.pairs):
            order = ("full", "kept") if i % 2 == 0 else ("kept", "full")
            for variant in order:
                out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--cell", json.dumps([variant, dtype])],
                                     capture_output=True, text=True, check=True)
                res[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
        tr = sorted(k["s"] / f["s"] for f, k in zip(res["full"], res["kept"]))
        pr = sorted(k["peak_mib"] / max(f["peak_mib"], 1e-9) for f, k in zip(res["full"], res["kept"]))
        f_peak = statistics.median(r["peak_mib"] for r in res["full"])
        k_peak = statistics.median(r["peak_mib"] for r in res["kept"])
        f_s = statistics.median(r["s"] for r in res["full"])
        k_s = statistics.median(r["s"] for r in res["kept"])
        k = res["kept"][0]
        per_tok = k["kept_bytes"] / (args.rows * args.response)
        print(f"| {dtype} | {k['kept_mean']:.0f} | {per_tok:.0f} | {f_peak:.0f} / {f_s:.2f} | {k_peak:.0f} / {k_s:.2f} "
              f"| {statistics.median(tr):.2f} ({tr[0]:.2f}-{tr[-1]:.2f}) | {statistics.median(pr):.2f} "
              f"({pr[0]:.2f}-{pr[-1]:.2f}) |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["bytes", "engine", "trainer"], choices=["bytes", "engine", "trainer"])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--zipf", type=float, nargs="+", default=[1.0, 1.5, 2.0, 3.0])
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--positions", type=int, default=256, help="bytes: sampled positions per distribution")
    p.add_argument("--rows", type=int, default=4, help="trainer: rows of the logits")
    p.add_argument("--batch", type=int, default=64, help="engine: rows of the decode step")
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--logit-scale", type=float, default=1.0)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cell is not None:
        variant, dtype = json.loads(args.cell)
        print(json.dumps(cell(variant, dtype, args)))
        return
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()}, "
          f"{args.threads} thread(s)")
    if "bytes" in args.parts:
        part_bytes(args)
    if "engine" in args.parts:
        part_engine(args)
    if "trainer" in args.parts:
        part_trainer(args)
    print(f"\n# load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
