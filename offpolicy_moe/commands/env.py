"""``offpolicy-moe env``: versions, threads and devices, for bug reports."""
from __future__ import annotations

import argparse
import json

from offpolicy_moe.run.run_dir import environment_info

__all__ = ["environment_info", "add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print as JSON")


def run(args: argparse.Namespace) -> int:
    info = environment_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:>16}: {v}")
    return 0
