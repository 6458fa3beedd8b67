"""``offpolicy-moe export RUN_DIR OUT_DIR [--step N] [--force]``: the trained policy as a Hugging Face folder."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``export``."""
    p.add_argument("run_dir", help="run folder (holds config.yaml and checkpoints/)")
    p.add_argument("out_dir", help="folder to write (config.json, model.safetensors, tokenizer, generation config)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest intact)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")


def run(args: argparse.Namespace) -> int:
    """Export; one-line error and rc 1 on a bad run folder, checkpoint or output folder."""
    from offpolicy_moe.config.validate import ConfigError
    from offpolicy_moe.engine.checkpoint import CheckpointError
    from offpolicy_moe.engine.export import export_run

    try:
        out = export_run(args.run_dir, args.out_dir, step=args.step, overwrite=args.force)
    except (ConfigError, CheckpointError, FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"offpolicy-moe export: error: {exc}", file=sys.stderr)
        return 1
    print(f"exported -> {out} (load with AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained)")
    return 0
