"""A run's parts, built from the config in one place (:func:`build_run`).

This is where a run's choices are made: the loss (:func:`~offpolicy_moe.trainer.update.loss_setup` of
``algo.loss``), where its old log-probs come from (:func:`old_logp_strategy`, the only reader of
``algo.old_logp_source``), the batch source of ``buffer.mode`` and the preparation stage it hands batches to, the
routing controller, the optimizer and its schedule, the rollout engine (and the sampled evaluation's, with
``eval.samples`` > 0), and the frozen reference of the KL penalty."""
from __future__ import annotations

import copy
import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.models import is_moe, load_policy
from offpolicy_moe.rollout.engine import REPLAY_ENGINE, make_engine
from offpolicy_moe.routing import PR2Predictors, RoutingController, pr2_param_group
from offpolicy_moe.run.full_state import is_sharded
from offpolicy_moe.run.nonfinite import NanCounter
from offpolicy_moe.run.run_dir import RunDir
from offpolicy_moe.sources import fork_server
from offpolicy_moe.sources.base import BatchSource
from offpolicy_moe.sources.modes import source_class
from offpolicy_moe.tasks import apply_chat_template, make_task
from offpolicy_moe.trainer.checks import CheckedConfig, check_config
from offpolicy_moe.logprobs.forward import RoutedForward
from offpolicy_moe.logprobs.micro_batch import MicroBatching, max_over_processes
from offpolicy_moe.logprobs import (AtConsumption, FromEngine, Fused, Loglinear, OldLogpPass, OldLogpStrategy,
                                    PreparationStage, Recomputed, engine_logp_exact)
from offpolicy_moe.trainer.optim import adamw, lr_schedule
from offpolicy_moe.trainer.run_checkpoints import RunCheckpoints
from offpolicy_moe.trainer.sampled_eval import SampledEvaluator
from offpolicy_moe.trainer.update import PolicyUpdate, TrainedPolicy, loss_setup

__all__ = ["build_run", "RunParts", "routing_controller", "build_optimizer", "build_engine", "build_source",
           "frozen_reference", "fuses_old_logp", "old_logp_strategy", "past_versions_kept", "seed_everything"]


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


