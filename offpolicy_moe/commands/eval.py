"""``offpolicy-moe eval PATH [key=value ...] [--step N | --best METRIC] [--config FILE] [--task NAME] [--samples N] [--k K ...]
[--temperature T] [--top-p P] [--top-k K] [--seed S] [--out FILE.json]``: the greedy accuracy and the sampled metrics
(avg@n, pass@k, maj@k; docs/evaluation.md) of a trained policy on a task.

``PATH`` is a run folder (``config.yaml``: its newest intact checkpoint, ``--step N``, or ``--best METRIC``: the
checkpoint whose step logged the highest METRIC) or a Hugging Face model
folder (``config.json``: ``offpolicy-moe export``'s, a run's ``export/``, any local transformers model).  The task is
the run's own (for a model folder: the default task, or the ``task`` section of ``--config``); ``--task NAME`` and
``task.*=...`` overrides choose another, as ``train`` takes them (docs/tasks.md).  The sampling settings are the
``eval`` section's (``--samples``, ``--temperature``, ``--top-p``, ``--top-k``, ``--seed`` override it); with the
run's own settings a checkpoint gives the numbers the run logged at its step.

Every mistake is one line and exit code 2 before any weights are read (:mod:`offpolicy_moe.commands.errors`).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

from offpolicy_moe.commands.errors import UsageError
from offpolicy_moe.commands.threads import machine_threads

#: samples per problem when neither --samples nor the config's eval.samples says
DEFAULT_SAMPLES = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``eval``."""
    p.add_argument("path", help="a run folder (config.yaml, checkpoints/) or a Hugging Face model folder (config.json)")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides of the task, rollout and eval keys, "
                                                           "e.g. task.name=jsonl:my.jsonl eval.top_p=0.95")
    p.add_argument("--step", type=int, default=None, help="run folder: the checkpoint step (default: the newest)")
    p.add_argument("--best", default=None, metavar="METRIC",
                   help="run folder: the checkpoint whose step logged the highest METRIC (e.g. eval/accuracy or "
                        "eval/avg@16; a tie goes to the later step)")
    p.add_argument("--config", default=None, help="model folder: a YAML whose task, rollout and eval keys apply "
                                                  "(e.g. the run's config.yaml)")
    p.add_argument("--task", default=None, help="the task (as task.name: arithmetic, dataset:<source>, "
                                                "jsonl:<file>, ...; docs/tasks.md)")
    p.add_argument("--samples", type=int, default=None,
                   help=f"n samples per held-out problem (default: eval.samples, else {DEFAULT_SAMPLES})")
    p.add_argument("--k", type=int, action="append", default=None,
                   help="report pass@k and maj@k at this k (repeatable; default 1, 2, 4, ..., n)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (eval.temperature)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling (eval.top_p)")
    p.add_argument("--top-k", type=int, default=None, help="top-k sampling, 0 = off (eval.top_k)")
    p.add_argument("--seed", type=int, default=None, help="the sampler's seed (eval.seed)")
    p.add_argument("--out", default=None, help="write the result as JSON to this file")


def _overrides(args: argparse.Namespace) -> list[str]:
    """The ``key=value`` overrides, with the options that stand for keys."""
    out = list(args.overrides)
    if args.task is not None:
        out.append(f"task.name={args.task}")
    for key, value in (("eval.temperature", args.temperature), ("eval.top_p", args.top_p),
                       ("eval.top_k", args.top_k), ("eval.seed", args.seed)):
        if value is not None:
            out.append(f"{key}={value}")
    return out


def _config(args: argparse.Namespace, path: Path, overrides: list[str]) -> tuple[str, Any, Any]:
    """``(kind, evaluation config, the run's saved config or None)`` of ``path``."""
    from offpolicy_moe.config.load import load_config     # OmegaConf: imported when the command runs, as train does

    if (path / "config.yaml").is_file():
        if args.step is not None and args.best is not None:
            raise UsageError("--step and --best both choose the checkpoint: give one")
        if args.config is not None:
            raise UsageError(f"--config applies to a model folder; the run folder {str(path)!r} is evaluated with "
                             "its own config.yaml (change its keys with key=value)")
        model_keys = [o.split("=", 1)[0] for o in overrides if o.startswith("model.")]
        if model_keys:
            raise UsageError(f"{model_keys[0]}: a run folder's model is the one its checkpoints fit; evaluate an "
                             "exported folder to load another")
        return "run", load_config(path / "config.yaml", overrides), load_config(path / "config.yaml")
    if (path / "config.json").is_file():
        if args.step is not None or args.best is not None:
            option = "--step" if args.step is not None else "--best"
            raise UsageError(f"{option} applies to a run folder; {str(path)!r} is a model folder (config.json)")
        cfg = load_config(args.config, overrides)
        cfg.model.path = str(path)
        return "model", cfg, None
    raise UsageError(f"{str(path)!r} is neither a run folder (config.yaml) nor a Hugging Face model folder "
                     "(config.json)")


