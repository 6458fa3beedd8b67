"""The cost of a long tail: generation throughput of a step's static batch against a stream, as the tail grows.

    python experiments/bench/stream_cost_curve.py --warm WARM_DIR --max-terms 6 8 11 15 --iterations 4 --rounds 3

For each ``task.max_terms`` (the ``longtail`` task's reference lengths have max/median 2.43, 4.43, 8.50 and 16 at
6, 8, 11 and 15 terms: docs/tasks.md) the warm-started policy samples ``--iterations`` steps' worth of the job's
rollouts (16 prompts x 8 samples a step, temperature 1, float32) twice:

* **static**: ``engine.generate`` once per step with ``rollout.batch_size`` = the step's 128 rows, as the
  synchronous loop does (finished rows leave the decode batch; the step lasts as long as its longest row);
* **stream**: one :class:`~offpolicy_moe.rollout.slots.SlotSampler` of ``--slots`` rows fed every step's samples
  at once, as the streaming worker is (a finished row's slot takes the next sample).

The figure is response tokens per wall-clock second of each arm (median over interleaved rounds), their ratio, and
the generated lengths (median, max, max/median).  One torch thread; the load average is printed before and after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warm", required=True, help="warm-start export (model.path)")
    p.add_argument("--max-terms", type=int, nargs="+", default=[6, 8, 11, 15])
    p.add_argument("--iterations", type=int, default=4, help="steps' worth of rollouts per arm and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    from offpolicy_moe.config.load import load_config
    from offpolicy_moe.models import load_policy
    from offpolicy_moe.rollout.engine import HFRolloutEngine
    from offpolicy_moe.rollout.slots import SlotSampler, StreamSample
    from offpolicy_moe.tasks import encode_prompts, make_task

    P, G = 16, 8
    print(f"before: load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = []
    for terms in a.max_terms:
        cfg = load_config(None, ["task.name=longtail", f"task.max_terms={terms}", f"model.path={a.warm}",
                                 "rollout.max_new_tokens=225", "rollout.dtype=float32", f"rollout.batch_size={P * G}"])
        task = make_task(cfg.task)
        model, tok = load_policy(cfg.model, seed=0, task=task)
        engine = HFRolloutEngine(model, tok, cfg.rollout)
        steps = [task.sample_prompts(i, P) for i in range(a.iterations)]

        def static(seed: int) -> list[int]:
            out = []
            for i, rows in enumerate(steps):
                b = engine.generate([r["prompt"] for r in rows], [r["answer"] for r in rows], group_size=G,
                                    seed=seed * 1000 + i)
                out += b.response_mask.sum(1).tolist()
            return out

        def stream(seed: int) -> list[int]:
            sampler = SlotSampler(engine, a.slots)
            for i, rows in enumerate(steps):
                ids, am = encode_prompts(tok, [r["prompt"] for r in rows])
                sampler.submit(StreamSample((i * P + g, j), ids[g][am[g].bool()], seed * 100003 + (i * P + g) * G + j)
                               for g in range(P) for j in range(G))
            out = []
            while sampler.queued or sampler.active:
                out += [int(f.response_ids.numel()) for f in sampler.step()]
            return out

        static(0), stream(0)            # warm-up
        rates: dict[str, list[float]] = {"static": [], "stream": []}
        lengths: list[int] = []
        for r in range(a.rounds):
            for arm, fn in (("static", static), ("stream", stream)) if r % 2 == 0 else (("stream", stream),
                                                                                      ("static", static)):
                t0 = time.perf_counter()
                lens = fn(r + 1)
                rates[arm].append(sum(lens) / (time.perf_counter() - t0))
                lengths += lens
        med = statistics.median(lengths)
        row = {"terms": terms, "median": med, "max": max(lengths), "tail": max(lengths) / med,
               "static": statistics.median(rates["static"]), "stream": statistics.median(rates["stream"])}
        results.append(row)
        print(f"max_terms {terms}: generated lengths median {med:.0f}, max {row['max']}, max/median "
              f"{row['tail']:.1f}; static {row['static']:.0f} tok/s, stream {row['stream']:.0f} tok/s, ratio "
              f"{row['stream'] / row['static']:.2f}", flush=True)
    print(f"after: load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n| task.max_terms | generated length median | max | max/median | static tok/s | stream tok/s | "
          "stream / static |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['terms']} | {r['median']:.0f} | {r['max']} | {r['tail']:.1f} | {r['static']:.0f} | "
              f"{r['stream']:.0f} | {r['stream'] / r['static']:.2f} |")


if __name__ == "__main__":
    main()
