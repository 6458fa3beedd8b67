"""Learnability probe of the ``longtail`` job (issue 44): the trainer with a learning rate per group of weights.

    python experiments/bench/probe_lr_groups.py --lr-mult self_attn=0 -- train --run-dir RUN KEY=VALUE ...

Runs the project's command line (``offpolicy-moe ...``, everything after ``--``) in this process with one change:
the RL optimizer (``offpolicy_moe.trainer.build.build_optimizer``) puts each trainable weight in a parameter group of
learning rate ``optim.lr * M``, ``M`` the multiplier of the first ``--lr-mult SUBSTRING=M`` whose substring is in
the weight's name (1 when none is).  ``M = 0`` holds the weight where it is: AdamW's update is ``lr`` times its
normalised moment, so a zero rate moves nothing.  The schedule (warm-up, decay) scales every group alike.

It answers the gradient probe's finding (``probe_gradient.py --hold``): on the longtail warm start a step of the
attention weights loses sampled reward at a learning rate the expert weights take without loss, so does RL learn
faster with the attention held or slowed?  A probe, not a trainer option: a run with PR2 predictors (their own
group) is refused, and a checkpoint holds the grouped optimizer's state, so resume such a run with this script.
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, Optional, Sequence

import torch

from offpolicy_moe import cli
from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.trainer import build


def parse_rules(items: Sequence[str]) -> list[tuple[str, float]]:
    """``["self_attn=0", "embed=0.1"]`` -> ``[("self_attn", 0.0), ("embed", 0.1)]``; ValueError naming the item
    for one without ``=``, an empty substring or a multiplier that is not a finite number >= 0."""
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        try:
            mult = float(value)
        except ValueError:
            mult = float("nan")
        if not sep or not key or not (math.isfinite(mult) and mult >= 0):
            raise ValueError(f"--lr-mult takes SUBSTRING=M with M a finite number >= 0, got {item!r}")
        out.append((key, mult))
    return out


def multiplier(name: str, rules: Sequence[tuple[str, float]]) -> float:
    """The learning-rate multiplier of the weight ``name``: the first rule whose substring it holds, else 1."""
    return next((m for key, m in rules if key in name), 1.0)


def grouped_param_groups(model: torch.nn.Module, lr: float,
                         rules: Sequence[tuple[str, float]]) -> list[dict[str, Any]]:
    """AdamW parameter groups of ``model``'s trainable weights, one per multiplier, each at ``lr * M``; ConfigError
    (the command line's one-line error) when a rule's substring is in no weight's name (a typo would otherwise train
    everything at ``lr``)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    unmatched = [key for key, _ in rules if not any(key in n for n, _ in named)]
    if unmatched:
        raise ConfigError(f"--lr-mult {unmatched[0]!r} is in no trainable weight's name")
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for n, p in named:
        groups.setdefault(multiplier(n, rules), []).append(p)
    return [{"params": ps, "lr": lr * m} for m, ps in sorted(groups.items())]


def grouped_optimizer(rules: Sequence[tuple[str, float]]) -> Callable:
    """A stand-in for ``build.build_optimizer`` with the groups of :func:`grouped_param_groups` (same AdamW
    settings, same schedule over ``trainer.steps * trainer.updates_per_step`` updates)."""

    def build_optimizer(model: torch.nn.Module, predictors: Optional[Any], cfg: Any) -> tuple[Any, Any]:
        if predictors is not None:
            raise ConfigError("probe_lr_groups.py does not group the PR2 predictors' weights; run it without PR2")
        params = grouped_param_groups(model, cfg.optim.lr, rules)
        optimizer = build.adamw(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                weight_decay=cfg.optim.weight_decay)
        sizes = {g["lr"] / cfg.optim.lr: sum(p.numel() for p in g["params"]) for g in params}
        print(f"learning-rate groups (multiplier: weights): {sizes}", file=sys.stderr)
        total = cfg.trainer.steps * cfg.trainer.updates_per_step
        return optimizer, build.lr_schedule(optimizer, cfg.optim.scheduler, cfg.optim.warmup_steps, total)

    return build_optimizer


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lr-mult", action="append", default=[], metavar="SUBSTRING=M",
                   help="weights whose name holds SUBSTRING train at optim.lr * M (0 holds them); the first match "
                        "wins")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the offpolicy-moe command line")
    a = p.parse_args(argv)
    try:
        rules = parse_rules(a.lr_mult)
    except ValueError as e:
        p.error(str(e))
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not rules:
        p.error("give at least one --lr-mult SUBSTRING=M (without one this is the plain command line)")
    if not command:
        p.error("give the offpolicy-moe command line after --")
    build.build_optimizer = grouped_optimizer(rules)     # build_run looks the builder up in its module
    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main())
