"""``offpolicy-moe env``: versions, threads and devices, for bug reports."""
from __future__ import annotations

import argparse
import json
import platform


def environment_info() -> dict:
    """Versions of the libraries a run depends on, the torch thread count and the devices."""
    import importlib.metadata as md

    import torch

    info = {
        "offpolicy_moe": md.version("offpolicy_moe") if _has("offpolicy_moe") else "source",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    for pkg in ("torch", "transformers", "accelerate", "datasets", "tokenizers", "omegaconf", "wandb"):
        info[pkg] = md.version(pkg) if _has(pkg) else None
    return info


def _has(pkg: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(pkg)
        return True
    except md.PackageNotFoundError:
        return False


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
