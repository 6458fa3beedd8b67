"""``offpolicy-moe export RUN_DIR OUT_DIR [--step N] [--force]``: the trained policy as a Hugging Face folder."""
from __future__ import annotations

import argparse

from offpolicy_moe.commands.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``export``."""
    p.add_argument("run_dir", help="run folder (holds config.yaml and checkpoints/)")
    p.add_argument("out_dir", help="folder to write (config.json, model.safetensors, tokenizer, generation config)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest intact)")
    p.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")


def run(args: argparse.Namespace) -> int:
    """Export through the one error path: a missing run folder or checkpoint step, or a non-empty ``OUT_DIR``, is a
    user mistake (rc 2); a damaged or unsafe checkpoint is a :class:`CheckpointError` (rc 1)."""
    # the engine loads torch: imported when the command runs, so `offpolicy-moe --help` stays fast
    from offpolicy_moe.run.export import export_run

    try:
        out = export_run(args.run_dir, args.out_dir, step=args.step, overwrite=args.force)
    except (FileNotFoundError, FileExistsError) as exc:
        raise UsageError(str(exc)) from None
    print(f"exported -> {out} (load with AutoModelForCausalLM.from_pretrained / AutoTokenizer.from_pretrained)")
    return 0
