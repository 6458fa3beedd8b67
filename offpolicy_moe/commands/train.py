"""``offpolicy-moe train [CONFIG.yaml] [key=value ...] [--run-dir DIR] [--resume [--force-change]] [--quiet]``.

The config is resolved and validated before anything is written: a mistake is one line and exit code 2
(:mod:`offpolicy_moe.commands.errors`), with ``--dry-run`` or without. ``--resume`` follows
:mod:`offpolicy_moe.commands.resume`; the thread count follows :mod:`offpolicy_moe.commands.threads` and is said on
the first line of output.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from typing import TYPE_CHECKING

from offpolicy_moe.commands.errors import RunFailed, UsageError, warn
from offpolicy_moe.commands.threads import ThreadChoice, machine_threads
from offpolicy_moe.sources import fork_server

if TYPE_CHECKING:     # resume and the engine load torch, the config OmegaConf: imported where used (`--help` is fast)
    from offpolicy_moe.commands.resume import ResumePlan
    from offpolicy_moe.config.schema import TrainConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="YAML config (omit to use the defaults, or with --resume "
                                                           "the run's own config.yaml)")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. buffer.staleness=4")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in the run folder from its last checkpoint (its config.yaml is the base; "
                        "only keys that extend the run, e.g. trainer.steps, may change)")
    p.add_argument("--force-change", action="store_true",
                   help="with --resume: allow keys that change the run's meaning (recorded in segments.jsonl)")
    p.add_argument("--run-dir", default=None, help="run folder (overrides run_dir)")
    p.add_argument("--preset", action="append", default=[], help="algorithm preset to add (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve and validate the config (no model, no compute) and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines; warnings, errors and the "
                                                       "result line only")


def split_config_arg(config: Optional[str], overrides: list[str]) -> tuple[Optional[str], list[str]]:
    """A first positional that is ``key=value`` (no YAML given) joins the overrides."""
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config] + list(overrides)
    return config, list(overrides)


def build_config(config: str | None, overrides: list[str], run_dir: str | None = None, presets=()) -> TrainConfig:
    """Resolve the config: defaults < presets < YAML < key=value (< --run-dir)."""
    from offpolicy_moe.config.load import load_config

    config, overrides = split_config_arg(config, overrides)
    cfg = load_config(config, overrides, presets=list(presets))
    if run_dir is not None:
        cfg.run_dir = run_dir
    return cfg


def resolve(args: argparse.Namespace) -> tuple[TrainConfig, Optional[ResumePlan], Any]:
    """The checked config of this command, the resume plan with ``--resume`` (nothing is written), and what the
    checks built (``CheckedConfig``; None for ``--print-config`` alone, which only validates)."""
    from offpolicy_moe.config.validate import validate
    from offpolicy_moe.sources.modes import validate_run

    presets = getattr(args, "preset", [])
    if args.force_change and not args.resume:
        raise UsageError("--force-change only applies with --resume")
    plan = None
    if args.resume:
        from offpolicy_moe.commands.resume import plan_resume   # reads checkpoints (torch): only when resuming

        config, overrides = split_config_arg(args.config, args.overrides)
        run_dir = args.run_dir or (build_config(config, overrides, None, presets).run_dir if config else None)
        if run_dir is None:
            raise UsageError("--resume needs the run folder: --run-dir DIR (its config.yaml is reused)")
        plan = plan_resume(run_dir, config, overrides, presets, force_change=args.force_change)
        cfg = plan.config
        if plan.forced:
            warn(f"--force-change: {', '.join(plan.forced)} differ from the run's saved config; "
                 "recorded in segments.jsonl")
    else:
        cfg = build_config(args.config, args.overrides, args.run_dir, presets)
    if args.print_config and not args.dry_run:
        validate_run(cfg)           # with the batch source's rules (it imports the source class)
        return cfg, plan, None
    # a valid config that forks local rollout workers early starts their fork server now: its imports run on the
    # other core beside the checks, the trainer's imports and its model load (sources/fork_server.py); the batch
    # source's own rules follow in check_config, which imports the source class
    validate(cfg)
    if not args.dry_run:
        fork_server.start_early(cfg)
    # every check a start makes before compute (files, tokenizer, shapes, buffer, engine), once: a real start hands
    # the result to the trainer
    from offpolicy_moe.trainer.checks import check_config

    checked = check_config(cfg)
    for w in checked.warnings:
        warn(w)
    return cfg, plan, checked


def run(args: argparse.Namespace) -> int:
    cfg, plan, checked = resolve(args)
    if args.print_config:
        from offpolicy_moe.config.load import to_yaml

        print(to_yaml(cfg), end="")
    if args.dry_run:
        print(f"config OK: {'+'.join(cfg.preset) or 'defaults'}, {cfg.trainer.steps} steps -> {cfg.run_dir}",
              file=sys.stderr)
    if args.print_config or args.dry_run:
        return 0
    if args.quiet:
        cfg.logging.progress = False
    choice = machine_threads(cfg.trainer.threads, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process and not args.quiet:
        print(f"offpolicy-moe train: {choice.threads} CPU thread{'s' if choice.threads > 1 else ''} per process "
              f"(trainer.threads={choice.setting}: {choice.reason}); "
              f"{'resuming from step ' + str(plan.from_step) if plan else 'new run'} -> {cfg.run_dir}", flush=True)
    summary = train_segment(cfg, plan, choice, quiet=args.quiet, main_process=main_process, checked=checked)
    if not main_process:    # multi-process: the main process reports
        return 0 if summary["status"] == "completed" else 1
    final = summary.get("final", {})
    acc = final.get("eval/accuracy")
    print(f"{summary['status']}: {summary['steps']} steps in {summary['wall_time_s']:.1f}s"
          + (f" ({summary.get('segments', 1)} segments)" if summary.get("segments", 1) > 1 else "")
          + (f", eval/accuracy={acc:.3f}" if acc is not None else "") + f" -> {summary['run_dir']}")
    if summary["status"] != "completed":
        raise RunFailed(f"run {summary['status']}: {summary.get('error', '')}")
    return 0


def train_segment(cfg: TrainConfig, plan: Optional[ResumePlan], choice: ThreadChoice, *, quiet: bool,
                  main_process: bool, checked: Any = None) -> dict:
    """Train (or resume) ``cfg`` with ``choice.threads`` threads and return the cumulative summary; the segment is
    recorded even when training raises or is interrupted."""
    # the engine is imported here, not at module level: `offpolicy-moe --help` and config errors stay torch-free
    import torch

    from offpolicy_moe.commands.resume import prior_wall_time
    from offpolicy_moe.trainer.launch import train

    torch.set_num_threads(choice.threads)
    prior = prior_wall_time(cfg.run_dir) if plan is not None else 0.0
    started = time.time()
    try:
        with contextlib.ExitStack() as stack:
            if quiet:
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
            summary = train(cfg, resume=plan is not None, checked=checked)
    except SystemExit:      # a CPU relaunch: the relaunched processes recorded their own segment
        raise
    except BaseException:   # an error or Ctrl-C: the trainer has written summary.json; record the segment
        if main_process and _written_since(Path(cfg.run_dir) / "summary.json", started):
            _finish_segment(cfg, prior, started, plan, choice)
        raise
    if main_process:
        summary = _finish_segment(cfg, prior, started, plan, choice)
    return summary


def _finish_segment(cfg: TrainConfig, prior: float, started: float, plan: Optional[ResumePlan],
                    choice: ThreadChoice) -> dict:
    from offpolicy_moe.commands.resume import record_segment

    current = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    summary = record_segment(cfg.run_dir, current, prior_wall_s=prior, started=started, plan=plan,
                             threads=choice.as_dict())
    _record_threads(Path(cfg.run_dir), choice)
    return summary


def _written_since(path: Path, t: float) -> bool:
    return path.is_file() and path.stat().st_mtime >= t - 1.0


def _record_threads(run_dir: Path, choice: ThreadChoice) -> None:
    """Add the thread choice to ``env.json`` (written by the trainer at the start of the segment)."""
    p = run_dir / "env.json"
    try:
        info = json.loads(p.read_text())
    except (OSError, ValueError):
        return
    info["threads_choice"] = choice.as_dict()
    p.write_text(json.dumps(info, indent=2))
