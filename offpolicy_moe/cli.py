"""Command-line entry point ``offpolicy-moe``.

Each subcommand lives in its own module under :mod:`offpolicy_moe.commands` and exposes
``add_arguments(parser)`` and ``run(args) -> int``.  Modules are imported lazily so that
``offpolicy-moe --help`` stays fast and a broken optional dependency only affects its command.

Every command shares one error path (:mod:`offpolicy_moe.commands.errors`): a user mistake is one line
``offpolicy-moe <command>: error: ...`` with exit code 2, a run that started and failed exits 1, Ctrl-C exits 130;
a warning, the command's or the library's, is one line ``offpolicy-moe <command>: warning: ...``, once per run.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from offpolicy_moe.commands import errors

COMMANDS = {
    "train": "Train a policy from a YAML config (plus key=value overrides).",
    "demo": "The embedded CPU demo: SFT warm start, then stale off-policy RL with TIS + R3.",
    "presets": "List algorithm presets, or print one resolved.",
    "sweep": "Run a grid of runs (algorithm x staleness x seed) into one sweep folder.",
    "table": "Aggregate a sweep folder into a table (mean +- std across seeds).",
    "plot": "Plot metric curves (mean and band across seeds) from a sweep folder.",
    "env": "Print versions, threads and devices (paste it into bug reports).",
    "export": "Write a run's trained policy as a Hugging Face folder (safetensors, tokenizer, generation config).",
    "eval": "Evaluate a run's checkpoint or a model folder on a task: greedy accuracy, avg@n, pass@k, maj@k.",
}


def build_parser() -> argparse.ArgumentParser:
    parser = errors.OneLineParser(
        prog="offpolicy-moe",
        description="RL for Mixture-of-Experts LLMs on stale, off-policy data.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=errors.OneLineParser)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(f"offpolicy_moe.commands.{name}")
        except ModuleNotFoundError as exc:  # command not built yet / optional dependency missing
            if exc.name and exc.name.startswith("offpolicy_moe.commands"):
                p.set_defaults(_unavailable=name)
                continue
            raise
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # `key=value` overrides may come after options (`sweep exp.yaml --jobs 2 seed=3`); argparse stops
        # collecting a positional list at the first option, so pick the leftovers up here.
        if hasattr(args, "overrides") and all("=" in tok and not tok.startswith("-") for tok in extra):
            args.overrides = list(args.overrides) + extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"offpolicy-moe {args.command}: error: this command is not available in this build", file=sys.stderr)
        return 2
    try:
        with errors.WarningLines(args.command).capture():
            return int(args._run(args) or 0)
    except BrokenPipeError:     # the reader went away (`offpolicy-moe presets | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error when Python flushes
        return 0
    except (Exception, KeyboardInterrupt) as exc:
        code = errors.exit_code(exc)
        if code is None:       # not a known failure class: a bug, keep the traceback
            raise
        if isinstance(exc, KeyboardInterrupt):   # a graceful stop says where it stopped and how to continue
            print(f"offpolicy-moe {args.command}: {errors.one_line(exc) if str(exc).strip() else 'interrupted'}",
                  file=sys.stderr)
        else:
            print(errors.error_line(args.command, exc), file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
