"""Where does a training step of offpolicy_moe spend its time?  Per-phase breakdown from the trainer's ``perf/*``
metrics (generation, old-log-prob recompute, update, whole step), median over the timed steps, optionally with a
``torch.profiler`` table of the top operators of one step.

The default job is the one of ``experiments/bench/bench_vs_trl.py`` (tiny Qwen3-MoE, 16 prompts x 8 samples, 6 new tokens,
GRPO, no replay, fp32 engine, 1 thread, default measurements: routing metrics and the counterfactual R3 mismatch);
any trainer key can be overridden with ``--set key=value`` (bench_vs_trl's lean set:
``--set algo.routing.metrics=false --set trainer.mismatch_metrics=false``).  "whole step" is the trainer's
``perf/time_step_s``: it excludes the metrics logging after the step (bench_vs_trl's wall clock includes it).

    python experiments/bench/profile_step.py --steps 8 --out /tmp/after.json
    python experiments/bench/profile_step.py --compare /tmp/before.json /tmp/after.json     # before/after table
    python experiments/bench/profile_step.py --torch-profile                                # + top operators

``--label`` names the row in the JSON (e.g. the git commit measured).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _bench_job import add_job_args, forbid_token, job_overrides

PHASES = [("perf/time_generate_s", "generation"), ("perf/time_old_logp_s", "old-logp recompute"),
          ("perf/time_update_s", "update (fwd+bwd+step)"), ("perf/time_other_s", "other (buffer, sync, log)"),
          ("perf/time_step_s", "whole step")]


def profile(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from offpolicy_moe.config.load import load_config
    from offpolicy_moe.trainer.callbacks import FunctionCallback
    from offpolicy_moe.trainer.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="profile_step_")
    cfg = load_config(None, job_overrides(args, args.steps + 2) + [f"run_dir={run_dir}"] + list(args.set))
    rows: list[dict] = []
    prof_holder: dict = {}

    def on_step_end(tr, step, m):
        rows.append(dict(m, _cpu=time.process_time()))
        if prof_holder.get("prof") is not None:
            prof_holder["prof"].step()

    trainer = Trainer(cfg, callbacks=[FunctionCallback(on_step_end=on_step_end)])
    if args.no_eos:          # every response runs to --max-new-tokens
        for m in (trainer.unwrapped, trainer.engine.model):
            forbid_token(m, trainer.tok.eos_token_id)
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile as tprofile, schedule

        prof = tprofile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=1, repeat=1),
                        record_shapes=False)
        prof_holder["prof"] = prof
        prof.__enter__()
    t0 = time.perf_counter()
    trainer.run()
    wall = time.perf_counter() - t0
    if args.torch_profile:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    timed = rows[1:-1]          # first step: warm-up; last step: final evaluation and checkpoint
    for r in timed:
        known = sum(r.get(k, 0.0) for k in ("perf/time_generate_s", "perf/time_old_logp_s", "perf/time_update_s"))
        r["perf/time_other_s"] = r["perf/time_step_s"] - known
    med = {k: statistics.median(r[k] for r in timed if k in r) for k, _ in PHASES if any(k in r for r in timed)}
    # process CPU time per step (time stolen by other tenants of a shared machine does not inflate it)
    med["cpu_step_s"] = statistics.median(b["_cpu"] - a["_cpu"] for a, b in zip(rows, rows[1:-1]))
    for k in ("reward/response_len", "perf/forward_plain", "perf/forward_pack", "perf/forward_cache"):
        if any(k in r for r in timed):
            med[k] = statistics.median(r[k] for r in timed if k in r)
    tokens = args.prompts * args.group * args.max_new_tokens
    med["rollout_tokens_per_s"] = tokens / med["perf/time_step_s"]
    return {"label": args.label, "args": {k: v for k, v in vars(args).items() if k not in ("compare",)},
            "median": med, "steps": len(timed), "wall_s": wall, "date": time.strftime("%Y-%m-%d %H:%M"),
            "loadavg": os.getloadavg()}


def table(results: list[dict]) -> str:
    labels = [r.get("label") or f"run {i + 1}" for i, r in enumerate(results)]
    out = ["| phase (median s/step) | " + " | ".join(labels) + " |", "| --- |" + " --- |" * len(results)]
    for key, name in PHASES:
        cells = [f"{r['median'][key]:.4f}" if key in r["median"] else "-" for r in results]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    for key, name in (("cpu_step_s", "process CPU s/step"), ("reward/response_len", "mean response length"),
                      ("perf/forward_pack", "update forward packed (1) / not (0)")):
        out.append(f"| {name} | " + " | ".join(f"{r['median'][key]:.3f}" if key in r["median"] else "-"
                                               for r in results) + " |")
    out.append("| load average (1 min) | " + " | ".join(f"{r['loadavg'][0]:.1f}" if "loadavg" in r else "-"
                                                    for r in results) + " |")
    out.append("| rollout tokens/s | " + " | ".join(f"{r['median']['rollout_tokens_per_s']:.0f}" for r in results)
               + " |")
    if len(results) == 2:
        a, b = results[0]["median"]["perf/time_step_s"], results[1]["median"]["perf/time_step_s"]
        out.append(f"\nstep time {labels[0]} / {labels[1]} = {a / b:.2f}x")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="timed steps (a warm-up and a final step are added)")
    add_job_args(p)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra trainer override")
    p.add_argument("--torch-profile", action="store_true", help="print torch.profiler's top operators of one step")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--label", default=None)
    p.add_argument("--out", default=None, help="write the result as JSON")
    p.add_argument("--compare", nargs="+", default=None, metavar="JSON", help="print a table of saved results")
    args = p.parse_args()
    if args.compare:
        print(table([json.loads(Path(f).read_text()) for f in args.compare]))
        return
    res = profile(args)
    print(table([res]))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    sys.exit(main())
