"""The update and the old-log-prob pass against the machine's bound at the run's own shapes.

A run of the ``longtail`` job's trainer (``bench_tta.py``'s job, ``fixed`` at staleness 1, so every step runs the old-log-prob pass and the
update; one thread by default, as an asynchronous arm's trainer; ``--model-path``: a warm start, e.g. the one
``bench_tta.py --warm-cache`` keeps) trains ``--steps`` steps with ``trainer.length_buckets`` on and off, ``--rounds`` runs of each, alternating (the same
weights and seed: the same batches up to float rounding).  Then the bare model (a plain forward, or forward +
backward of the summed token log-probabilities, ``bench_bounds.update_ms``) is timed at each trained batch's own shape:

* **bound**: ``B`` rows of the batch's mean width (prompt + response), dense: the real tokens and no padding, one
  forward (attention at the mean width: a lower bound of the work of rows of uneven width);
* **padded**: ``B`` rows at the batch's full width (what one padded forward costs).

Reported per arm (median over steps): the update ``U`` and the pass ``O`` (the trainer's ``perf/time_update_s``,
``perf/time_old_logp_s``), the bare bounds, ``bound / achieved`` (the fraction of the bound reached: 1 is the
bound), and the MFU of the update against the CPU's measured matmul rate (``6 x active parameters x real tokens``
FLOPs, Kaplan et al., 2020, https://arxiv.org/abs/2001.08361).  The load average and the CPU model are printed.

    python experiments/bench/bench_update_bound.py --model-path WARM --steps 8
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

from _machine import cpu_model
from bench_bounds import active_parameters, peak_flops, update_ms
from bench_tta import JOBS, job_overrides
from offpolicy_moe.config.load import load_config
from offpolicy_moe.logprobs.length_buckets import row_widths
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.trainer.trainer import Trainer


def make_trainer(args: argparse.Namespace, buckets: bool, rows: list) -> Trainer:
    """A trainer of the job (``trainer.length_buckets=buckets``) appending ``(metrics, widths)`` per step to
    ``rows``."""
    job = JOBS["longtail"]
    shape = argparse.Namespace(job="longtail", prompts=16, group=8, max_new_tokens=job["max_new_tokens"],
                               lr=job["lr"], steps=args.steps + 1, eval_every=0, eval_size=8)
    over = job_overrides(shape, args.seed, args.model_path, args.threads) + [
        "preset=[grpo]", "buffer.mode=fixed", "buffer.staleness=1", f"trainer.length_buckets={str(buckets).lower()}",
        f"run_dir={tempfile.mkdtemp()}"]
    seen: dict = {}

    def on_batch(tr, batch) -> None:
        am = batch.attention_mask
        seen["mean_width"] = float(row_widths(am).float().mean())     # left padding of the prompt included
        seen["rows"], seen["full_width"] = int(am.shape[0]), int(am.shape[1])
        seen["real_tokens"] = int(am.sum())

    def on_step_end(tr, step, m) -> None:
        rows.append((dict(m), dict(seen)))

    return Trainer(load_config(None, over), callbacks=[FunctionCallback(on_batch=on_batch, on_step_end=on_step_end)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="a warm start (Hugging Face folder); default: an SFT-free model")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run (one untimed first step is added)")
    p.add_argument("--rounds", type=int, default=2, help="runs per arm, the arms alternating")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed bare calls per bound and step")
    p.add_argument("--matmul", type=int, default=1024)
    args = p.parse_args(argv)
    if min(args.steps, args.threads, args.repeats, args.rounds) < 1:
        p.error("--steps, --rounds, --threads and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    print(f"{cpu_model()}; torch {torch.__version__}, {args.threads} thread(s); load average {os.getloadavg()}")
    arms: dict[str, list] = {"buckets": [], "padded": []}
    for _ in range(args.rounds):                       # whole runs, the arms alternating
        for name, rows in arms.items():
            tr = make_trainer(args, name == "buckets", rows)
            first = len(rows)
            tr.run()
            del rows[first]                            # each run's first step: warm-up
    bare = tr.unwrapped
    bounds: dict[str, list] = {"bound_fb": [], "bound_f": [], "padded_fb": [], "padded_f": []}
    for _, shape in arms["buckets"]:                  # each trained batch's own shape
        width = max(2, round(shape["mean_width"]))
        fb, f = update_ms(bare, shape["rows"], width, args.repeats, 1)
        pfb, pf = update_ms(bare, shape["rows"], shape["full_width"], args.repeats, 1)
        for key, v in zip(bounds, (fb, f, pfb, pf)):
            bounds[key].append(v / 1e3)
    peak = peak_flops(args.matmul, torch.float32, 10, 2)
    active = active_parameters(bare)
    med = {k: statistics.median(v) for k, v in bounds.items()}
    print(f"\npeak {peak / 1e9:,.1f} GFLOP/s ({args.matmul}^2 matmul); {active:,} active parameters a token")
    print(f"bare bound (rows x mean width, dense): forward + backward {med['bound_fb']:.4f} s, forward "
          f"{med['bound_f']:.4f} s; padded to the full width: {med['padded_fb']:.4f} s, {med['padded_f']:.4f} s\n")
    print("| arm | update U s | bound / U | pass O s | bound / O | update MFU | mean width | full width |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, rows in arms.items():
        timed = rows
        u = statistics.median(m["perf/time_update_s"] for m, _ in timed)
        o = statistics.median(m.get("perf/time_old_logp_s", float("nan")) for m, _ in timed)
        tokens = statistics.median(s["real_tokens"] for _, s in timed)
        mfu = 6 * active * tokens / u / peak
        print(f"| {name} | {u:.4f} | {med['bound_fb'] / u:.0%} | {o:.4f} | {med['bound_f'] / o:.0%} | {mfu:.2%} | "
              f"{statistics.median(s['mean_width'] for _, s in timed):.1f} | "
              f"{statistics.median(s['full_width'] for _, s in timed):.0f} |")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    sys.exit(main())
