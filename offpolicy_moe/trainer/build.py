"""How the trainer's parts are built from the config: the routing controller, the optimizer with its learning-rate
schedule, the synchronous source's rollout engine, the batch source of ``buffer.mode``, the frozen reference
policy of the KL penalty and the run's one old-log-prob strategy (the only reader of ``algo.old_logp_source``)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch

from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.rollout.engine import REPLAY_ENGINE, make_engine
from offpolicy_moe.run.full_state import is_sharded
from offpolicy_moe.routing import PR2Predictors, RoutingController, pr2_param_group
from offpolicy_moe.sources.asynchronous import AsyncBatchSource
from offpolicy_moe.sources.base import BatchSource
from offpolicy_moe.sources.sync import SyncBatchSource
from offpolicy_moe.trainer.old_logp import OldLogpPass
from offpolicy_moe.trainer.old_logp_strategy import (AtConsumption, FromEngine, Fused, Loglinear, OldLogpStrategy,
                                                     Recomputed)
from offpolicy_moe.trainer.optim import adamw, lr_schedule

__all__ = ["routing_controller", "build_optimizer", "build_engine", "build_source", "frozen_reference",
           "fuses_old_logp", "old_logp_strategy"]


def routing_controller(model: torch.nn.Module, cfg: Any, *, is_moe: bool,
                       measure_routing: bool) -> Optional[RoutingController]:
    """The actor's routing controller (replay, recording, routing metrics; None for a dense model or when routes
    are neither replayed nor measured), and gradient checkpointing that replays the forward's routes in the
    recompute."""
    rt = cfg.algo.routing
    controller = None
    if is_moe and (rt.replay != "none" or measure_routing):
        controller = RoutingController(model)
    if cfg.model.gradient_checkpointing:
        if controller is not None:
            controller.enable_gradient_checkpointing(model)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return controller


def build_optimizer(model: torch.nn.Module, predictors: Optional[PR2Predictors], cfg: Any) -> tuple[Any, Any]:
    """AdamW over the policy's trainable parameters (and the PR2 predictors' own parameter group) and its
    learning-rate schedule over ``trainer.steps * trainer.updates_per_step`` optimizer updates."""
    params = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.optim.lr}]
    if predictors is not None:
        params.append(pr2_param_group(predictors, cfg.optim.lr, cfg.algo.routing.pr2_lr_mult))
    optimizer = adamw(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay)
    total_updates = cfg.trainer.steps * cfg.trainer.updates_per_step
    return optimizer, lr_schedule(optimizer, cfg.optim.scheduler, cfg.optim.warmup_steps, total_updates)


def build_engine(model: torch.nn.Module, tok: Any, cfg: Any, predictors: Optional[PR2Predictors], *, is_moe: bool,
                 measure_routing: bool, device: Any) -> Any:
    """The rollout engine of ``rollout.engine`` over its own copy of ``model``: recording routes when they are
    replayed or measured, applying the PR2 predictors' router offsets when there are predictors."""
    rt = cfg.algo.routing
    offsets = None
    if predictors is not None:
        offsets = {"pr2_predictors": predictors, "pr2_in_weights": rt.pr2_bias_in_weights,
                   "pr2_feature_sample_rate": rt.pr2_feature_sample_rate}
    record = is_moe and (rt.replay in REPLAY_ENGINE or measure_routing)
    return make_engine(model, tok, cfg.rollout, record_routes=record, router_offsets=offsets, device=device,
                       seed=cfg.seed)


def build_source(cfg: Any, *, engine: Any, task: Any, model: torch.nn.Module, prepare: Callable,
                 on_nonfinite: Callable, rank: int, world: int) -> BatchSource:
    """The batch source of ``buffer.mode``: workers for ``async`` (Ray actors with ``rollout.backend=ray``), this
    process's ``engine`` otherwise; ``prepare`` takes a batch's old log-probs, ``on_nonfinite`` applies
    ``trainer.on_nan`` to a non-finite batch."""
    if cfg.buffer.mode == "async":
        # (with rollout.backend=ray a non-finite batch raises out of the source: the run stops as diverged under
        # either policy)
        return AsyncBatchSource(cfg, model=model, prepare=prepare, rank=rank, world=world,
                                on_nonfinite=None if cfg.rollout.backend == "ray" else on_nonfinite)
    return SyncBatchSource(cfg, engine=engine, task=task, prepare=prepare, rank=rank, world=world,
                           on_nonfinite=on_nonfinite)


def frozen_reference(model: torch.nn.Module, state: Optional[dict] = None) -> torch.nn.Module:
    """The frozen reference policy of the KL penalty: a copy of ``model`` (with the weights ``state`` when given) in
    eval mode without gradients; refused for a sharded (FSDP) model, which cannot give a copy yet."""
    if is_sharded(model):
        raise ConfigError("algo.kl.coef > 0 needs a frozen copy of the policy, which a sharded (FSDP) model "
                          "cannot give yet; use DDP or set algo.kl.coef=0")
    ref = copy.deepcopy(model).eval()
    if state is not None:
        ref.load_state_dict(state)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def fuses_old_logp(cfg: Any, *, measure_routing: bool, needs_global_pass: bool) -> bool:
    """True when the recompute pass after generation is redundant, so the update forward gives the old log-probs:
    ``trainer.fuse_old_logp``, ``old_logp_source=trainer``, fixed staleness 0, one update per step, no correction
    weights, no global selection pass (``needs_global_pass``, e.g. M2PO's: it needs them before the update
    forward), routing none or R3, and routing measurements only without replay (they record the update forward's
    routes; a batch of several micro-batches then still gets the pass).  Under R3 the "with R3" counterfactual
    mismatch keeps its one replayed pass (with ``trainer.mismatch_metrics``)."""
    replay = cfg.algo.routing.replay
    return (bool(getattr(cfg.trainer, "fuse_old_logp", True))
            and cfg.algo.old_logp_source == "trainer" and cfg.buffer.mode == "fixed" and cfg.buffer.staleness == 0
            and cfg.trainer.updates_per_step == 1 and cfg.algo.correction.mode == "none"
            and replay in ("none", "r3") and (not measure_routing or replay == "none")
            and not needs_global_pass)


def old_logp_strategy(cfg: Any, passes: OldLogpPass, *, needs_global_pass: bool,
                      device: Any) -> OldLogpStrategy:
    """The run's old-log-prob strategy (:mod:`~offpolicy_moe.trainer.old_logp_strategy`), from
    ``algo.old_logp_source`` and ``algo.proximal_logp``: the engine's, the loglinear proximal estimate, a recompute
    at consumption, fused with the update (:func:`fuses_old_logp`) or the pass after generation."""
    src, corr = cfg.algo.old_logp_source, cfg.algo.correction
    if src == "engine":
        return FromEngine(passes, corr, device)
    if src == "proximal" and cfg.algo.proximal_logp == "loglinear":
        return Loglinear(passes, corr, device, cfg.trainer.updates_per_step)
    if src == "proximal":
        return AtConsumption(passes, corr, device)
    if fuses_old_logp(cfg, measure_routing=passes.measure_routing, needs_global_pass=needs_global_pass):
        return Fused(passes, corr, device)
    return Recomputed(passes, corr, device)