def resolve(args: argparse.Namespace) -> tuple[Any, Optional[list[int]]]:
    """The evaluation target (``EvalTarget`` fields as a dict) and the ``k`` to report, every check of the command
    line made: n >= 1 and every k <= n, a path that is a run or a model folder, a valid config."""
    from offpolicy_moe.config.validate import validate

    if args.samples is not None and args.samples < 1:
        raise UsageError(f"--samples must be >= 1 (samples per held-out problem), got {args.samples}")
    path = Path(args.path)
    if not path.exists():
        raise UsageError(f"{str(path)!r} does not exist")
    if args.out is not None and Path(args.out).is_dir():
        raise UsageError(f"--out {args.out!r} is a folder; give a file name")
    kind, cfg, saved = _config(args, path, _overrides(args))
    cfg.eval.samples = int(args.samples if args.samples is not None else cfg.eval.samples or DEFAULT_SAMPLES)
    from offpolicy_moe.trainer.eval_run import check_ks      # loads torch, before any weights are read

    try:
        ks = check_ks(cfg.eval.samples, args.k)
    except ValueError as exc:
        raise UsageError(f"{exc} (--samples {cfg.eval.samples}, --k {', '.join(map(str, args.k or []))})") from None
    validate(cfg)
    step = args.step
    if args.best is not None:
        from offpolicy_moe.run.export import best_checkpoint_step

        try:
            step = best_checkpoint_step(path, args.best)
        except FileNotFoundError as exc:
            raise UsageError(str(exc)) from None
    return {"kind": kind, "path": path, "cfg": cfg, "saved": saved, "step": step}, ks


def _num(x: Optional[float], digits: int = 4) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def format_table(result: dict) -> str:
    """The one-screen summary of a result record (:meth:`~offpolicy_moe.trainer.eval_run.EvalResult.to_dict`)."""
    ev, st, m, sec = result["evaluated"], result["settings"], result["metrics"], result["seconds"]
    n, ks = st["samples"], st["ks"]
    what = f"{ev['path']} ({ev['checkpoint']})" if ev["checkpoint"] else f"{ev['path']} (model folder)"
    rows = [("greedy accuracy", _num(m["eval/accuracy"])), (f"avg@{n}", _num(m[f"eval/avg@{n}"]))]
    rows += [(f"pass@{k}", _num(m[f"eval/pass@{k}"])) for k in ks]
    rows.append((f"maj@{ks[-1]}", _num(m[f"eval/maj@{ks[-1]}"])))
    scored = int(m["eval/scored_problems"])
    rows += [("unscorable references", f"{int(m['eval/unscorable_refs'])} of {ev['held_out_problems']} problems"),
             ("no answer", f"{int(m['eval/no_answer'])} of {scored * n} responses"),
             ("seconds", f"{sec['total']:.2f} (load {sec['load']:.2f}, greedy {sec['greedy']:.2f}, "
                         f"sampled {sec['sampled']:.2f})")]
    head = [f"offpolicy-moe eval: {what}, task {ev['task']}: {ev['held_out_problems']} held-out problems, "
            f"{n} samples each",
            f"  temperature {st['temperature']}, top_p {st['top_p']}, top_k {st['top_k']}, seed {st['seed']}, "
            f"{st['dtype']} on {st['device']}", ""]
    width = max(len(name) for name, _ in rows)
    return "\n".join(head + [f"  {name:<{width}}  {value}" for name, value in rows])


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float as None (strict JSON)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def run(args: argparse.Namespace) -> int:
    """Evaluate (module docstring): the table on stdout, the JSON record in ``--out``."""
    fields, ks = resolve(args)
    # the engine loads torch: imported when the command runs, so `offpolicy-moe --help` stays fast
    import torch

    from offpolicy_moe.trainer.eval_run import EvalTarget, evaluate_target

    torch.set_num_threads(machine_threads(fields["cfg"].trainer.threads).threads)
    record = _finite(evaluate_target(EvalTarget(**fields), ks=ks).to_dict())
    print(format_table(record))
    if args.out is not None:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n")
        print(f"-> {out}", file=sys.stderr)
    return 0
