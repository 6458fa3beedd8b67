"""End-to-end RL throughput: offpolicy_moe's trainer against TRL's GRPOTrainer on the same job.

Both train the same tiny Qwen3-MoE (same preset, same random init seed) on the same embedded arithmetic task
with the same prompts x group size, response length, steps, learning rate and thread count; GRPO, no KL,
no routing replay, fp32 generation with a KV cache in both. Each system runs in its own fresh subprocess;
runs alternate (ours, TRL, ours, TRL, ...) so that machine noise hits both alike.

Throughput = rollout tokens per second = prompts x group x max_new_tokens x timed steps / wall time of
those steps: ``steps + 2`` steps run, the wall time between consecutive end-of-step stamps is taken for all but
the first (warm-up) and the last (ours evaluates and checkpoints there). The nominal token count is identical for
both systems, so the ratio is the inverse ratio of step times.  The same is reported per second of process CPU
time, which time stolen by other tenants of a shared machine does not inflate.

Fairness probes (printed for the first pair): sequences generated per step, optimizer updates, dtype,
max_new_tokens, and for TRL the number of no-grad forwards fed ONE token (decode steps against the KV cache).
TRL skips its old-log-prob pass when on-policy with one update; ours does the same (old_logp from the update
forward).  TRL's ``GRPOConfig`` turns activation (gradient) checkpointing ON by default (it recomputes the forward
in the backward: less memory, more time); ours runs without it (``model.gradient_checkpointing=false``, its
default).  ``--trl-gradient-checkpointing 1`` (the default) measures TRL as its users get it, ``0`` measures it with
the same compute/memory trade as ours; say which one a figure is.  Likewise the routed experts: ours runs them with
``model.experts_implementation=auto`` (its default), TRL's model with transformers' default ``grouped_mm`` unless
``--trl-experts-implementation auto`` gives it ours too.  Each run also reports the CPU seconds per step
spent generating (``gen_s``: ours' ``perf/time_generate_s``, TRL's time inside ``model.generate``) so the rest of
the step (update and bookkeeping) can be compared on its own (``gen_s``, wall seconds).  Measurements TRL has no equivalent of are off for ours: routing metrics (``algo.routing.metrics=false``;
with them on the engine records routes and cannot share a prompt's prefill across its group) and the
counterfactual "with R3" mismatch pass (``trainer.mismatch_metrics=false``).  ``--ours-set KEY=VALUE`` adds
trainer overrides for ours, e.g. ``--ours-set algo.routing.metrics=true``.

    pip install -e ".[bench]"          # TRL is an optional benchmark extra
    python experiments/bench/bench_vs_trl.py --repeats 7 --steps 20 --threads 1

Prints a markdown table (median of the repeats) and writes JSON with --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench_job import JOB_ARGS, LEAN, add_job_args, forbid_token, job_overrides, peak_rss_mb


def _common_setup(args):
    import torch

    torch.set_num_threads(args.threads)
    from offpolicy_moe.config.schema import ModelConfig, TaskConfig
    from offpolicy_moe.models import load_policy
    from offpolicy_moe.tasks import make_task

    torch.manual_seed(args.seed)
    task_cfg = TaskConfig(max_digits=args.digits)
    task = make_task(task_cfg)
    model_cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_experts=args.experts,
                            experts_implementation=args.trl_experts_implementation)
    model, tok = load_policy(model_cfg, seed=args.seed, task=task)    # exactly as the trainer loads it
    return task, tok, model


def add_trl_args(p: argparse.ArgumentParser) -> None:
    """``--trl-gradient-checkpointing``: 1 (TRL's default) or 0 (no recompute, as ours); ``--trl-experts-implementation``
    (transformers' default ``grouped_mm``, or ours); ``--trl-option KEY=VALUE``: any other GRPOConfig field."""
    p.add_argument("--trl-gradient-checkpointing", type=int, default=1, choices=(0, 1),
                   help="TRL GRPOConfig.gradient_checkpointing: 1 = TRL's default (recomputes the forward in the "
                        "backward), 0 = off, the same compute/memory trade as ours")
    p.add_argument("--trl-experts-implementation", default="grouped_mm", choices=("grouped_mm", "auto", "eager"),
                   help="how TRL's model runs its routed experts: grouped_mm = transformers' default (what a TRL "
                        "user gets), auto = ours (model.experts_implementation=auto), to see the trainers alone")
    p.add_argument("--trl-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a GRPOConfig field for TRL's speed (repeatable; the value read as YAML), e.g. "
                        "use_transformers_continuous_batching=true or torch_compile=true")


def _timed(stamps: list[float]) -> list[float]:
    """Wall time between consecutive end-of-step stamps, for every step but the first (warm-up) and the last
    (ours runs its final evaluation and checkpoint there): ``steps`` timed steps out of ``steps + 2``."""
    diffs = [b - a for a, b in zip(stamps, stamps[1:])]
    return diffs[:-1]


def _timed_phase(per_step: list[float], n_steps: int) -> list[float]:
    """A per-step phase time restricted to the timed steps of :func:`_timed` (the first and the last step dropped);
    one entry per step is expected (one generate call per step in both systems), else nothing is reported."""
    return per_step[1:-1] if len(per_step) == n_steps else []


def run_trl(args) -> dict:
    """One TRL GRPOTrainer run; returns per-step wall times."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    task, tok, model = _common_setup(args)
    if args.no_eos:
        forbid_token(model, tok.eos_token_id)
    n_prompts = args.prompts * (args.steps + 2)
    rows = task.sample_prompts(0, n_prompts)
    ds = Dataset.from_dict({"prompt": [r["prompt"] for r in rows],   # TRL's tokenizer adds the bos itself
                            "answer": [r["answer"] for r in rows]})

    seqs_per_call: list[int] = []

    def reward(prompts, completions, answer, **_):
        seqs_per_call.append(len(completions))
        return task.reward(completions, answer)

    times: list[float] = []
    cpu: list[float] = []
    n_updates = [0]

    class Timer(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            times.append(time.perf_counter())
            cpu.append(time.process_time())

        def on_optimizer_step(self, a, state, control, **kw):
            n_updates[0] += 1

    # fairness probe: does generation decode one token per forward against its KV cache?
    fwd_lens: list[int] = []

    def probe(module, a, kw):
        ids = kw.get("input_ids")
        if ids is not None and not torch.is_grad_enabled():
            fwd_lens.append(int(ids.shape[1]))

    model.register_forward_pre_hook(probe, with_kwargs=True)

    gen_s: list[float] = []            # wall seconds inside model.generate, per call
    generate = model.generate

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = generate(*a, **kw)
        gen_s.append(time.perf_counter() - t0)
        return out

    model.generate = timed_generate

    out = tempfile.mkdtemp(prefix="trl_bench_")
    cfg = GRPOConfig(
        output_dir=out, use_cpu=True, report_to="none", save_strategy="no", logging_steps=1000,
        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", beta=0.0, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", max_steps=args.steps + 2, seed=args.seed,
        bf16=False, disable_dropout=True, shuffle_dataset=False, dataloader_num_workers=0,
        log_completions=False, max_grad_norm=1.0, gradient_checkpointing=bool(args.trl_gradient_checkpointing),
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Timer()])
    trainer.train()
    fair = {"sequences_per_step": sorted(set(seqs_per_call)), "optimizer_updates": n_updates[0],
            "steps": len(times), "dtype": str(next(model.parameters()).dtype),
            "generation_use_cache": trainer.generation_config.use_cache,
            "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
            "experts_implementation": model.config._experts_implementation,
            "max_new_tokens": trainer.generation_config.max_new_tokens,
            "no_grad_forwards_len1": sum(n == 1 for n in fwd_lens), "no_grad_forwards": len(fwd_lens)}
    return {"step_times": _timed(times), "cpu_step_times": _timed(cpu), "fairness": fair,
            "peak_rss_mb": peak_rss_mb(), "gen_s": _timed_phase(gen_s, len(times))}


def run_ours(args) -> dict:
    """One offpolicy_moe run with the same settings; returns per-step wall times."""
    import torch

    torch.set_num_threads(args.threads)
    from offpolicy_moe.config.load import load_config
    from offpolicy_moe.trainer.callbacks import FunctionCallback
    from offpolicy_moe.trainer.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="ours_bench_")
    overrides = job_overrides(args, args.steps + 2) + [f"run_dir={run_dir}"] + LEAN + list(args.ours_set)
    cfg = load_config(None, overrides)
    stamps: list[float] = []
    cpu: list[float] = []
    seqs: list[int] = []

    forward: dict = {}
    gen_s: list[float] = []

    def on_step_end(tr, step, metrics):
        forward.update({k: v for k, v in metrics.items() if k.startswith("perf/forward_")})
        gen_s.append(float(metrics.get("perf/time_generate_s", float("nan"))))
        stamps.append(time.perf_counter())
        cpu.append(time.process_time())

    trainer = Trainer(cfg, callbacks=[FunctionCallback(on_step_end=on_step_end)])
    if args.no_eos:
        for m in (trainer.unwrapped, trainer.engine.model):
            forbid_token(m, trainer.tok.eos_token_id)
    gen = trainer.engine.generate

    def counting_generate(*a, **kw):
        b = gen(*a, **kw)
        seqs.append(b.size)
        return b

    trainer.engine.generate = counting_generate
    trainer.run()
    fair = {"sequences_per_step": sorted(set(seqs)), "optimizer_updates": trainer.updates, "steps": trainer.step,
            "dtype": str(trainer.engine.dtype), "train_dtype": str(next(trainer.unwrapped.parameters()).dtype),
            "generation_use_cache": trainer.engine._generation_kwargs().get("use_cache", True),
            "max_new_tokens": trainer.engine.max_new_tokens,
            "gradient_checkpointing": bool(cfg.model.gradient_checkpointing),
            "experts_implementation": trainer.unwrapped.config._experts_implementation,
            "single_query_decode": bool(getattr(trainer.engine, "single_query_decode", False))}
    return {"step_times": _timed(stamps), "cpu_step_times": _timed(cpu), "fairness": fair,
            "peak_rss_mb": peak_rss_mb(), "forward_plan": forward, "gen_s": _timed_phase(gen_s, len(stamps))}


def _child(args) -> None:
    res = run_trl(args) if args.system == "trl" else run_ours(args)
    print("BENCH_RESULT " + json.dumps(res))


def _spawn(system: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--system", system]
    for k in ("steps",) + JOB_ARGS:
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    for o in args.ours_set:
        cmd += ["--ours-set", o]
    cmd += ["--trl-gradient-checkpointing", str(args.trl_gradient_checkpointing),
            "--trl-experts-implementation", args.trl_experts_implementation]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"{system} run failed (rc={r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    res = json.loads(line[-1][len("BENCH_RESULT "):])
    timed = res["step_times"]
    tokens = args.prompts * args.group * args.max_new_tokens * len(timed)
    res.update(process_wall_s=wall, timed_s=sum(timed), tokens_per_s=tokens / sum(timed),
               tokens_per_cpu_s=tokens / sum(res["cpu_step_times"]))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", choices=["ours", "trl"], default="ours", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed RL steps (one warm-up step is added)")
    add_job_args(p)
    p.add_argument("--out", type=str, default=None)
    add_trl_args(p)
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra trainer override for ours (e.g. algo.routing.metrics=true)")
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    for i in range(args.repeats):
        for system in ("ours", "trl"):
            res = _spawn(system, args)
            results[system].append(res)
            print(f"[{i + 1}/{args.repeats}] {system:>4}: {res['tokens_per_s']:8.1f} tok/s "
                  f"({res['timed_s']:.2f} s for {args.steps} steps, load average {os.getloadavg()[0]:.2f})",
                  flush=True)
            if i == 0:
                print(f"      fairness {system}: {json.dumps(res.get('fairness', {}))}", flush=True)
    med = {s: statistics.median(r["tokens_per_s"] for r in rs) for s, rs in results.items()}
    ratio = med["ours"] / med["trl"]
    pair_ratios = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(results["ours"], results["trl"])]
    import platform

    import torch

    print()
    print(f"| system | rollout tokens/s (median of {args.repeats}) | s/step |")
    print("| --- | --- | --- |")
    for s in ("ours", "trl"):
        per_step = args.prompts * args.group * args.max_new_tokens / med[s]
        print(f"| {'offpolicy_moe' if s == 'ours' else 'TRL GRPOTrainer'} | {med[s]:.1f} | {per_step:.3f} |")
    print(f"\nload average (1/5/15 min) at the end: {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"per-pair ratios (alternating runs): {', '.join(f'{r:.2f}' for r in pair_ratios)}; "
          f"median {statistics.median(pair_ratios):.2f}x")
    med_cpu = {s: statistics.median(r["tokens_per_cpu_s"] for r in rs) for s, rs in results.items()}
    print(f"per CPU second (process CPU time, insensitive to time stolen by other tenants): ours "
          f"{med_cpu['ours']:.1f}, TRL {med_cpu['trl']:.1f} tok/cpu-s, ratio {med_cpu['ours'] / med_cpu['trl']:.2f}x")
    print(f"ratio ours / TRL = {ratio:.2f}x  ({args.prompts} prompts x {args.group} samples, "
          f"{args.max_new_tokens} new tokens, {args.steps} timed steps, {args.threads} threads, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')})")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results, "median": med,
                                              "ratio": ratio, "pair_ratios": pair_ratios, "median_cpu": med_cpu,
                                              "loadavg": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
