"""The Accelerate training loop (architecture.md, "Data flow of one training step").

One iteration ``i`` of :meth:`Trainer.run`:

1. the engine (weights of policy version ``v``, its own precision) samples ``G`` responses for this process's share
   of ``rollout.prompts_per_step`` prompts (prompts and sampling seeded by ``(seed, i)``: a resumed run regenerates
   the same batch);
2. the trainer recomputes ``old_logp`` under the same weights θ_v (R3/PR2: replaying the engine's routes; R2:
   recording its own routes), and measures the train/inference mismatch and routing mismatch (with and without
   replay, when the model is MoE and ``algo.routing.metrics``);
3. the batch enters the staleness buffer, which releases the batch to train on (exact delay ``k`` or bounded);
4. rewards and group advantages of the released batch; ``trainer.updates_per_step`` optimizer updates over
   contiguous mini-batches, each with ``trainer.grad_accum`` micro-batches; loss denominators are the GLOBAL counts
   of the mini-batch (all micro-batches, all processes); M2PO's selection is global per mini-batch;
5. every forward replays routes as configured; objective × correction weights → backward → clip → step
   (PR2: predictor loss in its own parameter group); NaN/Inf → skip-and-count or stop (``trainer.on_nan``);
6. the engine is synced (version v+1), metrics are logged, checkpoints written every ``trainer.checkpoint_every``.

``trainer.steps`` counts TRAINED steps; with staleness ``k`` the first ``k`` iterations only generate.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from offpolicy_moe.engine.batch import RolloutBatch
from offpolicy_moe.engine.buffer import StalenessBuffer
from offpolicy_moe.engine.checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, rng_state,
                                             save_checkpoint, set_rng_state)
from offpolicy_moe.engine.faults import NonFiniteLossError, RunDirError, check_run_dir, is_finite
from offpolicy_moe.engine.loggers import ConsoleLogger, JsonlLogger, MultiLogger, WandbLogger, clean_metrics
from offpolicy_moe.engine.logprobs import response_logprobs
from offpolicy_moe.engine.rollout import HFRolloutEngine
from offpolicy_moe.engine.pipeline.loop import run_async
from offpolicy_moe.engine.pipeline.source import AsyncBatchSource

__all__ = ["Trainer", "train", "TrainingStopped", "iteration_seed"]

_REPLAY_ENGINE = ("r3", "pr2")


def iteration_seed(seed: int, iteration: int, rank: int = 0, salt: int = 0) -> int:
    """Sampling seed of generation iteration ``iteration`` on process ``rank``: a pure function of its arguments,
    so a resumed run regenerates exactly the batch an uninterrupted run would have generated."""
    return int(np.random.SeedSequence([seed, iteration, rank, salt]).generate_state(1)[0])


class TrainingStopped(RuntimeError):
    """The run was stopped (e.g. a test hook or a signal) after a clean checkpoint."""


def _cfg_dict(cfg: Any) -> dict:
    try:
        from offpolicy_moe.config.load import to_dict

        return to_dict(cfg)
    except Exception:  # noqa: BLE001 - fallback for partial configs
        return asdict(cfg) if is_dataclass(cfg) else dict(cfg)


def _cfg_yaml(cfg: Any) -> str:
    try:
        from offpolicy_moe.config.load import to_yaml

        return to_yaml(cfg)
    except ImportError:  # pragma: no cover
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _float_metrics(metrics: dict) -> dict[str, float]:
    return {k: v for k, v in clean_metrics(metrics).items() if v is not None}


def _mean_dicts(dicts: list[dict]) -> dict[str, float]:
    """Per-key mean over metric dicts of floats / 0-d tensors, converted to floats with ONE host sync
    (``metrics_to_floats``) instead of one ``.item()`` per metric and micro-batch; non-finite values are dropped."""
    from offpolicy_moe.losses import metrics_to_floats

    acc: dict[str, list] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                if v.numel() != 1:
                    continue
                acc.setdefault(k, []).append(v.detach().reshape(()).to(torch.float64))
            elif isinstance(v, (int, float)):
                acc.setdefault(k, []).append(float(v))
    means: dict = {}
    for k, vs in acc.items():
        if all(isinstance(v, float) for v in vs):
            means[k] = sum(vs) / len(vs)
        else:
            ts = [v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64) for v in vs]
            dev = ts[0].device
            means[k] = torch.stack([t.to(dev) for t in ts]).mean()
    return {k: v for k, v in metrics_to_floats(means).items() if math.isfinite(v)}


def _lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """Multiplier of the base lr after ``n`` optimizer updates: linear warm-up then constant/cosine/linear decay."""
    if kind not in ("constant", "cosine", "linear"):
        raise ValueError(f"optim.scheduler must be constant, cosine or linear, got {kind!r}")

    def f(n: int) -> float:
        if warmup > 0 and n < warmup:
            return (n + 1) / warmup
        if kind == "constant":
            return 1.0
        frac = min(max(n - warmup, 0) / max(total - warmup, 1), 1.0)
        return 0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1.0 - frac

    return f


def _adamw(params: list, **kw) -> torch.optim.AdamW:
    """AdamW with the fused (one kernel for all tensors) implementation where torch has it for these parameters
    (CPU and CUDA, floating dtypes): on the tiny CPU model the optimizer step drops from ~1.5 ms to ~0.3 ms.
    Falls back to the default implementation otherwise."""
    try:
        return torch.optim.AdamW(params, fused=True, **kw)
    except (RuntimeError, ValueError, TypeError):
        return torch.optim.AdamW(params, **kw)


class Trainer:
    """Builds everything a run needs from a :class:`~offpolicy_moe.config.schema.TrainConfig` and runs it.

    ``hooks`` (tests, experiments): optional callables ``on_step_end(trainer, step, metrics)`` and
    ``on_batch(trainer, batch)`` (called on every consumed batch before the update).
    """

    def __init__(self, cfg: Any, *, resume: bool = False, hooks: Optional[dict] = None):
        self.cfg = cfg
        self.hooks = hooks or {}
        self.resume = resume
        tc = cfg.trainer
        self.run_dir = check_run_dir(cfg.run_dir, tc.min_free_mb)       # fail fast: unwritable / full disk
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.ckpt_root = self.run_dir / "checkpoints"
        if not resume and (self.metrics_path.exists() and self.metrics_path.stat().st_size > 0
                           or latest_checkpoint(self.ckpt_root) is not None):
            raise RunDirError(f"run folder {str(self.run_dir)!r} already holds a run (metrics.jsonl/checkpoints); "
                              "pass --resume to continue it or choose another --run-dir")
        if tc.threads and tc.threads > 0:
            torch.set_num_threads(int(tc.threads))
        if tc.deterministic and torch.cuda.is_available():   # CPU kernels are deterministic at a fixed thread count
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.benchmark = False
        self._validate_config()

        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        # (no cpu=True: Accelerate would then force a single process.)  Launched as several CPU processes
        # (torchrun / accelerate launch set WORLD_SIZE), Accelerate only goes MULTI_CPU with ACCELERATE_USE_CPU.
        if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")
        self.accelerator = Accelerator(
            kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
        self.world = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        self._seed_everything(cfg.seed)

        from offpolicy_moe.models import is_moe, load_policy
        from offpolicy_moe.tasks import make_task

        self.task = make_task(cfg.task)
        model, self.tok = load_policy(cfg.model, seed=cfg.seed, task=self.task)
        self.is_moe = bool(is_moe(model))
        rt = cfg.algo.routing
        if not self.is_moe and rt.replay != "none":
            raise ValueError(f"algo.routing.replay={rt.replay!r} needs a Mixture-of-Experts model, but "
                             f"{type(model).__name__} has no MoE layer (model.preset={cfg.model.preset!r})")
        self.measure_routing = self.is_moe and bool(rt.metrics)
        model.train()
        self.model = model
        self.controller = None
        if self.is_moe and (rt.replay != "none" or self.measure_routing):
            from offpolicy_moe.routing import RoutingController

            self.controller = RoutingController(model)
        if cfg.model.gradient_checkpointing:
            if self.controller is not None:   # recompute in backward sees the forward's (replayed) routes
                self.controller.enable_gradient_checkpointing(model)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.predictors = None
        if rt.replay == "pr2":
            from offpolicy_moe.routing import PR2Predictors

            self.predictors = PR2Predictors.from_controller(self.controller)
        self.ref_model = None   # created after the SFT warm start when algo.kl.coef > 0
        self.ref_controller = None

        params = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.optim.lr}]
        if self.predictors is not None:
            from offpolicy_moe.routing import pr2_param_group

            params.append(pr2_param_group(self.predictors, cfg.optim.lr, rt.pr2_lr_mult))
        self.optimizer = _adamw(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                weight_decay=cfg.optim.weight_decay)
        total_updates = tc.steps * tc.updates_per_step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _lr_lambda(cfg.optim.scheduler, cfg.optim.warmup_steps, total_updates))
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        if self.predictors is not None:
            self.predictors.to(self.accelerator.device)

        from offpolicy_moe.losses import get_policy_loss

        self.loss_fn = get_policy_loss(cfg.algo.loss.name)
        self.loss_params = set(inspect.signature(self.loss_fn).parameters)
        self.buffer = AsyncBatchSource(cfg, rank=self.rank, world=self.world, seed_fn=iteration_seed) \
            if cfg.buffer.mode == "async" else \
            StalenessBuffer(cfg.buffer.staleness, cfg.buffer.mode, max_delay=cfg.buffer.max_delay, seed=cfg.seed)
        ro = cfg.rollout
        self.engine = HFRolloutEngine(
            self.unwrapped, self.tok, dtype=ro.dtype, max_new_tokens=ro.max_new_tokens, temperature=ro.temperature,
            top_p=ro.top_p, batch_size=ro.batch_size,
            record_routes=self.is_moe and (rt.replay in _REPLAY_ENGINE or self.measure_routing),
            router_noise=ro.router_noise, pr2_predictors=self.predictors, pr2_in_weights=rt.pr2_bias_in_weights,
            pr2_feature_sample_rate=rt.pr2_feature_sample_rate, device=self.accelerator.device,
            sampler=getattr(ro, "sampler", "native"), compact_finished=getattr(ro, "compact_finished", True))
        # counters (all checkpointed)
        self.iteration = 0          # generation iterations done
        self.step = 0               # trained steps done = policy version
        self.updates = 0            # optimizer updates applied
        self.nan_skipped = 0
        self.sft_done = False
        self.last_metrics: dict[str, float] = {}
        self.logger: Optional[MultiLogger] = None
        self.console: Optional[ConsoleLogger] = None
        self.jsonl: Optional[JsonlLogger] = None

    # ------------------------------------------------------------------ set-up helpers
    @property
    def unwrapped(self) -> torch.nn.Module:
        """The bare model (no DDP/compile wrapper); looked up once (``unwrap_model`` costs ~0.5 ms a call)."""
        if getattr(self, "_unwrapped_model", None) is None or self._wrapped_model is not self.model:
            self._unwrapped_model = self.accelerator.unwrap_model(self.model)
            self._wrapped_model = self.model
        return self._unwrapped_model

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def _validate_config(self) -> None:
        """Every cross-field rule lives in :func:`offpolicy_moe.config.validate.validate` (raises ConfigError);
        the trainer only adds that a training run needs at least one step."""
        from offpolicy_moe.config.validate import validate

        for w in validate(self.cfg):
            print(f"offpolicy-moe: warning: {w}", file=sys.stderr)
        if self.cfg.trainer.steps < 1:
            raise ValueError(f"trainer.steps must be >= 1 to train, got {self.cfg.trainer.steps}")

    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _iter_seed(self, iteration: int, salt: int = 0) -> int:
        return iteration_seed(self.cfg.seed, iteration, self.rank, salt)

    # ------------------------------------------------------------------ routing contexts
    def _make_ref_model(self, state: Optional[dict] = None) -> None:
        """The frozen reference policy for the KL penalty (a copy of the current weights, or ``state``), with its
        own routing controller: under R3/R2 its log-probs replay the same routes as the actor's."""
        self.ref_model = copy.deepcopy(self.unwrapped).eval()
        if state is not None:
            self.ref_model.load_state_dict(state)
        for p in self.ref_model.parameters():
            p.requires_grad_(False)
        self.ref_controller = None
        if self.controller is not None:
            from offpolicy_moe.routing import RoutingController

            self.ref_controller = RoutingController(self.ref_model)

    def _controller_for(self, model: torch.nn.Module):
        """The routing controller hooking ``model`` (the reference model has its own)."""
        if self.ref_model is not None and model is self.ref_model:
            return self.ref_controller
        return self.controller

    def _replay_ctx(self, routes: Any, controller: Any = None):
        controller = self.controller if controller is None else controller
        if routes is None or controller is None:
            return contextlib.nullcontext()
        return controller.replay(routes)

    def _routes_for_update(self, batch: RolloutBatch) -> Any:
        replay = self.cfg.algo.routing.replay
        if replay in _REPLAY_ENGINE:
            return batch.routes
        if replay == "r2":
            return batch.trainer_routes
        return None

    def _logp(self, model: torch.nn.Module, batch: RolloutBatch, routes: Any, record: bool = False):
        """Response log-probs of ``batch`` under ``model``, replaying ``routes`` when given; with ``record`` also
        the routes the forward used (``(logp, RouteTrace [B, S])``).

        ``trainer.share_prompt``: each group's prompt is run once (:mod:`offpolicy_moe.engine.packing`, or a shared
        KV cache).  Replayed traces are re-laid out like the packed batch and recorded ones back like the plain
        batch; router-logit capture (PR2) needs the plain ``[B, S]`` forward, so nothing is shared while a routing
        context opened by the caller is active."""
        dev = self.accelerator.device
        ids, am = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        if routes is not None and hasattr(routes, "to"):
            routes = routes.to(dev)
        ctl = self._controller_for(model)
        if record and ctl is None:
            raise RuntimeError("route recording needs a RoutingController (an MoE model with routing enabled)")
        share = bool(getattr(self.cfg.trainer, "share_prompt", True)) and not (ctl is not None and ctl.active)
        packing = None
        if share and ctl is not None and (routes is not None or record):
            from offpolicy_moe.engine.packing import plan_group_packing, takes_4d_mask

            base = model.module if hasattr(model, "module") else model
            packing = plan_group_packing(ids, am, batch.prompt_len) if takes_4d_mask(base) else None
            if packing is not None and routes is not None:
                packed_routes = packing.pack_trace(routes)
                packing, routes = (None, routes) if packed_routes is None else (packing, packed_routes)
        rec_ctx = ctl.record() if record else contextlib.nullcontext()
        with self._replay_ctx(routes, ctl), rec_ctx as rec:
            logp = response_logprobs(model, ids, am, batch.prompt_len, temperature=self.cfg.rollout.temperature,
                                     response_mask=batch.response_mask.to(dev),
                                     share_prompt=share and routes is None and not record, packing=packing)
        if not record:
            return logp
        trace = rec.trace()
        return logp, (packing.unpack_trace(trace) if packing is not None else trace)

    # ------------------------------------------------------------------ generation + old log-probs
    def _generate(self, iteration: int) -> RolloutBatch:
        ro = self.cfg.rollout
        rows = self.task.sample_prompts(iteration, ro.prompts_per_step)
        mine = list(range(self.rank, ro.prompts_per_step, self.world))
        if not mine:
            raise ValueError(f"rollout.prompts_per_step={ro.prompts_per_step} < number of processes {self.world}")
        prompts = [rows[j]["prompt"] for j in mine]
        answers = [rows[j]["answer"] for j in mine]
        batch = self.engine.generate(prompts, answers, group_size=ro.group_size, seed=self._iter_seed(iteration),
                                     iteration=iteration)
        # globally unique group ids: (iteration, prompt index within the step)
        batch.group_ids = (iteration * ro.prompts_per_step
                           + torch.tensor(mine, dtype=torch.long).repeat_interleave(ro.group_size))
        return batch

    def _can_defer_old_logp(self) -> bool:
        """True when the old-log-prob recompute pass is redundant: the batch is consumed by the very next update
        (fixed staleness 0), that update is the only one on it (``updates_per_step == 1``), so the update forward
        runs under the generating weights θ_v and ``old_logp = logp.detach()`` of that forward, bit for bit the
        recompute's value (same weights, same routes: none or the engine's replayed).  Not used when something
        needs ``old_logp`` BEFORE the update forward: correction weights, the M2PO selection pass, R2/PR2 routing,
        routing measurements under R3 (they need a pass WITHOUT replay), proximal/bypass sources.  Without replay the
        routing measurements record the trainer's routes in the update forward itself; the counterfactual "with R3"
        mismatch (``mismatch/k3_kl_r3``, only with ``trainer.mismatch_metrics``) keeps its one replayed pass.
        ``trainer.fuse_old_logp=false`` turns the fusion off."""
        cfg = self.cfg
        return (bool(getattr(cfg.trainer, "fuse_old_logp", True))
                and cfg.algo.old_logp_source == "trainer" and cfg.buffer.mode == "fixed" and cfg.buffer.staleness == 0
                and cfg.trainer.updates_per_step == 1 and cfg.algo.correction.mode == "none"
                and cfg.algo.routing.replay in ("none", "r3")
                and (not self.measure_routing or (cfg.algo.routing.replay == "none" and cfg.trainer.grad_accum == 1))
                and cfg.algo.loss.name != "m2po" and "on_batch" not in self.hooks)

    @torch.no_grad()
    def _prepare(self, batch: RolloutBatch) -> None:
        """old_logp (per ``algo.old_logp_source``), R2 routes, mismatch and routing measurements → ``batch.extras``."""
        cfg = self.cfg
        src, replay = cfg.algo.old_logp_source, cfg.algo.routing.replay
        if self._can_defer_old_logp():
            batch.old_logp, batch.old_logp_deferred, batch.extras = None, True, {}
            if self.measure_routing and cfg.trainer.mismatch_metrics and batch.routes is not None:
                from offpolicy_moe.losses import mismatch_metrics

                model = self.unwrapped
                was_training = model.training
                model.eval()
                try:
                    lp_r3 = self._logp(model, batch, batch.routes).cpu()
                finally:
                    model.train(was_training)
                mm = _float_metrics(mismatch_metrics(lp_r3, batch.behav_logp, batch.response_mask))
                batch.extras = {"mismatch/k3_kl_r3": mm["mismatch/k3_kl"],
                                "mismatch/extreme_frac_r3": mm["mismatch/extreme_frac"]}
            return
        model = self.unwrapped
        was_training = model.training
        model.eval()
        mask = batch.response_mask
        extras: dict[str, float] = {}
        try:
            engine_replay = self.is_moe and replay in _REPLAY_ENGINE
            need_own = (src == "trainer" and not engine_replay) or self.measure_routing \
                or (src == "engine" and cfg.trainer.mismatch_metrics)
            # the R3 counterfactual of a run without replay costs a whole extra forward: only with mismatch_metrics
            need_r3 = self.is_moe and batch.routes is not None and (
                (src == "trainer" and replay in _REPLAY_ENGINE)
                or (self.measure_routing and bool(cfg.trainer.mismatch_metrics)))
            lp_own = lp_r3 = None
            if need_own:
                if self.controller is not None and (self.measure_routing or replay == "r2"):
                    lp_own, own_routes = self._logp(model, batch, None, record=True)
                    lp_own = lp_own.cpu()
                    if hasattr(own_routes, "to"):
                        own_routes = own_routes.to("cpu")
                    if replay == "r2":
                        batch.trainer_routes = own_routes
                    if self.measure_routing and batch.routes is not None:
                        from offpolicy_moe.routing import routing_metrics

                        extras.update(_float_metrics(routing_metrics(batch.routes, own_routes,
                                                                     batch.attention_mask)))
                else:
                    lp_own = self._logp(model, batch, None).cpu()
            if need_r3:
                lp_r3 = self._logp(model, batch, batch.routes).cpu()
            if src == "trainer":
                batch.old_logp = lp_r3 if (replay in _REPLAY_ENGINE and self.is_moe) else lp_own
            elif src == "engine":
                batch.old_logp = batch.behav_logp.clone()
            # src == proximal: old_logp computed at consumption
            from offpolicy_moe.losses import mismatch_metrics

            if batch.old_logp is not None and src == "trainer":
                extras.update(_float_metrics(mismatch_metrics(batch.old_logp, batch.behav_logp, mask)))
            elif src == "engine" and cfg.trainer.mismatch_metrics:
                ref = lp_r3 if (replay in _REPLAY_ENGINE and lp_r3 is not None) else lp_own
                if ref is not None:
                    extras.update(_float_metrics(mismatch_metrics(ref, batch.behav_logp, mask)))
            for name, lp in (("r3", lp_r3), ("no_r3", lp_own)):
                if lp is not None and self.is_moe:
                    mm = _float_metrics(mismatch_metrics(lp, batch.behav_logp, mask))
                    extras[f"mismatch/k3_kl_{name}"] = mm["mismatch/k3_kl"]
                    extras[f"mismatch/extreme_frac_{name}"] = mm["mismatch/extreme_frac"]
        finally:
            model.train(was_training)
        batch.extras = extras

    # ------------------------------------------------------------------ the update
    def _loss_options(self) -> dict:
        lc = self.cfg.algo.loss
        opts = {"clip_low": lc.clip_low, "clip_high": lc.clip_high, "dual_clip": lc.dual_clip,
                "tau": lc.m2po_tau, "variant": lc.m2po_variant, "scope": lc.m2po_scope}
        out = {k: v for k, v in opts.items() if k in self.loss_params and v is not None}
        if "process_group" in self.loss_params and self.world > 1:
            out["process_group"] = torch.distributed.group.WORLD
        return out

    def _process_group(self):
        return torch.distributed.group.WORLD if self.world > 1 else None

    def _check_finite(self, value: torch.Tensor, what: str) -> bool:
        ok = is_finite(value)
        if self.world > 1:
            flag = torch.tensor([0.0 if ok else 1.0], device=self.accelerator.device)
            ok = float(self.accelerator.reduce(flag, "sum").item()) == 0.0
        if not ok and self.cfg.trainer.on_nan == "stop":
            raise NonFiniteLossError(f"non-finite {what} at step {self.step + 1} (iteration {self.iteration}); "
                                     "stopping (trainer.on_nan=stop). Set trainer.on_nan=skip to skip such updates.")
        return ok

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Train on one consumed batch (this process's share of it): rewards → group advantages →
        ``trainer.updates_per_step`` optimizer updates (see the module docstring, step 4-5); returns the step's
        metrics (``_tokens``: attention tokens processed).  Callable on any :class:`RolloutBatch` whose
        ``old_logp`` is set (or ``algo.old_logp_source=proximal``), e.g. a fixed batch loaded from disk."""
        return self._train_on(batch)

    def _sync_predictor_grads(self) -> None:
        """PR2 predictors are not wrapped in DDP: average their gradients over processes by hand so every process
        applies the same predictor update.  Each process's backward ran on ``loss * world`` (see the update), so the
        sum over processes is divided by ``world**2``: the result is the mean over processes of the local
        gradients."""
        if self.predictors is None or self.world == 1:
            return
        params = [p for p in self.predictors.parameters() if p.requires_grad]
        for p in params:     # a process without PR2 features this step contributes zeros (no deadlock)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        flat /= float(self.world * self.world)
        off = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[off:off + n].view_as(g))
            off += n

    def _train_on(self, batch: RolloutBatch) -> dict[str, float]:
        cfg, tc = self.cfg, self.cfg.trainer
        acc = self.accelerator
        dev = acc.device
        from offpolicy_moe.losses import correction_weights, global_counts, group_advantages, kl_penalty

        rewards = torch.tensor(self.task.reward(batch.completions, batch.answers), dtype=torch.float32)
        adv, rmetrics = group_advantages(rewards, batch.group_ids, norm=cfg.algo.loss.adv_norm, return_metrics=True)
        metrics: dict[str, float] = _float_metrics(rmetrics)
        metrics["reward/std"] = float(rewards.std(unbiased=False)) if rewards.numel() > 1 else 0.0
        metrics["reward/response_len"] = float(batch.response_mask.sum(-1).float().mean())
        metrics["reward/adv_abs_mean"] = float(adv.abs().mean())
        routes = self._routes_for_update(batch)
        src = cfg.algo.old_logp_source
        fused = batch.old_logp is None and batch.old_logp_deferred
        if fused and (batch.version != self.step or tc.updates_per_step != 1):
            raise RuntimeError(f"batch of version {batch.version} deferred its old log-probs, but the trainer is at "
                               f"version {self.step} with {tc.updates_per_step} updates per step: they can only "
                               "come from a single on-policy update")
        fused_routes = None
        fused_old = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=dev) if fused else None
        if src == "proximal":
            model = self.unwrapped
            was = model.training
            model.eval()
            with torch.no_grad():
                batch.old_logp = self._logp(model, batch, routes).cpu()
            model.train(was)
            from offpolicy_moe.losses import mismatch_metrics

            metrics.update(_float_metrics(mismatch_metrics(batch.old_logp, batch.behav_logp, batch.response_mask)))
        weights = None
        corr = cfg.algo.correction
        if src == "trainer" and corr.mode != "none":
            weights, wm = correction_weights(batch.old_logp, batch.behav_logp, batch.response_mask, level=corr.level,
                                             mode=corr.mode, high=corr.high, low=corr.low)
            metrics.update(_float_metrics(wm))
        elif src == "proximal":
            if corr.mode != "none":
                weights, wm = correction_weights(batch.old_logp, batch.behav_logp, batch.response_mask,
                                                 level=corr.level, mode=corr.mode, high=corr.high, low=corr.low)
                metrics.update(_float_metrics(wm))
            else:   # AReaL decoupled PPO: plain pi_prox / mu behaviour weight
                lw = (batch.old_logp - batch.behav_logp).clamp(-20, 20)
                weights = torch.where(batch.response_mask.bool(), lw.exp(), torch.zeros_like(lw))
        ref_logp_all = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logp_all = self._logp(self.ref_model, batch, routes).cpu()
        norm_length = cfg.algo.loss.norm_length or cfg.rollout.max_new_tokens
        opts = self._loss_options()
        mini_metrics: list[dict] = []
        grad_norms: list[float] = []
        t_tokens = int(batch.attention_mask.sum())
        n_micro = tc.grad_accum
        on_policy = batch.version == self.step
        for mb_num, mb_idx in enumerate(torch.arange(batch.size).tensor_split(tc.updates_per_step)):
            # PR2: skip the predictor loss on the first mini-step of on-policy data (target = "no change")
            pr2_on = not (on_policy and mb_num == 0)
            micro_idx = [m for m in mb_idx.tensor_split(n_micro) if m.numel() > 0]
            parts = [batch.index_select(m) for m in micro_idx]
            part_routes = [routes.index_select(m) if routes is not None else None for m in micro_idx]
            n_tok, n_seq = global_counts([p.response_mask.to(dev) for p in parts], self._process_group())
            extra_opts: dict = {}
            if cfg.algo.loss.name == "m2po" and cfg.algo.loss.m2po_scope == "global" \
                    and (len(parts) > 1 or self.world > 1):
                extra_opts = self._m2po_global(parts, part_routes, micro_idx, adv, dev)
            losses: list[float] = []
            ok = True
            for j, (p, m_idx) in enumerate(zip(parts, micro_idx)):
                sync_ctx = acc.no_sync(self.model) if (j < len(parts) - 1 and self.world > 1) \
                    else contextlib.nullcontext()
                with sync_ctx:
                    feats = p.pr2_features if (self.predictors is not None and pr2_on) else None
                    if feats is not None and feats.num_tokens > 0:
                        with self.controller.capture_router_logits(feats) as cap:
                            logp = self._logp(self.model, p, part_routes[j])
                    elif fused and self.measure_routing and self.controller is not None:
                        # the trainer's own routes, for routing/*
                        logp, fused_routes = self._logp(self.model, p, part_routes[j], record=True)
                    else:
                        logp = self._logp(self.model, p, part_routes[j])
                    kw = dict(agg=cfg.algo.loss.agg, num_tokens=n_tok, num_seqs=n_seq, norm_length=norm_length,
                              weights=weights.index_select(0, m_idx).to(dev) if weights is not None else None,
                              **opts)
                    if "m2po_keep" in extra_opts:
                        kw["m2po_keep"] = extra_opts["m2po_keep"][j]
                    if "m2po_cap" in extra_opts:
                        kw["m2po_cap"] = extra_opts["m2po_cap"]
                    if fused:
                        old_lp = logp.detach()
                        fused_old.index_copy_(0, m_idx.to(dev), old_lp.float())
                    else:
                        old_lp = p.old_logp.to(dev)
                    loss, lm = self.loss_fn(logp, old_lp, adv.index_select(0, m_idx).to(dev),
                                            p.response_mask.to(dev), **kw)
                    if ref_logp_all is not None and cfg.algo.kl.coef > 0:
                        from offpolicy_moe.losses import aggregate

                        kl_tok = kl_penalty(logp, ref_logp_all.index_select(0, m_idx).to(dev), cfg.algo.kl.kind,
                                            mask=p.response_mask.to(dev))
                        kl = aggregate(kl_tok, p.response_mask.to(dev), cfg.algo.loss.agg or "token-mean",
                                       num_tokens=n_tok, num_seqs=n_seq, norm_length=norm_length)
                        loss = loss + cfg.algo.kl.coef * kl
                        lm = dict(lm, **{"actor/kl_ref": kl.detach()})
                    if not self._check_finite(loss.detach(), "loss"):
                        ok = False
                        break
                    if feats is not None and feats.num_tokens > 0:
                        from offpolicy_moe.routing import pr2_predictor_loss

                        ploss, pm = pr2_predictor_loss(self.predictors, feats, cap.logits(),
                                                       current_ids=cap.own_ids(),
                                                       replayed_ids=feats.gather_trace(part_routes[j]))
                        loss = loss + ploss / len(parts)    # only W_p gets this gradient (features detached)
                        lm = dict(lm, **pm)
                    acc.backward(loss * self.world)    # DDP averages gradients over ranks; global counts already
                losses.append(loss.detach())
                mini_metrics.append(lm)
            gn = None
            if ok:
                self._sync_predictor_grads()
                gn = acc.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip) if cfg.optim.grad_clip > 0 \
                    else torch.sqrt(sum((q.grad.detach().float() ** 2).sum() for q in self.model.parameters()
                                        if q.grad is not None))
                ok = self._check_finite(torch.as_tensor(gn), "gradient norm")
            if ok:
                self.optimizer.step()
                self.updates += 1
                grad_norms.append(torch.as_tensor(gn).detach())
                mini_metrics.append({"actor/loss": torch.stack(losses).sum()})
            else:
                self.nan_skipped += 1
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        if grad_norms:
            mini_metrics.append({"actor/grad_norm": torch.stack([g.float() for g in grad_norms]).mean()})
        metrics.update(_mean_dicts(mini_metrics))
        if fused:       # the measurements the skipped recompute pass would have made, from the same values
            from offpolicy_moe.losses import mismatch_metrics

            fused_old = fused_old.cpu()
            batch.old_logp = fused_old
            if fused_routes is not None and batch.routes is not None:
                from offpolicy_moe.routing import routing_metrics

                own = fused_routes.to("cpu") if hasattr(fused_routes, "to") else fused_routes
                metrics.update(_float_metrics(routing_metrics(batch.routes, own, batch.attention_mask)))
            mm = _float_metrics(mismatch_metrics(fused_old, batch.behav_logp, batch.response_mask))
            metrics.update(mm)
            if self.is_moe:
                name = "r3" if self.cfg.algo.routing.replay == "r3" and batch.routes is not None else "no_r3"
                metrics[f"mismatch/k3_kl_{name}"] = mm["mismatch/k3_kl"]
                metrics[f"mismatch/extreme_frac_{name}"] = mm["mismatch/extreme_frac"]
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["actor/nan_skipped"] = float(self.nan_skipped)
        metrics["actor/updates"] = float(self.updates)
        metrics["_tokens"] = float(t_tokens)
        return metrics

    def _m2po_global(self, parts, part_routes, micro_idx, adv, dev) -> dict:
        """One no-grad pass over the mini-batch's micro-batches → the M2PO selection (or cap) over all of them."""
        from offpolicy_moe.losses import m2po_adaptive_cap, m2po_mask

        model = self.unwrapped
        with torch.no_grad():
            lrs = [(self._logp(model, p, r) - p.old_logp.to(dev)) for p, r in zip(parts, part_routes)]
        advs = [adv.index_select(0, m).to(dev) for m in micro_idx]
        masks = [p.response_mask.to(dev) for p in parts]
        lc = self.cfg.algo.loss
        if lc.m2po_variant == "adaptive_clip":
            return {"m2po_cap": m2po_adaptive_cap(lrs, advs, masks, tau=lc.m2po_tau,
                                                  process_group=self._process_group())}
        return {"m2po_keep": m2po_mask(lrs, advs, masks, tau=lc.m2po_tau, process_group=self._process_group())}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out split (``eval/accuracy``, ``eval/partial``) and on as many training
        prompts (the first ones of the train split: ``eval/train_accuracy``, ``eval/train_partial``)."""
        from offpolicy_moe.tasks import evaluate_greedy

        model = self.unwrapped
        kw = dict(max_new_tokens=self.cfg.rollout.max_new_tokens, batch_size=self.cfg.trainer.eval_batch_size)
        out = evaluate_greedy(model, self.tok, self.task.eval_dataset, **kw)
        train_ds = self.task.train_dataset
        n = min(len(train_ds), max(len(self.task.eval_dataset), 1))
        out.update(evaluate_greedy(model, self.tok, train_ds.select(range(n)), prefix="eval/train_", **kw))
        return out

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict:
        return {
            "format": "offpolicy_moe.trainer/1",
            "iteration": self.iteration, "step": self.step, "updates": self.updates,
            "nan_skipped": self.nan_skipped, "sft_done": self.sft_done,
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "buffer": self.buffer.state_dict(), "engine_version": self.engine.version,
            "predictors": self.predictors.state_dict() if self.predictors is not None else None,
            "ref_model": self.ref_model.state_dict() if self.ref_model is not None else None,
            "rng": rng_state(), "metrics_offset": self.jsonl.offset() if self.jsonl is not None else 0,
            "last_metrics": self.last_metrics,
            "model_signature": self._model_signature(),
            "world_size": self.world,
        }

    def _model_signature(self) -> dict:
        cfg = self.unwrapped.config
        return {"class": type(self.unwrapped).__name__, "vocab_size": int(getattr(cfg, "vocab_size", -1)),
                "num_experts": getattr(cfg, "num_experts", getattr(cfg, "num_local_experts", None)),
                "top_k": getattr(cfg, "num_experts_per_tok", None),
                "num_layers": getattr(cfg, "num_hidden_layers", None),
                "hidden_size": getattr(cfg, "hidden_size", None)}

    def save(self) -> Optional[Path]:
        """Checkpoint ``step_<step>`` (main process writes; all processes wait)."""
        self.accelerator.wait_for_everyone()
        path = None
        if self.is_main:
            path = save_checkpoint(self.ckpt_root, self.step, self.unwrapped.state_dict(), self._state(),
                                   keep=self.cfg.trainer.keep_checkpoints)
        self.accelerator.wait_for_everyone()
        return path

    def load(self, path: Path) -> None:
        """Restore everything from a checkpoint folder; clear errors when it does not fit the configured model."""
        model_state, st = load_checkpoint(path)
        if st.get("format") != "offpolicy_moe.trainer/1":
            raise CheckpointError(f"{str(path)!r} is not an offpolicy_moe trainer checkpoint")
        mine, theirs = self._model_signature(), st.get("model_signature", {})
        diff = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if diff:
            desc = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
            raise CheckpointError(f"checkpoint {str(path)!r} does not match the configured model ({desc})")
        if st.get("world_size", 1) != self.world:
            raise CheckpointError(f"checkpoint {str(path)!r} was written by {st.get('world_size')} processes; "
                                  f"resume with the same number (now {self.world})")
        try:
            self.unwrapped.load_state_dict(model_state)
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint {str(path)!r} weights do not fit the configured model: {exc}") from exc
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.buffer.load_state_dict(st["buffer"])
        if self.predictors is not None and st["predictors"] is not None:
            self.predictors.load_state_dict(st["predictors"])
        if st.get("ref_model") is not None:
            self._make_ref_model(st["ref_model"])
        self.iteration, self.step, self.updates = st["iteration"], st["step"], st["updates"]
        self.nan_skipped, self.sft_done = st["nan_skipped"], st["sft_done"]
        self.last_metrics = dict(st.get("last_metrics", {}))
        self._sync_engine(st["engine_version"])
        set_rng_state(st["rng"])
        if self.is_main:
            JsonlLogger.truncate(self.metrics_path, st["metrics_offset"])

    def _sync_engine(self, version: int) -> None:
        self.engine.sync(self.unwrapped.state_dict(), version,
                         self.predictors.state_dict() if self.predictors is not None else None)

    # ------------------------------------------------------------------ logging
    def _open_loggers(self) -> None:
        lc = self.cfg.logging
        loggers: list = []
        self.console = ConsoleLogger(self.cfg.trainer.steps, initial=self.step, every=self.cfg.trainer.log_every,
                                     progress=lc.progress and "console" in lc.loggers, is_main=self.is_main)
        if self.is_main:
            if "console" in lc.loggers:
                loggers.append(self.console)
            if "jsonl" in lc.loggers or True:   # metrics.jsonl is the run-folder contract: always written
                self.jsonl = JsonlLogger(self.run_dir)
                loggers.append(self.jsonl)
            if "wandb" in lc.loggers and lc.wandb_mode != "disabled":
                loggers.append(WandbLogger(self.run_dir, _cfg_dict(self.cfg), project=lc.wandb_project,
                                           mode=lc.wandb_mode))
        self.logger = MultiLogger(loggers)

    def _reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.world == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.accelerator.device)
        t = self.accelerator.reduce(t, "mean")
        return dict(zip(keys, t.tolist()))

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = self._reduce(metrics)
        self.last_metrics.update(metrics)
        if self.logger is not None:
            self.logger.log(step, metrics)

    # ------------------------------------------------------------------ the loop
    def _write_run_files(self) -> None:
        if not self.is_main:
            return
        (self.run_dir / "config.yaml").write_text(_cfg_yaml(self.cfg))
        try:
            from offpolicy_moe.commands.env import environment_info

            (self.run_dir / "env.json").write_text(json.dumps(environment_info(), indent=2))
        except Exception as exc:  # noqa: BLE001 - env info is best effort
            (self.run_dir / "env.json").write_text(json.dumps({"error": str(exc)}))

    def _write_summary(self, status: str, wall: float, error: Optional[str] = None) -> dict:
        summary = {"status": status, "steps": int(self.step), "iterations": int(self.iteration),
                   "final": dict(self.last_metrics), "wall_time_s": wall, "run_dir": str(self.run_dir)}
        if error:
            summary["error"] = error
        if self.is_main:
            tmp = self.run_dir / ".summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
            os.replace(tmp, self.run_dir / "summary.json")
        return summary

    def run(self) -> dict:
        """Train to ``trainer.steps`` trained steps; always writes ``summary.json``; returns the summary."""
        t_start = time.perf_counter()
        status, error = "failed", None
        try:
            resumed_from = None
            if self.resume:
                ck = latest_checkpoint(self.ckpt_root)
                if ck is not None:
                    self.load(ck)
                    resumed_from = ck
                elif self.is_main and self.metrics_path.exists():
                    JsonlLogger.truncate(self.metrics_path, 0)
            self._write_run_files()
            self._open_loggers()
            if resumed_from is not None:
                self.console.write(f"resumed from {resumed_from} (step {self.step}, iteration {self.iteration})")
            else:
                self._start()
            self._loop()
            status = "completed"
        except KeyboardInterrupt:
            status, error = "stopped", "interrupted"
            raise
        except TrainingStopped as exc:
            status, error = "stopped", str(exc)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self.logger is not None:
                self.logger.close()
            summary = self._write_summary(status, time.perf_counter() - t_start, error)
        return summary

    def _start(self) -> None:
        cfg, tc = self.cfg, self.cfg.trainer
        if tc.sft_warmup_steps > 0 and not self.sft_done:
            from offpolicy_moe.engine.sft import sft_warm_start

            self.console.write(f"SFT warm start: {tc.sft_warmup_steps} steps")
            sft = sft_warm_start(self.unwrapped, self.tok, self.task, steps=tc.sft_warmup_steps, lr=tc.sft_lr,
                                 batch_size=tc.sft_batch_size, seed=cfg.seed,
                                 progress=cfg.logging.progress and self.is_main)
            self.unwrapped.train()
            self.sft_done = True
            self._seed_everything(cfg.seed + 1)
            self.console.write(f"SFT done: loss {sft.get('sft/loss', float('nan')):.4f}")
        if cfg.algo.kl.coef > 0:
            self._make_ref_model()
        self._sync_engine(0)
        t0 = time.perf_counter()
        ev = self.evaluate()
        ev["perf/time_eval_s"] = time.perf_counter() - t0
        self._log(0, ev)
        if tc.checkpoint_every > 0:
            self.save()

    # TEMPORARY shims (pre-split trainer): the names the async loop uses on the split trainer
    def prepare(self, batch):
        self._prepare(batch)

    def log(self, step, m):
        self._log(step, m)

    @property
    def callbacks(self):
        hooks = self.hooks

        class _CB:
            def on_batch(self, tr, b):
                if "on_batch" in hooks:
                    hooks["on_batch"](tr, b)

            def on_step_end(self, tr, s, m):
                if "on_step_end" in hooks:
                    hooks["on_step_end"](tr, s, m)
        return _CB()

    def _loop(self) -> None:
        cfg, tc = self.cfg, self.cfg.trainer
        if cfg.buffer.mode == "async":
            return run_async(self, stopped=TrainingStopped)
        max_iterations = tc.steps + cfg.buffer.staleness + 10 * tc.steps * (cfg.buffer.mode == "bounded")
        while self.step < tc.steps:
            if self.iteration >= max_iterations:
                raise RuntimeError(f"bounded buffer starved: {self.iteration} iterations produced only {self.step} "
                                   "trained steps (every batch dropped?)")
            t_it = time.perf_counter()
            t0 = time.perf_counter()
            batch = self._generate(self.iteration)
            t_gen = time.perf_counter() - t0
            n_gen = batch.num_tokens()
            t0 = time.perf_counter()
            self._prepare(batch)
            t_old = time.perf_counter() - t0
            self.buffer.push(batch, self.iteration)
            consumed, _ = self.buffer.pop(self.iteration, self.step)
            if consumed is None:   # warm-up (fixed) or nothing arrived yet (bounded)
                self.iteration += 1
                continue
            if "on_batch" in self.hooks:
                self.hooks["on_batch"](self, consumed)
            t0 = time.perf_counter()
            m = self._train_on(consumed)
            t_upd = time.perf_counter() - t0
            lag = self.step - consumed.version
            m.update(consumed.extras)
            tokens = m.pop("_tokens")
            m.update({
                "offpolicy/staleness_steps": float(lag),
                "offpolicy/staleness_updates": float(lag * tc.updates_per_step),
                "offpolicy/batch_version": float(consumed.version),
                "offpolicy/generated_at": float(consumed.generated_at),
                "offpolicy/dropped": float(self.buffer.dropped),
                "offpolicy/buffer_size": float(len(self.buffer)),
                "perf/gen_tokens_per_s": n_gen / max(t_gen, 1e-9),
                "perf/update_tokens_per_s": tokens / max(t_upd, 1e-9),
                "perf/time_generate_s": t_gen, "perf/time_old_logp_s": t_old, "perf/time_update_s": t_upd,
            })
            self.step += 1
            self.iteration += 1
            self._sync_engine(self.step)
            if (tc.eval_every > 0 and self.step % tc.eval_every == 0) or self.step == tc.steps:
                t0 = time.perf_counter()
                m.update(self.evaluate())
                m["perf/time_eval_s"] = time.perf_counter() - t0
            m["perf/time_step_s"] = time.perf_counter() - t_it
            self._log(self.step, m)
            if (tc.checkpoint_every > 0 and self.step % tc.checkpoint_every == 0) or self.step == tc.steps:
                self.save()
            if "on_step_end" in self.hooks:
                self.hooks["on_step_end"](self, self.step, m)


_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE")


def _truthy(value: Optional[str]) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _accelerate_launch_num_processes(argv: list[str]) -> int:
    """``--num_processes`` of an ``accelerate launch`` command line (its flag, else its ``--config_file``), parsed
    with Accelerate's own ``launch`` argument parser (so the training command's arguments are never mistaken for
    the launcher's)."""
    if "launch" not in argv:
        return 1
    rest = argv[argv.index("launch") + 1:]
    try:
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(rest)
    except (Exception, SystemExit):  # noqa: BLE001 - not a launch command line we understand: no relaunch
        return 1
    n = getattr(args, "num_processes", None)
    config_file = getattr(args, "config_file", None)
    if n is None and config_file:
        try:
            import yaml

            n = (yaml.safe_load(Path(config_file).read_text()) or {}).get("num_processes")
        except Exception:  # noqa: BLE001 - unreadable config: no relaunch
            n = None
    try:
        return max(int(n), 1) if n is not None else 1
    except (TypeError, ValueError):
        return 1


def cpu_launch_processes(env: Optional[dict] = None, parent_argv: Optional[list[str]] = None) -> int:
    """How many CPU processes an ``accelerate launch --cpu --num_processes N`` wanted but did not start.

    Accelerate 1.15 starts several CPU processes only through ``mpirun`` (``--mpirun_hostfile``, Intel MPI / oneCCL);
    without it, ``accelerate launch --cpu --num_processes N`` (or a ``distributed_type: MULTI_CPU`` config) runs ONE
    process with ``ACCELERATE_USE_CPU`` and ``MASTER_ADDR`` set but no ``RANK`` / ``WORLD_SIZE``.  This returns
    ``N`` (read from the parent ``accelerate launch`` command line) in exactly that situation and 0 otherwise."""
    env = os.environ if env is None else env
    if not _truthy(env.get("ACCELERATE_USE_CPU")) or "MASTER_ADDR" not in env:
        return 0
    if "RANK" in env or "WORLD_SIZE" in env or any(v in env for v in _MPI_SIZE_VARS):
        return 0
    if parent_argv is None:
        try:
            import psutil

            parent_argv = psutil.Process(os.getppid()).cmdline()
        except Exception:  # noqa: BLE001 - no parent info: nothing to do
            return 0
    n = _accelerate_launch_num_processes(list(parent_argv))
    return n if n > 1 else 0


def _relaunch_with_torchrun(cfg: Any, nproc: int) -> dict:
    """Start ``nproc`` gloo processes running this same command (``torch.distributed.run``), wait, and exit with
    their return code (``SystemExit``): they ran the whole command, process 0 reported the result."""
    import subprocess

    print(f"offpolicy-moe: accelerate launch --cpu started 1 process (accelerate starts several CPU processes only "
          f"through mpirun); starting {nproc} gloo processes with torch.distributed.run", file=sys.stderr)
    env = dict(os.environ, ACCELERATE_USE_CPU="true")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", env.get("MASTER_ADDR", "127.0.0.1"), "--master_port", env.get("MASTER_PORT", "29500"),
           sys.argv[0], *sys.argv[1:]]
    rc = subprocess.run(cmd, env=env).returncode
    # the relaunched processes did the whole command (process 0 printed the result): exit with their status
    raise SystemExit(rc)


def train(cfg: Any, *, resume: bool = False, hooks: Optional[dict] = None) -> dict:
    """Run one training run described by ``cfg`` (a ``TrainConfig``); returns the summary dict.

    Under ``accelerate launch --cpu --num_processes N`` without mpirun (one process started, see
    :func:`cpu_launch_processes`), the command is re-run as ``N`` gloo processes by ``torch.distributed.run`` and
    this process exits with their return code."""
    nproc = cpu_launch_processes() if hooks is None else 0
    if nproc > 1:
        return _relaunch_with_torchrun(cfg, nproc)
    return Trainer(cfg, resume=resume, hooks=hooks).run()
