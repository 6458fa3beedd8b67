"""``offpolicy-moe train CONFIG.yaml [key=value ...] [--resume] [--run-dir DIR]``."""
from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="YAML config (omit to use the defaults)")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. buffer.staleness=4")
    p.add_argument("--resume", action="store_true", help="continue the run in the run folder from its last checkpoint")
    p.add_argument("--run-dir", default=None, help="run folder (overrides run_dir)")
    p.add_argument("--preset", action="append", default=[], help="algorithm preset to add (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="resolve and validate the config (no model, no compute) and exit")


def build_config(config: str | None, overrides: list[str], run_dir: str | None = None, presets=()):
    """Resolve the config: defaults < presets < YAML < key=value (< --run-dir)."""
    from offpolicy_moe.config.load import load_config

    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        overrides = [config] + list(overrides)   # no YAML given, only overrides
        config = None
    cfg = load_config(config, overrides, presets=list(presets))
    if run_dir is not None:
        cfg.run_dir = run_dir
    return cfg


def run(args: argparse.Namespace) -> int:
    from offpolicy_moe.config.validate import ConfigError
    from offpolicy_moe.engine.checkpoint import CheckpointError
    from offpolicy_moe.engine.faults import NonFiniteLossError, RunDirError

    try:
        cfg = build_config(args.config, args.overrides, args.run_dir, getattr(args, "preset", []))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"offpolicy-moe train: config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config or args.dry_run:
        from offpolicy_moe.config.load import to_yaml
        from offpolicy_moe.config.validate import validate

        try:
            warnings = validate(cfg)
        except ConfigError as exc:
            print(f"offpolicy-moe train: config error: {exc}", file=sys.stderr)
            return 2
        for w in warnings:
            print(f"offpolicy-moe: warning: {w}", file=sys.stderr)
        if args.print_config:
            print(to_yaml(cfg), end="")
        if args.dry_run:
            print(f"config OK: {'+'.join(cfg.preset) or 'defaults'}, {cfg.trainer.steps} steps -> {cfg.run_dir}",
                  file=sys.stderr)
        return 0
    try:
        from offpolicy_moe.engine.launch import train

        summary = train(cfg, resume=args.resume)
    except (ConfigError, RunDirError, CheckpointError, NonFiniteLossError, ValueError, FileNotFoundError) as exc:
        print(f"offpolicy-moe train: error: {exc}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) != 0:    # multi-process: the main process reports
        return 0 if summary["status"] == "completed" else 1
    final = summary.get("final", {})
    acc = final.get("eval/accuracy")
    print(f"{summary['status']}: {summary['steps']} steps in {summary['wall_time_s']:.1f}s"
          + (f", eval/accuracy={acc:.3f}" if acc is not None else "") + f" -> {summary['run_dir']}")
    return 0 if summary["status"] == "completed" else 1