def build_source(cfg: Any, *, engine: Any, task: Any, model: torch.nn.Module, stage: PreparationStage, rank: int,
                 world: int, pad_id: int = 0) -> BatchSource:
    """The batch source of ``buffer.mode`` (:func:`~offpolicy_moe.sources.modes.source_class`), built from what the
    trainer made (``engine`` is None when the source's workers build their own); it hands its batches to
    ``stage``."""
    return source_class(cfg).build(cfg, engine=engine, task=task, model=model, stage=stage, rank=rank, world=world,
                                   pad_id=pad_id)


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
    ``trainer.fuse_old_logp``, ``old_logp_source=trainer``, an on-policy source (fixed staleness 0), one update per step, no correction
    weights, no global selection pass (``needs_global_pass``, e.g. M2PO's: it needs them before the update
    forward), routing none or R3, and routing measurements only without replay (they record the update forward's
    routes; a batch of several micro-batches then still gets the pass).  Under R3 the "with R3" counterfactual
    mismatch keeps its one replayed pass (with ``trainer.mismatch_metrics``)."""
    replay = cfg.algo.routing.replay
    return (bool(getattr(cfg.trainer, "fuse_old_logp", True))
            and cfg.algo.old_logp_source == "trainer" and source_class(cfg).on_policy(cfg)
            and cfg.trainer.updates_per_step == 1 and cfg.algo.correction.mode == "none"
            and replay in ("none", "r3") and (not measure_routing or replay == "none")
            and not needs_global_pass)


def old_logp_strategy(cfg: Any, passes: OldLogpPass, *, needs_global_pass: bool, device: Any,
                      model: Optional[torch.nn.Module] = None) -> OldLogpStrategy:
    """The run's old-log-prob strategy (:mod:`~offpolicy_moe.logprobs.strategies`), from
    ``algo.old_logp_source`` and ``algo.proximal_logp``: the engine's, the loglinear proximal estimate, a recompute
    at consumption (on ``model``), fused with the update (:func:`fuses_old_logp`) or the pass after generation."""
    src, corr = cfg.algo.old_logp_source, cfg.algo.correction
    if src == "engine":
        return FromEngine(passes, corr, device, model)
    if src == "proximal" and cfg.algo.proximal_logp == "loglinear":
        return Loglinear(passes, corr, device, model, cfg.trainer.updates_per_step)
    if src == "proximal":
        return AtConsumption(passes, corr, device, model)
    if fuses_old_logp(cfg, measure_routing=passes.measure_routing, needs_global_pass=needs_global_pass):
        return Fused(passes, corr, device, model)
    return Recomputed(passes, corr, device, model)


def past_versions_kept(cfg: Any) -> int:
    """How many published versions the preparation stage keeps: what the batch source asks for
    (:meth:`~offpolicy_moe.sources.base.BatchSource.keeps_versions`: ``k + 1`` for workers that sample ahead, the one
    generation holds when it lags behind the trainer with ``rollout.publish_every`` > 1, else none)."""
    return source_class(cfg).keeps_versions(cfg)


@dataclass
class RunParts:
    """Everything :func:`build_run` makes for one run; the :class:`~offpolicy_moe.trainer.trainer.Trainer` holds
    them and runs the loop."""

    cfg: Any
    run_dir: RunDir
    accelerator: Accelerator
    task: Any
    tok: Any
    chat: Any
    is_moe: bool
    controller: Optional[RoutingController]
    predictors: Optional[PR2Predictors]
    optimizer: Any
    scheduler: Any
    model: torch.nn.Module           # as the accelerator prepared it (DDP / FSDP wrapper)
    unwrapped: torch.nn.Module       # the bare policy
    engine: Any                      # the synchronous source's rollout engine (None for workers)
    forward: RoutedForward
    stage: PreparationStage
    policy_update: PolicyUpdate
    source: BatchSource
    run_checkpoints: RunCheckpoints
    nan: NanCounter
    sampled_eval: Optional[SampledEvaluator] = None     # eval.samples > 0: the sampled evaluation's own engine


def build_run(cfg: Any, *, resume: bool = False, checked: Optional[CheckedConfig] = None) -> RunParts:
    """Every part of a run, from a :class:`~offpolicy_moe.config.schema.TrainConfig`: the run folder (its lock held),
    the accelerator, task and policy, routing, optimizer, rollout engine, the routed forward, the loss and the
    old-log-prob strategy (chosen here and nowhere else), the preparation stage, the policy update and the batch
    source.  ``checked``: what :func:`~offpolicy_moe.trainer.checks.check_config` returned (the checks run here
    without it)."""
    tc, rt = cfg.trainer, cfg.algo.routing
    run_dir = RunDir(cfg.run_dir, min_free_mb=tc.min_free_mb, resume=resume,
                     is_main=int(os.environ.get("RANK", "0")) == 0)      # the global rank's main process locks it
    set_determinism(tc)
    if checked is None:
        checked = check_config(cfg)
        for w in checked.warnings:
            print(f"offpolicy-moe: warning: {w}", file=sys.stderr)
    fork_server.start_early(cfg)        # local workers' imports run beside the model load
    accelerator = make_accelerator()
    world, rank = accelerator.num_processes, accelerator.process_index
    seed_everything(cfg.seed)
    task = checked.task if checked.task is not None else make_task(cfg.task)
    model, tok = load_policy(cfg.model, seed=cfg.seed, task=task, progress=cfg.logging.progress)
    chat = apply_chat_template(task, tok, cfg.task.chat_template)
    moe = bool(is_moe(model))
    if not moe and rt.replay != "none":
        raise ValueError(f"algo.routing.replay={rt.replay!r} needs a Mixture-of-Experts model, but "
                         f"{type(model).__name__} has no MoE layer (model.preset={cfg.model.preset!r})")
    measure_routing = moe and bool(rt.metrics)
    model.train()
    controller = routing_controller(model, cfg, is_moe=moe, measure_routing=measure_routing)
    predictors = PR2Predictors.from_controller(controller) if rt.replay == "pr2" else None
    optimizer, scheduler = build_optimizer(model, predictors, cfg)
    if predictors is not None:
        predictors.to(accelerator.device)
    # the synchronous source's engine: its own copy of the bare model, before FSDP can shard it
    engine = (build_engine(model, tok, cfg, predictors, is_moe=moe, measure_routing=measure_routing,
                           device=accelerator.device) if source_class(cfg).builds_engine else None)
    # eval.samples > 0: the sampled evaluation's engine, its own copy of the bare model (synced at each evaluation)
    sampled = (SampledEvaluator.build(model, tok, cfg, device=accelerator.device) if cfg.eval.samples > 0
               else None)
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    bare = accelerator.unwrap_model(wrapped)
    forward = RoutedForward(device=accelerator.device, controller=controller, replay=rt.replay,
                            share_prompt=tc.share_prompt, temperature=cfg.rollout.temperature,
                            group_size=cfg.rollout.group_size,
                            micro_batching=MicroBatching.from_trainer(
                                tc, max_over_processes(accelerator.device) if world > 1 else None, bare.config))
    loss = loss_setup(cfg.algo.loss, world)
    passes = OldLogpPass(forward, cfg, is_moe=moe, measure_routing=measure_routing)
    strategy = old_logp_strategy(cfg, passes, needs_global_pass=loss.spec.needs_global_pass,
                                 device=accelerator.device, model=bare)
    # workers' engines sample every token under its own version: where their log-probs are exact, the stage takes
    # them and skips the pass (an in-process source keeps its pass: its numbers must not move)
    engine_exact = (not source_class(cfg).builds_engine
                    and engine_logp_exact(cfg, is_moe=moe, measure_routing=measure_routing))
    stage = PreparationStage(strategy, model=bare, forward=forward, accelerator=accelerator,
                             keep=past_versions_kept(cfg), engine_exact=engine_exact)
    policy = TrainedPolicy(wrapped, bare, optimizer, scheduler, predictors)
    policy_update = PolicyUpdate(cfg, loss=loss, forward=forward, old_logps=strategy, policy=policy,
                                 accelerator=accelerator, task=task)
    source = build_source(cfg, engine=engine, task=task, model=bare, stage=stage, rank=rank, world=world,
                          pad_id=int(tok.pad_token_id))
    run_checkpoints = RunCheckpoints(accelerator=accelerator, run_dir=run_dir, model=bare, keep=tc.keep_checkpoints)
    return RunParts(cfg=cfg, run_dir=run_dir, accelerator=accelerator, task=task, tok=tok, chat=chat, is_moe=moe,
                    controller=controller, predictors=predictors, optimizer=optimizer, scheduler=scheduler,
                    model=wrapped, unwrapped=bare, engine=engine, forward=forward, stage=stage,
                    policy_update=policy_update, source=source, run_checkpoints=run_checkpoints,
                    nan=NanCounter(tc.on_nan, tc.max_nan_skips), sampled_eval=sampled)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_determinism(tc: Any) -> None:
    """``trainer.threads`` and, on CUDA with ``trainer.deterministic``, deterministic kernels (CPU kernels are
    deterministic at a fixed thread count)."""
    if tc.threads and tc.threads > 0:
        torch.set_num_threads(int(tc.threads))
    if tc.deterministic and torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def make_accelerator() -> Accelerator:
    """The run's Accelerator.  Several CPU processes (torchrun / accelerate launch set ``WORLD_SIZE``) run as
    ``MULTI_CPU`` only with ``ACCELERATE_USE_CPU`` (``cpu=True`` would force a single process)."""
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    return Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
