"""``offpolicy-moe env``: versions, threads and devices, for bug reports."""
from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["environment_info", "add_arguments", "run"]


def __getattr__(name: str) -> Any:
    """``environment_info`` is the run folder's (:mod:`offpolicy_moe.run.run_dir`), imported on first use: that
    module imports torch, which ``offpolicy-moe --help`` does not."""
    if name == "environment_info":
        from offpolicy_moe.run.run_dir import environment_info

        return environment_info
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print as JSON")


def run(args: argparse.Namespace) -> int:
    from offpolicy_moe.run.run_dir import environment_info

    info = environment_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:>16}: {v}")
    return 0
