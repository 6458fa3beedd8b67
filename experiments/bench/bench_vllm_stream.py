"""vLLM streamed (``rollout/vllm_stream.py``) against vLLM's whole-iteration ``generate``, and what loading weights
between two engine steps costs.

    python experiments/bench/bench_vllm_stream.py --iterations 4 --rounds 3 --out experiments/results/stream/bench_vllm_stream.json

One vLLM engine (the embedded model's vLLM variant, started for stepping: its core in this process, no asynchronous
scheduling) serves every arm, so the arms differ only in how requests reach it:

* ``static``: ``generate`` per iteration (``--prompts`` x ``--group`` requests; the next iteration starts when its
  longest response is done), the weights loaded between iterations, as ``rollout.engine=vllm`` runs in the
  synchronous and asynchronous modes;
* ``stream``: every iteration's requests given to :class:`VLLMStreamSampler` at once (``--slots`` sequences
  decoding, a finished one's slot taken at the next step), no weight load;
* ``stream+load``: the same, with the weights loaded before EVERY engine step (the worst case of updates in flight:
  a trainer publishing faster than one decode step).

Response lengths: an untrained model rarely draws EOS, so each request's length is pinned (``min_tokens =
max_tokens``) to the token length of its ``longtail`` prompt's reference answer plus EOS, the lengths a model
that learned the task writes (max/median about 10 on this task).  Rounds interleave the arms; the figures are
response tokens per wall-clock second (median over rounds) and their ratios, with the seconds one in-flight load
takes.  After the first load (checked against the trainer's forward) the loads are not probed in any arm (a
stream's cannot be: the probe needs an idle engine).  The load average and the CPU model are recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=4, help="iterations per arm and round")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--slots", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON file for the figures")
    a = p.parse_args(argv)

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch

    torch.set_num_threads(a.threads)
    from vllm import SamplingParams

    from offpolicy_moe.config import load_config
    from offpolicy_moe.models.loading import build_model
    from offpolicy_moe.rollout.seeds import iteration_seed
    from offpolicy_moe.rollout.slots import StreamSample
    from offpolicy_moe.rollout.vllm_engine import VLLMRolloutEngine
    from offpolicy_moe.rollout.vllm_stream import VLLMStreamSampler
    from offpolicy_moe.tasks import build_char_tokenizer, encode_prompts, make_task

    cfg = load_config(None, ["task.name=longtail", "rollout.engine=vllm", f"rollout.dtype={a.dtype}",
                             f"rollout.batch_size={a.slots}", "rollout.max_new_tokens=225"])
    task = make_task(cfg.task)
    tok = build_char_tokenizer()
    model = build_model(cfg.model, tok, seed=0)
    engine = VLLMRolloutEngine(model, tok, cfg.rollout, seed=0, stream=True)
    state = model.state_dict()
    engine.sync(state, 0)           # checked against the trainer's forward once (the engine is idle)
    engine.check_sync = False       # then loads only: a stream's loads cannot run the probe, so no arm does

    iters = [task.sample_prompts(i, a.prompts) for i in range(a.iterations)]
    seeds = {}          # sampling seed -> pinned response length
    samples = []
    for i, rows in enumerate(iters):
        ids, am = encode_prompts(tok, [r["prompt"] for r in rows])
        for j, r in enumerate(rows):
            n = min(len(tok.encode(r["answer"], add_special_tokens=False)) + 1, engine.max_new_tokens)
            for g in range(a.group):
                seed = iteration_seed(1000 + i, j * a.group + g)
                seeds[seed] = n
                samples.append(StreamSample((i * a.prompts + j, g), ids[j][am[j].bool()], seed))
    lengths = sorted(seeds.values())
    own = engine.sampling_params

    def pinned(seed: int, delta: bool = False) -> SamplingParams:
        params = own(seed, delta)
        params.max_tokens = params.min_tokens = seeds[int(seed)]
        return params

    engine.sampling_params = pinned

    def run_static() -> tuple[int, int]:
        tokens = 0
        for i, rows in enumerate(iters):
            engine.sync(state, engine.version + 1)
            batch = engine.generate([r["prompt"] for r in rows], [r["answer"] for r in rows], group_size=a.group,
                                    seed=1000 + i)
            tokens += int(batch.response_mask.sum())
        return tokens, 0

    loads = []

    def run_stream(load: bool) -> tuple[int, int]:
        steps = 0

        def every_step(eng) -> None:
            t0 = time.perf_counter()
            eng.sync(state, eng.version + 1)
            loads.append(time.perf_counter() - t0)

        engine.call_between_tokens(every_step if load else None)
        sampler = VLLMStreamSampler(engine)
        sampler.submit(samples)
        tokens = 0
        while sampler.queued or sampler.active:
            tokens += sum(int(f.response_ids.numel()) for f in sampler.step())
            steps += 1
        engine.call_between_tokens(None)
        return tokens, steps

    arms = {"static": run_static, "stream": lambda: run_stream(False), "stream+load": lambda: run_stream(True)}
    load_before = os.getloadavg()
    print(f"{len(samples)} requests ({a.iterations} iterations x {a.prompts} prompts x {a.group}); lengths median "
          f"{statistics.median(lengths)}, max {lengths[-1]}; slots {a.slots}; engine {a.dtype}, {a.threads} "
          f"thread(s); load average {load_before}")
    run_stream(False)          # warm-up
    rates: dict[str, list[float]] = {k: [] for k in arms}
    steps: dict[str, int] = {}
    for r in range(a.rounds):
        for name in list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]:
            t0 = time.perf_counter()
            tokens, n = arms[name]()
            dt = time.perf_counter() - t0
            rates[name].append(tokens / dt)
            steps[name] = n
            print(f"round {r} {name:12s}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tok/s"
                  + (f", {n} engine steps" if n else ""))
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "command": "python experiments/bench/bench_vllm_stream.py " + " ".join(argv or []),
        "cpu": _cpu_model(), "load_before": load_before, "load_after": load_after,
        "requests": len(samples), "length_median": statistics.median(lengths), "length_max": lengths[-1],
        "slots": a.slots, "dtype": a.dtype, "threads": a.threads, "tokens_per_s": rates,
        "median_tokens_per_s": med, "stream_over_static": med["stream"] / med["static"],
        "stream_load_over_stream": med["stream+load"] / med["stream"],
        "load_s_median": statistics.median(loads) if loads else None, "engine_steps": steps,
        "unchecked_syncs": engine.unchecked_syncs,
    }
    print(f"median tok/s: {', '.join(f'{k} {v:.0f}' for k, v in med.items())}; stream/static "
          f"{result['stream_over_static']:.2f}, stream+load/stream {result['stream_load_over_stream']:.2f}; one "
          f"in-flight load {result['load_s_median'] * 1e3:.1f} ms (median); load average {load_after}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    engine.close()


if __name__ == "__main__":
    main()
