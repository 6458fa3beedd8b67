"""The policy update on one consumed batch: rewards → group advantages → behaviour weights → reference log-probs
→ ``trainer.updates_per_step`` optimizer updates over contiguous mini-batches of ``trainer.grad_accum``
micro-batches each.

Loss denominators are the GLOBAL token/sequence counts of the mini-batch (all micro-batches, all processes), so
the update does not depend on how the mini-batch is cut; a loss that selects tokens over the whole mini-batch
(M2PO, arXiv 2510.01161) gets that selection from one no-grad pre-pass.  PR2 adds its predictor loss in the same
backward.  Non-finite values are routed to the run's one policy (``trainer.on_nan``, a
:class:`~offpolicy_moe.run.nonfinite.NanCounter`), by stage: the reference log-probs (``reference``) and the
old log-probs taken at consumption (``old_logp``) drop the whole batch; the loss (or the loss library's refusal of
a NaN log-prob), the gradient norm (``gradients``) and the parameters after ``optimizer.step()`` (``optimizer``,
:class:`~offpolicy_moe.trainer.step_guard.StepGuard`) drop that one optimizer update.  ``skip`` restores the
weights and optimizer state of before the dropped update and counts it; ``stop`` restores those of the start of the
policy update (the last good step boundary) and raises :class:`~offpolicy_moe.run.nonfinite.NonFiniteError`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.run import probes
from offpolicy_moe.run.nonfinite import NanCounter, NonFiniteError, all_finite, as_nonfinite
from offpolicy_moe.trainer.finite_agreement import FiniteAgreement
from offpolicy_moe.trainer.forward import RoutedForward
from offpolicy_moe.trainer.grads import average_predictor_grads, grad_norm, zero_missing_grads
from offpolicy_moe.trainer.micro_loss import MicroBatchTensors, MicroLoss, micro_batch_loss, options_from
from offpolicy_moe.trainer.old_logp_strategy import BatchOldLogp, OldLogpStrategy
from offpolicy_moe.trainer.step_guard import StepGuard
from offpolicy_moe.losses import (LossSpec, get_loss_spec, global_counts, group_advantages, metrics_to_floats,
                                  resolve_loss_options)
from offpolicy_moe.routing import compare_traces, pr2_predictor_loss

__all__ = ["PolicyUpdate", "TrainedPolicy", "LossSetup", "loss_setup", "mean_metrics", "drop_constant_groups",
           "zero_missing_grads"]


@dataclass
class LossSetup:
    """The configured policy loss: its registry entry (capabilities), its validated options (plus the process group
    for a distributed loss under several processes), and whether it selects over the whole mini-batch."""

    spec: LossSpec
    options: dict = field(default_factory=dict)
    global_pass: bool = False

    @property
    def fn(self) -> Callable:
        return self.spec.fn


def loss_setup(loss_cfg: Any, world: int = 1) -> LossSetup:
    """``algo.loss`` -> its registry entry and options (:func:`resolve_loss_options`); the trainer never names a
    loss: capabilities come from the entry."""
    spec = get_loss_spec(loss_cfg.name)
    options = resolve_loss_options(loss_cfg.name, loss_cfg.options)
    call_opts = dict(options)
    if spec.distributed and world > 1:
        call_opts["process_group"] = torch.distributed.group.WORLD
    return LossSetup(spec=spec, options=call_opts, global_pass=bool(spec.wants_global_pass(options)))


def mean_metrics(dicts: list[dict]) -> dict[str, float]:
    """Per-key mean over metric dicts of floats / 0-d tensors, converted to floats with ONE host sync
    (``metrics_to_floats``) instead of one ``.item()`` per metric and micro-batch; non-finite values are dropped."""
    acc: dict[str, list] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                if v.numel() == 1:
                    acc.setdefault(k, []).append(v.detach().reshape(()).to(torch.float64))
            elif isinstance(v, (int, float)):
                acc.setdefault(k, []).append(float(v))
    means: dict = {}
    for k, vs in acc.items():
        if all(isinstance(v, float) for v in vs):
            means[k] = sum(vs) / len(vs)
        else:
            ts = [v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64) for v in vs]
            means[k] = torch.stack([t.to(ts[0].device) for t in ts]).mean()
    return metrics_to_floats(means, drop_nonfinite=True)


@dataclass
class _MiniBatch:
    """One mini-batch cut into micro-batches (rows of the consumed batch, the parts, their replayed routes) and its
    global token / sequence counts."""

    rows: list[torch.Tensor]
    parts: list[RolloutBatch]
    routes: list[Any]
    num_tokens: torch.Tensor
    num_seqs: torch.Tensor
    pr2_on: bool
    off_policy: bool = False
    global_sel: list = field(default_factory=list)
    skipped_rows: int = 0
    index: int = 0                  # which of the step's optimizer updates


def drop_constant_groups(batch: RolloutBatch, adv: torch.Tensor
                         ) -> tuple[Optional[RolloutBatch], torch.Tensor, dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476): the rows of every group whose advantages are all
    zero (its rewards all equal) leave the batch, so they count in neither the loss nor its token counts.  Returns
    the kept batch (None when no group is left), its advantages and ``dynamic_sampling/*`` metrics."""
    _, group = torch.unique(batch.group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    varies = torch.zeros(n_groups, dtype=torch.bool).index_put_((group,), adv != 0, accumulate=True)
    keep = varies[group].nonzero().flatten()
    metrics = {"dynamic_sampling/dropped_groups": float(n_groups - int(varies.sum())),
               "dynamic_sampling/kept_share": float(keep.numel()) / max(batch.size, 1)}
    if keep.numel() == 0:
        return None, adv[:0], metrics
    if keep.numel() == batch.size:
        return batch, adv, metrics
    return batch.index_select(keep), adv.index_select(0, keep), metrics


@dataclass
class TrainedPolicy:
    """What the update trains: the DDP-wrapped and bare policy, its optimizer and learning-rate schedule, and the
    PR2 router predictors (None without)."""

    model: torch.nn.Module
    bare_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    predictors: Any = None


class PolicyUpdate:
    """Applies the update of the module docstring; counts ``updates`` and ``nan_skipped`` (checkpointed by the
    trainer).  Built with the config, the loss, the routed forward, the run's old-log-prob strategy, the policy it
    trains (:class:`TrainedPolicy`), the accelerator, the task (rewards) and the run's non-finite policy."""

    def __init__(self, cfg: Any, *, loss: LossSetup, forward: RoutedForward, old_logps: OldLogpStrategy,
                 policy: TrainedPolicy, accelerator: Any, task: Any, nan: Optional[NanCounter] = None):
        """``nan``: the run's non-finite policy and counts (one is made from ``cfg.trainer`` when omitted)."""
        self.cfg = cfg
        self.spec = loss
        self.forward, self.old_logps = forward, old_logps
        self.model, self.bare_model = policy.model, policy.bare_model
        self.optimizer, self.scheduler, self.acc = policy.optimizer, policy.scheduler, accelerator
        self.task, self.predictors = task, policy.predictors
        self.world = accelerator.num_processes
        self.device = accelerator.device
        self.norm_length = cfg.algo.loss.norm_length or cfg.rollout.max_new_tokens
        self.loss_options = options_from(loss.fn, loss.options, cfg, self.norm_length)
        self.updates = 0
        self.nan = nan if nan is not None else NanCounter(cfg.trainer.on_nan, cfg.trainer.max_nan_skips)
        self._step, self._iteration = 0, 0
        self.guard = StepGuard(self.optimizer, self.scheduler)        # before each optimizer step (on_nan=skip)
        self.start_guard = StepGuard(self.optimizer, self.scheduler)  # the start of the policy update (step boundary)
        self._start: Optional[StepGuard] = None
        self.applied = 0                # optimizer updates applied by the current call
        self.finite = FiniteAgreement(self.nan, accelerator)     # checks agreed over processes, by stage

    @property
    def nan_skipped(self) -> int:
        """Skipped batches and updates (``actor/nan_skipped``), kept by :attr:`nan`."""
        return self.nan.skipped

    @nan_skipped.setter
    def nan_skipped(self, value: int) -> None:
        self.nan.skipped = int(value)

    def state_dict(self) -> dict:
        """The update's own checkpointed counter (the non-finite counts are :attr:`nan`'s)."""
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """Put back :meth:`state_dict`."""
        self.updates = int(state["updates"])

    @property
    def process_group(self):
        """The all-reduce group of global counts and selections (None with one process)."""
        return torch.distributed.group.WORLD if self.world > 1 else None

    # ------------------------------------------------------------------ the named steps
    def advantages(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Task rewards of the completions (every reward of ``task.rewards``, summed with weights) → group advantages
        (``algo.loss.adv_norm``) and ``reward/*`` (``reward/<name>`` per reward)."""
        # every configured reward (task.rewards), with the rows' prompts and dataset columns; RewardError under
        # task.on_reward_error=stop (the trainer checkpoints and stops)
        scores = self.task.score(batch.completions, batch.answers,
                                 **self.task.batch_context(batch.group_ids, self.cfg.rollout.prompts_per_step))
        rewards = torch.tensor(scores.total, dtype=torch.float32)
        adv, rmetrics = group_advantages(rewards, batch.group_ids, norm=self.cfg.algo.loss.adv_norm,
                                         return_metrics=True)
        metrics = metrics_to_floats(rmetrics, drop_nonfinite=True)
        metrics.update(scores.metrics())
        metrics["reward/std"] = float(rewards.std(unbiased=False)) if rewards.numel() > 1 else 0.0
        metrics["reward/response_len"] = float(batch.response_mask.sum(-1).float().mean())
        metrics["reward/adv_abs_mean"] = float(adv.abs().mean())
        return adv, metrics

    def ref_logp(self, batch: RolloutBatch, routes: Any) -> Optional[torch.Tensor]:
        """Log-probs of the frozen reference model (KL penalty), replaying ``routes``; None without one.  Raises
        :class:`NonFiniteError` (stage ``reference``) when one of the response tokens' is not finite."""
        if self.forward.ref_model is None:
            return None
        with torch.no_grad(), probes.poisoned("reference", self._step, self.forward.ref_model):
            lp = self.forward.logp_pieces(self.forward.ref_model, batch, routes).cpu()
        if not all_finite(lp, batch.response_mask):
            raise NonFiniteError("reference", "reference log-probs", step=self._step, iteration=self._iteration)
        return lp

    def __call__(self, batch: RolloutBatch, *, step: int, iteration: int, keep_start: bool = False
                 ) -> dict[str, float]:
        """Train on one consumed batch at policy version ``step``; returns the step's metrics (``_tokens``:
        attention tokens processed).  Under ``trainer.on_nan=stop`` a non-finite value raises
        :class:`NonFiniteError` with the weights, optimizer and scheduler put back as they were when this call
        started; so does the ``trainer.max_nan_skips``-th skip in a row under ``skip``.  ``keep_start``: keep the
        state of the start of the call for :meth:`restore_start` (the trainer evaluates the new weights next)."""
        self._step, self._iteration = step + 1, iteration
        self.finite.step, self.finite.iteration = self._step, iteration
        self.applied = 0
        one_update = self.cfg.trainer.updates_per_step == 1
        stop = self.cfg.trainer.on_nan == "stop"
        self._start = None
        if stop or (keep_start and not one_update):
            self.start_guard.snapshot()          # the last good state, restored before stopping
            self._start = self.start_guard
        elif keep_start:     # one update under skip: its own snapshot (taken before its optimizer step) is the start
            self._start = self.guard
        try:
            return self._update(batch, step)
        except NonFiniteError:
            if stop and self.start_guard.taken:
                self.start_guard.restore()
            self.optimizer.zero_grad(set_to_none=True)
            raise

    def restore_start(self) -> bool:
        """Put back the weights, optimizer and scheduler of the start of the last call (made with ``keep_start``
        or under ``on_nan=stop``); False when that call applied no update (nothing to put back)."""
        if self.applied == 0:
            return False
        if self._start is None or not self._start.taken:
            raise RuntimeError("PolicyUpdate.restore_start() without a state kept at the start of the update")
        self._start.restore()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _skip_batch(self, err: NonFiniteError, metrics: dict[str, float]) -> dict[str, float]:
        """A stage before any optimizer update found non-finite values: the policy decides (raise, or drop the
        batch: no update, counted)."""
        self.nan.record(err.located(self._step, self._iteration))
        return self._no_update(metrics)

    def _update(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        adv, metrics = self.advantages(batch)
        if self.cfg.algo.dynamic_sampling == "drop":
            batch, adv, ds = drop_constant_groups(batch, adv)
            metrics.update(ds)
            if batch is None:                # every group's rewards were equal: nothing to learn from this batch
                return self._no_update(metrics)
        routes = self.forward.routes_for_update(batch)
        old = self.old_logps.take(batch, step=step, routes=routes, adv=adv)   # the one old-log-prob call
        metrics.update(old.metrics)
        if self.finite.agreed(old.error, "old_logp", "old log-probs at consumption") is not None:
            return self._skip_batch(self.finite.agreed_err, metrics)
        err = None
        ref_lp = None
        try:
            ref_lp = self.ref_logp(batch, routes)
        except NonFiniteError as exc:
            err = exc
        if self.finite.agreed(err, "reference", "reference log-probs") is not None:
            return self._skip_batch(self.finite.agreed_err, metrics)
        skipped_before = self.nan.skipped
        mini_metrics: list[dict] = []
        grad_norms: list[torch.Tensor] = []
        on_policy = batch.version == step
        skip = self.skips_zero_advantage(old)
        skipped = 0
        for mb_num, micro in enumerate(self.forward.micro_batching.cut(batch.size, int(batch.input_ids.shape[1]))):
            # PR2: skip the predictor loss on the first mini-step of on-policy data (target = "no change")
            off_policy = not (on_policy and mb_num == 0)
            mb = self._cut(batch, micro, routes, pr2_on=off_policy, adv=adv if skip else None)
            mb.index = mb_num
            skipped += mb.skipped_rows
            mb.off_policy = off_policy
            mb.global_sel = self.global_selection(mb, adv)
            gn = self.minibatch_step(mb, adv, old, ref_lp, mini_metrics)
            if gn is not None:
                grad_norms.append(gn)
        if grad_norms:
            mini_metrics.append({"actor/grad_norm": torch.stack([g.float() for g in grad_norms]).mean()})
        metrics.update(mean_metrics(mini_metrics))
        metrics.update(old.finish(clean=self.nan.skipped == skipped_before))
        metrics["actor/zero_adv_share"] = float((adv == 0).float().mean()) if adv.numel() else 0.0
        metrics["actor/rows_skipped_share"] = skipped / max(batch.size, 1)
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics.update(self.nan.metrics())
        metrics["actor/updates"] = float(self.updates)
        metrics.update(self.forward.last_plan.metrics())     # perf/forward_*: the last update forward's way
        metrics["_tokens"] = float(int(batch.attention_mask.sum()))
        return metrics

    def _cut(self, batch: RolloutBatch, micro: list[torch.Tensor], routes: Any, *, pr2_on: bool,
             adv: Optional[torch.Tensor] = None) -> _MiniBatch:
        """The mini-batch of micro-batch rows ``micro`` (:meth:`MicroBatching.cut`) with its global counts.  With
        ``adv`` (``trainer.skip_zero_advantage``) the rows whose advantage is 0 then leave the micro-batches (the
        counts keep them; micro-batches left empty are dropped)."""
        n_tok, n_seq = global_counts([batch.response_mask.index_select(0, m).to(self.device) for m in micro],
                                     self.process_group)
        skipped = 0
        if adv is not None:
            kept = [m[adv.index_select(0, m) != 0] for m in micro]
            skipped = sum(int(m.numel()) for m in micro) - sum(int(k.numel()) for k in kept)
            micro = [k for k in kept if k.numel() > 0]
        parts = [batch.index_select(m) for m in micro]
        part_routes = [routes.index_select(m) if routes is not None else None for m in micro]
        return _MiniBatch(micro, parts, part_routes, n_tok, n_seq, pr2_on, skipped_rows=skipped)

    def skips_zero_advantage(self, old: BatchOldLogp) -> bool:
        """``trainer.skip_zero_advantage``, where a zero-advantage row contributes no gradient at all: not with a
        KL penalty or PR2 predictors (their terms do not vanish with the advantage), nor when the old log-probs
        come from the update forward itself (``old.every_row``: every row's forward is needed), nor with several
        processes (their backward passes must stay in step)."""
        return (self.cfg.trainer.skip_zero_advantage and not old.every_row and self.predictors is None
                and self.world == 1
                and not (self.forward.ref_model is not None and self.cfg.algo.kl.coef > 0))

    def _no_update(self, metrics: dict[str, float]) -> dict[str, float]:
        """A consumed batch with nothing left to train on (dynamic sampling dropped every group, or a non-finite
        reference or old log-prob under ``on_nan=skip``): no optimizer step; the schedule does not advance."""
        metrics.update({"actor/lr": float(self.optimizer.param_groups[0]["lr"]), "actor/updates": float(self.updates),
                        "_tokens": 0.0, **self.nan.metrics()})
        return metrics

    def global_selection(self, mb: _MiniBatch, adv: torch.Tensor) -> list[dict]:
        """The loss's selection over the WHOLE mini-batch (M2PO's token mask or adaptive cap), from one no-grad
        pass over its micro-batches; empty when the loss needs none or the loss call sees the whole mini-batch
        anyway (one micro-batch, one process)."""
        if not self.spec.global_pass or (len(mb.parts) <= 1 and self.world == 1):
            return [{} for _ in mb.parts]
        with torch.no_grad():
            lrs = [self.forward.logp(self.bare_model, p, r) - p.old_logp.to(self.device)
                   for p, r in zip(mb.parts, mb.routes)]
        advs = [adv.index_select(0, m).to(self.device) for m in mb.rows]
        masks = [p.response_mask.to(self.device) for p in mb.parts]
        opts = {k: v for k, v in self.spec.options.items() if k != "process_group"}
        return self.spec.spec.run_global_pass(lrs, advs, masks, opts, self.process_group)

    # ------------------------------------------------------------------ one optimizer update
    def minibatch_step(self, mb: _MiniBatch, adv: torch.Tensor, old: BatchOldLogp, ref_lp: Optional[torch.Tensor],
                       mini_metrics: list[dict]) -> Optional[torch.Tensor]:
        """Backward over the micro-batches (DDP syncs on the last), clip, step; returns the gradient norm, or None
        when the update was skipped as non-finite."""
        losses: list[torch.Tensor] = []
        ok = True
        for j in range(len(mb.parts)):
            last = j == len(mb.parts) - 1
            sync_ctx = self.acc.no_sync(self.model) if (not last and self.world > 1) else contextlib.nullcontext()
            with sync_ctx:
                loss, lm = self.micro_loss(mb, j, adv, old, ref_lp)
                if loss is None:
                    ok = False
                    break
                self.acc.backward(loss * self.world)    # DDP averages gradients over ranks; global counts already
            losses.append(loss.detach())
            mini_metrics.append(lm)
        gn = None
        if ok and mb.skipped_rows:
            zero_missing_grads(self.model)
        if ok:
            self.sync_predictor_grads()
            probes.poison_("gradients", self._step, next((p.grad for p in self.model.parameters()
                                                          if p.grad is not None), None))
            gn = grad_norm(self.acc, self.model, self.cfg.optim.grad_clip)
            ok = self.check_finite(torch.as_tensor(gn), "gradient norm", "gradients")
        if ok:
            ok = self.guarded_step()
        if ok:
            self.updates += 1
            self.applied += 1
            mini_metrics.append({"actor/loss": torch.stack(losses).sum() if losses else torch.zeros(())})
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.as_tensor(gn).detach() if ok else None

    def guarded_step(self) -> bool:
        """``optimizer.step()`` followed by one fused finiteness check of the parameters; non-finite parameters
        are put back to before the step (``on_nan=skip``: returns False, the update counts as skipped) or stop the
        run (``on_nan=stop``: :class:`NonFiniteError`, restored by the caller)."""
        skip = self.cfg.trainer.on_nan != "stop"
        if skip:
            self.guard.snapshot()
        self.optimizer.step()
        probes.poison_("optimizer", self._step, self.guard.params[0] if self.guard.params else None)
        if self.check_finite(self.guard.params_max_abs(), "parameters after the optimizer step", "optimizer"):
            return True
        self.guard.restore()
        return False

    def micro_loss(self, mb: _MiniBatch, j: int, adv: torch.Tensor, old: BatchOldLogp,
                   ref_lp: Optional[torch.Tensor]):
        """Micro-batch ``j``: its update forward (replaying its routes; recording what PR2, the drift metrics or
        the old-log-prob strategy need), its old log-probs and weights (:meth:`BatchOldLogp.micro`), and its loss
        (:func:`~offpolicy_moe.trainer.micro_loss.micro_batch_loss`) with its metrics; ``(None, {})`` when the loss
        is non-finite and ``trainer.on_nan=skip``."""
        dev = self.device
        p, rows, routes = mb.parts[j], mb.rows[j], mb.routes[j]
        feats = p.pr2_features if (self.predictors is not None and mb.pr2_on) else None
        pr2 = feats is not None and feats.num_tokens > 0
        # drift/*: the engine's recorded route vs the current router's own top-k, off-policy mini-steps only
        drift = self.cfg.algo.routing.drift_metrics and mb.off_policy and p.routes is not None
        cap, own, recorded = None, None, None
        if pr2:
            with self.forward.controller.capture_router_logits(feats) as cap:
                out = self.forward.logp(self.model, p, routes, record="own" if drift else False)
            logp, own = out if drift else (out, None)
        elif drift:
            logp, own = self.forward.logp(self.model, p, routes, record="own")
        elif old.record_routes:      # the trainer's own routes, for routing/*
            logp, recorded = self.forward.logp(self.model, p, routes, record=True)
        else:
            logp = self.forward.logp(self.model, p, routes)
        logp = probes.value("loss", self._step, logp)
        adv_rows = adv.index_select(0, rows).to(dev)
        mo = old.micro(rows, p, logp, mb.index, adv_rows, recorded)
        tensors = MicroBatchTensors(logp, mo.old_logp, adv_rows, p.response_mask.to(dev), mb.num_tokens,
                                    mb.num_seqs, weights=mo.weights, weight_metrics=mo.metrics,
                                    ref_logp=ref_lp.index_select(0, rows).to(dev) if ref_lp is not None else None,
                                    selection=mb.global_sel[j] if mb.global_sel else {})
        pr2_term = (pr2_predictor_loss(self.predictors, feats, cap.logits(), current_ids=cap.own_ids(),
                                       replayed_ids=feats.gather_trace(routes)) if pr2 else None)
        what = "loss"
        try:
            res = micro_batch_loss(tensors, self.loss_options, pr2_term, len(mb.parts))
        except (ValueError, RuntimeError) as exc:
            err = as_nonfinite(exc, "loss", "loss input")
            if err is None:
                raise
            # the loss library refused a NaN/Inf input (e.g. the update forward's log-probs): a non-finite loss,
            # decided below with the other processes (they must agree before any backward)
            nan = torch.full((), float("nan"), device=dev)
            res, what = MicroLoss(nan, nan, {}), err.what
        if not self.check_finite(res.policy.detach(), what, "loss"):
            return None, {}
        lm = res.metrics
        if own is not None:
            lm = dict(lm, **compare_traces(p.routes, own, p.attention_mask).zero_deviation_metrics("drift/"))
        return res.total, lm

    # ------------------------------------------------------------------ multi-process details
    def check_finite(self, value: torch.Tensor, what: str, stage: str) -> bool:
        """True when ``value`` is finite on every process, else the policy decides (:meth:`FiniteAgreement.check`)."""
        return self.finite.check(value, what, stage)

    def sync_predictor_grads(self) -> None:
        """The PR2 predictors' gradients averaged over processes by hand (:func:`average_predictor_grads`)."""
        average_predictor_grads(self.predictors, self.world)
