"""Learnability probe of the ``longtail`` job (issue 44): does synchronous GRPO raise held-out accuracy?

    python experiments/bench/probe_longtail.py --seed 0 --lr 1e-4 --work runs/longtail_probe

One run of bench_tta.py's ``sync`` arm on ``--job longtail`` (the same overrides, :func:`bench_tta.job_overrides`,
and the same SFT warm start, :func:`bench_tta.cached_warm_start`, kept under ``--work``/warm so runs of one seed at
other learning rates share it; it is built under ``--work``/build-sft<N>, so warm starts of one seed with other
``--sft-steps`` do not collide), with the run folder kept; then the greedy final-answer accuracy of the held-out split
by number of terms, before (the warm start) and after (the run's final export).  Prints one markdown row for
experiments/results/tta/longtail/probes.md and writes ``--work``/<run>/probe.json.  Any other job key: ``--set
KEY=VALUE`` (trainer overrides), ``--steps``, ``--eval-every``, ``--sft-steps``, ``--max-new-tokens``; another task law
for the warm start and the run alike: ``--task-set task.KEY=VALUE``; a learning rate per group of weights:
``--lr-mult SUBSTRING=M`` (the run goes through probe_lr_groups.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from argparse import Namespace
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_tta  # noqa: E402
import probe_lr_groups  # noqa: E402
import torch  # noqa: E402

from offpolicy_moe.config.load import load_config  # noqa: E402
from offpolicy_moe.config.validate import validate  # noqa: E402
from offpolicy_moe.models.loading import load_policy  # noqa: E402
from offpolicy_moe.tasks import make_task  # noqa: E402
from offpolicy_moe.tasks.chain_sum import final_answer_reward  # noqa: E402
from offpolicy_moe.tasks.evaluation import greedy_completions  # noqa: E402
from offpolicy_moe.tasks.longtail import num_terms  # noqa: E402
from tta.analysis import parse_arms  # noqa: E402


def accuracy_by_terms(model_dir: str, overrides: list[str], max_new_tokens: int) -> dict:
    """``{"all": acc, "by_terms": {n: [acc, count]}}``: greedy final-answer accuracy on the held-out split of the
    job's task, by the number of terms of the prompt."""
    torch.set_num_threads(1)
    cfg = load_config(None, [o for o in overrides if o.startswith(("task.", "seed="))] + [f"model.path={model_dir}"])
    task = make_task(cfg.task)
    model, tok = load_policy(cfg.model, task=task)
    got = greedy_completions(model, tok, task.eval_prompts, max_new_tokens=max_new_tokens)
    right = final_answer_reward(got, task.eval_answers)
    by = defaultdict(list)
    for p, r in zip(task.eval_prompts, right):
        by[num_terms(p)].append(r)
    return {"all": sum(right) / len(right),
            "by_terms": {n: [sum(v) / len(v), len(v)] for n, v in sorted(by.items())}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-seed", type=int, default=None,
                   help="start from this seed's warm start (bench_tta.py --warm-seed): the seeds then vary the RL "
                        "run alone")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--model", action="append", default=[], metavar="model.KEY=VALUE",
                   help="a model.* override of the warm start (another size of the embedded preset); the run loads "
                        "the warm start's folder, so it trains that model")
    p.add_argument("--task-set", action="append", default=[], metavar="task.KEY=VALUE",
                   help="a task.* override of the job for the warm start and the run alike (e.g. task.length_tail); "
                        "the warm start gets its own cache key")
    p.add_argument("--lr-mult", action="append", default=[], metavar="SUBSTRING=M",
                   help="train the weights whose name holds SUBSTRING at lr * M (probe_lr_groups.py; 0 holds them)")
    p.add_argument("--work", required=True)
    a = p.parse_args(argv)
    job = bench_tta.JOBS["longtail"]
    bad = [m for m in a.model if not m.startswith("model.") or "=" not in m]
    if bad:
        p.error(f"--model takes model.KEY=VALUE, got {bad[0]!r}")
    bad = [t for t in a.task_set if not t.startswith("task.") or "=" not in t]
    if bad:
        p.error(f"--task-set takes task.KEY=VALUE, got {bad[0]!r}")
    try:
        probe_lr_groups.parse_rules(a.lr_mult)
    except ValueError as e:
        p.error(str(e))
    args = Namespace(job="longtail", prompts=16, group=8, eval_size=a.eval_size, warm_cache=str(Path(a.work) / "warm"),
                     model=a.model, task_set=a.task_set,
                     **{k: (getattr(a, k) if getattr(a, k) is not None else job[k])
                        for k in ("lr", "steps", "eval_every", "sft_steps", "max_new_tokens")})
    sync = parse_arms("sync")[0].overrides()          # preset=[grpo], buffer.mode=fixed, buffer.staleness=0
    try:       # the run's config without its warm start, and its task, checked before any work
        cfg = load_config(None, [*bench_tta.job_overrides(args, a.seed, None, a.threads), *a.model, *a.task_set,
                                 *sync, *a.set])
        validate(cfg)
        make_task(cfg.task)
    except ValueError as e:                            # ConfigError is one
        p.error(str(e))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0, load0 = time.time(), os.getloadavg()
    warm_seed = a.seed if a.warm_seed is None else a.warm_seed
    # the warm start is built in its own folder per SFT length (bench_tta.warm_start writes sft-<seed>/ and
    # warm-<seed>/ there), so a second SFT length of one seed does not collide with the first one's run folder
    warm, warm_s = bench_tta.cached_warm_start(args, warm_seed, work / f"build-sft{args.sft_steps}")
    name = (f"sync-seed{a.seed}" + (f"-warm{warm_seed}" if warm_seed != a.seed else "")
            + f"-lr{args.lr:g}-sft{args.sft_steps}-steps{args.steps}"
            + "".join(f"-{s}" for s in a.model + a.task_set + a.set) + "".join(f"-mult-{r}" for r in a.lr_mult))
    run_dir = work / name.replace("/", "_")
    over = bench_tta.job_overrides(args, a.seed, warm, a.threads) + [*a.task_set, *sync, "trainer.export_final=true",
                                                                      *a.set]
    launcher = [sys.executable, "-m", "offpolicy_moe"]
    if a.lr_mult:
        launcher = [sys.executable, str(HERE / "probe_lr_groups.py"), *(f"--lr-mult={r}" for r in a.lr_mult), "--"]
    cmd = [*launcher, "train", "--quiet", "--run-dir", str(run_dir), *over]
    t1 = time.time()
    rc = os.spawnvpe(os.P_WAIT, cmd[0], cmd, bench_tta._env(a.threads))
    run_s = time.time() - t1
    if rc != 0:
        raise SystemExit(f"run failed (rc={rc}): {' '.join(cmd)}")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    curve = [(r["step"], r["eval/reward"]) for r in rows if "eval/reward" in r]
    before = accuracy_by_terms(warm, over, args.max_new_tokens)
    after = accuracy_by_terms(str(run_dir / "export"), over, args.max_new_tokens)
    rec = {"seed": a.seed, "warm_seed": warm_seed, "lr": args.lr, "sft_steps": args.sft_steps, "steps": args.steps,
           "set": a.set, "model": a.model, "task_set": a.task_set, "lr_mult": a.lr_mult,
           "curve": curve, "before": before, "after": after, "warm_s": warm_s, "run_s": run_s,
           "wall_s": time.time() - t0, "load_before": load0, "load_after": os.getloadavg(), "command": cmd}
    (run_dir / "probe.json").write_text(json.dumps(rec, indent=1))
    by = " ".join(f"{n}:{before['by_terms'][n][0]:.2f}->{after['by_terms'][n][0]:.2f}"
                  for n in before["by_terms"])
    changes = " ".join([*a.task_set, *a.set, *(f"lr-mult {r}" for r in a.lr_mult)]) or "-"
    print(f"| {a.seed} (warm {warm_seed}) | {args.lr:g} | {args.sft_steps} | {args.steps} | {changes} | "
          f"{curve[0][1]:.3f} | {curve[-1][1]:.3f} | {max(v for _, v in curve):.3f} | "
          f"{' '.join(f'{v:.2f}' for _, v in curve)} | {by} | {warm_s:.0f} + {run_s:.0f} | "
          f"{' / '.join(f'{x:.2f}' for x in load0)} -> {' / '.join(f'{x:.2f}' for x in os.getloadavg())} |")


if __name__ == "__main__":
    main()
