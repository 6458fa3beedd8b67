"""The vLLM engine against the built-in engine on this machine: start-up, generation speed at several answer
lengths, and the seconds per weight version against model size.

    python experiments/bench/bench_vllm.py                                   # 8/32/128 new tokens, 3 model sizes
    python experiments/bench/bench_vllm.py --new-tokens 8 --hidden 64 --rounds 1 --out /tmp/b.json

Both engines serve the embedded tiny Qwen3-MoE in its vLLM variant (head_dim 32, 2 layers, 8 experts, top-2), in
``--dtype`` (bf16), from the same weights, on the same prompts (``--prompts`` x ``--group`` samples of the default
task), temperature 1, routes recorded (what R3 needs).  Per answer length the two engines generate in turn,
``--rounds`` times (interleaved: hf, vllm, vllm, hf, ...), each call timed by wall clock; tokens per second =
generated response tokens (EOS included) / wall seconds, the median over rounds.  The answers of an untrained
model end at a random EOS, so the mean response length is reported beside it.  Start-up: the engine's
construction (the built-in engine copies the policy; vLLM writes the model folder, starts its engine process,
loads the weights and installs the route recorder).  Weight sync: ``engine.sync`` of the trainer's state dict
(vLLM: the checkpoint names, a safetensors file in /dev/shm, the in-place reload in vLLM's worker), median of
``--syncs`` calls per model size (``--hidden``; every size keeps 2 layers and 8 experts).  The load average is
recorded around each measurement; the machine, torch and vLLM versions go to the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path


def _load() -> float:
    return os.getloadavg()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new-tokens", default="8,32,128")
    p.add_argument("--hidden", default="64,256,1024", help="model widths for the weight-sync figure")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--syncs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process (the built-in engine)")
    p.add_argument("--out", default=f"experiments/results/speed/bench_vllm_{time.strftime('%Y-%m-%d')}.json")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import vllm

    from offpolicy_moe.config import load_config
    from offpolicy_moe.models.loading import build_model
    from offpolicy_moe.rollout.engine import make_engine
    from offpolicy_moe.tasks import build_char_tokenizer, make_task

    tok = build_char_tokenizer()
    lengths = [int(x) for x in args.new_tokens.split(",")]
    widths = [int(x) for x in args.hidden.split(",")]
    result: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                                "vllm": vllm.__version__}, "args": vars(args), "load_start": _load()}

    def config(engine: str, hidden: int, new_tokens: int):
        return load_config(overrides=["model.head_dim=32", f"model.hidden_size={hidden}", f"rollout.engine={engine}",
                                      f"rollout.dtype={args.dtype}", f"rollout.max_new_tokens={new_tokens}",
                                      f"rollout.batch_size={args.prompts * args.group}"])

    cfg = config("hf", widths[0], max(lengths))
    task = make_task(cfg.task)
    rows = task.sample_prompts(0, args.prompts)
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]

    # generation speed at each length: both engines, interleaved
    gen: list[dict] = []
    model = build_model(cfg.model, tok, seed=0)
    for n in lengths:
        engines, starts = {}, {}
        for name in ("hf", "vllm"):
            t0 = time.perf_counter()
            engines[name] = make_engine(model, tok, config(name, widths[0], n).rollout, record_routes=True, seed=0)
            starts[name] = time.perf_counter() - t0
        times: dict[str, list] = {"hf": [], "vllm": []}
        tokens: dict[str, list] = {"hf": [], "vllm": []}
        loads = [_load()]
        for r in range(args.rounds):
            order = ("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")
            for name in order:
                t0 = time.perf_counter()
                batch = engines[name].generate(prompts, answers, group_size=args.group, seed=100 + r, iteration=r)
                times[name].append(time.perf_counter() - t0)
                tokens[name].append(int(batch.response_mask.sum()))
            loads.append(_load())
        for name in ("hf", "vllm"):
            tps = [t / s for t, s in zip(tokens[name], times[name])]
            gen.append({"engine": name, "new_tokens": n, "start_s": starts[name],
                        "tokens_per_s": statistics.median(tps), "tokens_per_s_all": tps,
                        "mean_response_len": statistics.mean(tokens[name]) / (args.prompts * args.group),
                        "seconds": times[name], "load": loads})
        engines["vllm"].close()
        print(json.dumps(gen[-2:]), flush=True)
    result["generation"] = gen

    # seconds per weight version against model size
    sync: list[dict] = []
    for h in widths:
        c = config("vllm", h, 8)
        m = build_model(c.model, tok, seed=0)
        params = sum(p.numel() for p in m.parameters())
        for name in ("hf", "vllm"):
            t0 = time.perf_counter()
            eng = make_engine(m, tok, config(name, h, 8).rollout, record_routes=True, seed=0)
            start = time.perf_counter() - t0
            sd = m.state_dict()
            secs, loads = [], [_load()]
            for v in range(1, args.syncs + 1):
                t0 = time.perf_counter()
                eng.sync(sd, v)
                secs.append(time.perf_counter() - t0)
            loads.append(_load())
            sync.append({"engine": name, "hidden": h, "params": params, "bytes": params * m.dtype.itemsize,
                         "start_s": start, "sync_s": statistics.median(secs), "sync_s_all": secs, "load": loads})
            if name == "vllm":
                eng.close()
            print(json.dumps(sync[-1]), flush=True)
    result["sync"] = sync
    result["load_end"] = _load()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
