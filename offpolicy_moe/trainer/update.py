"""The policy update on one consumed batch: rewards → group advantages → behaviour weights → reference log-probs
→ ``trainer.updates_per_step`` optimizer updates over contiguous mini-batches of ``trainer.grad_accum``
micro-batches each.

Loss denominators are the GLOBAL token/sequence counts of the mini-batch (all micro-batches, all processes), so
the update does not depend on how the mini-batch is cut; a loss that selects tokens over the whole mini-batch
(M2PO, arXiv 2510.01161) gets that selection from one no-grad pre-pass.  PR2 adds its predictor loss in the same
backward.

The update is driven in parts by the training loop, which owns the step's transaction
(:mod:`~offpolicy_moe.trainer.transaction`) and the run's one non-finite policy: :meth:`PolicyUpdate.start`
(rewards, advantages, dynamic sampling), :meth:`PolicyUpdate.prepare` (old log-probs at consumption, reference
log-probs), one :meth:`PolicyUpdate.optimizer_update` per mini-batch, and :meth:`PolicyUpdate.finish` (the step's
metrics).  A non-finite value in any part is raised as one :class:`~offpolicy_moe.run.nonfinite.NonFiniteError`
naming its stage, agreed over processes (:class:`~offpolicy_moe.logprobs.finite_agreement.FiniteAgreement`): the
old log-probs at consumption (``old_logp``) and the reference log-probs (``reference``) from ``prepare``, which
makes the whole batch unusable; the loss (or the loss library's refusal of a NaN log-prob), the gradient norm
(``gradients``) and the parameters after ``optimizer.step()`` (``optimizer``) from ``optimizer_update``, which makes
that one optimizer update unusable.  The update never catches it: the loop rolls back what it must and applies
``trainer.on_nan``.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from offpolicy_moe.rollout.batch import RolloutBatch, generation_shape
from offpolicy_moe.run import probes
from offpolicy_moe.run.nonfinite import NonFiniteError, all_finite, nonfinite_as
from offpolicy_moe.logprobs.finite_agreement import FiniteAgreement
from offpolicy_moe.logprobs.forward import RoutedForward
from offpolicy_moe.trainer.grads import average_predictor_grads, grad_norm, zero_missing_grads
from offpolicy_moe.trainer.micro_loss import MicroBatchTensors, MicroLoss, micro_batch_loss, options_from
from offpolicy_moe.logprobs.strategies import BatchOldLogp, OldLogpStrategy
from offpolicy_moe.trainer.step_guard import max_abs
from offpolicy_moe.losses import (LossSpec, get_loss_spec, global_counts, group_advantages, metrics_to_floats,
                                  resolve_loss_options)
from offpolicy_moe.routing import compare_traces, pr2_predictor_loss

__all__ = ["PolicyUpdate", "TrainedPolicy", "UpdateWork", "LossSetup", "loss_setup", "mean_metrics",
           "drop_constant_groups", "zero_missing_grads"]


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


@dataclass
class UpdateWork:
    """One consumed batch on its way through the update: the batch (None once dynamic sampling left nothing to
    train on), its advantages, the metrics gathered so far, and what :meth:`PolicyUpdate.prepare` adds (routes,
    old log-probs, reference log-probs, the cut into mini-batches) and each optimizer update leaves (metrics,
    gradient norms, rows skipped, updates dropped)."""

    batch: Optional[RolloutBatch]
    adv: torch.Tensor
    metrics: dict
    step: int                       # the policy version the batch is trained at (trained steps before it)
    routes: Any = None
    old: Optional[BatchOldLogp] = None
    ref_lp: Optional[torch.Tensor] = None
    cuts: list = field(default_factory=list)
    skip_zero: bool = False
    mini_metrics: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    skipped_rows: list = field(default_factory=list)    # rows left out, per optimizer update
    dropped: list = field(default_factory=list)         # optimizer updates dropped as non-finite


class PolicyUpdate:
    """Applies the update of the module docstring; counts ``updates`` (checkpointed: :meth:`state_dict`).  Built
    with the config, the loss, the routed forward, the run's old-log-prob strategy, the policy it trains
    (:class:`TrainedPolicy`), the accelerator and the task (rewards)."""

    def __init__(self, cfg: Any, *, loss: LossSetup, forward: RoutedForward, old_logps: OldLogpStrategy,
                 policy: TrainedPolicy, accelerator: Any, task: Any):
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
        self._step, self._iteration = 0, 0
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]   # checked after each step
        self.finite = FiniteAgreement(accelerator)     # checks agreed over processes, by stage

    def state_dict(self) -> dict:
        """The update's own checkpointed counter (the non-finite counts are the loop's)."""
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """Put back :meth:`state_dict` (extra keys are ignored: a checkpoint keeps it among the run's counters)."""
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
        metrics.update(generation_shape(batch))
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

    def start(self, batch: RolloutBatch, *, step: int, iteration: int) -> UpdateWork:
        """The update of one consumed batch at policy version ``step`` (generation iteration ``iteration``) begins:
        rewards, group advantages and (``algo.dynamic_sampling=drop``) the groups left to train on.  A
        :class:`~offpolicy_moe.tasks.RewardError` under ``task.on_reward_error=stop`` propagates."""
        self._step, self._iteration = step + 1, iteration
        self.finite.at(self._step, iteration)
        adv, metrics = self.advantages(batch)
        if self.cfg.algo.dynamic_sampling == "drop":
            batch, adv, ds = drop_constant_groups(batch, adv)
            metrics.update(ds)              # batch None: every group's rewards were equal, nothing to learn from
        return UpdateWork(batch, adv, metrics, step)

    def prepare(self, work: UpdateWork) -> UpdateWork:
        """The routes the update's forwards replay, the old log-probs (the strategy's one ``take``) and the
        reference log-probs of ``work``'s batch, and its cut into mini-batches.  Raises :class:`NonFiniteError`
        (stage ``old_logp`` or ``reference``, agreed over processes) when the batch cannot be trained on; the
        metrics taken until then are in ``work.metrics``; returns the work with them."""
        batch = work.batch
        routes = self.forward.routes_for_update(batch)
        old = self.old_logps.take(batch, step=work.step, routes=routes, adv=work.adv)   # the one call
        work.metrics.update(old.metrics)
        self.finite.raise_agreed(old.error, "old_logp", "old log-probs at consumption")
        err = ref_lp = None
        try:
            ref_lp = self.ref_logp(batch, routes)
        except NonFiniteError as exc:
            err = exc
        self.finite.raise_agreed(err, "reference", "reference log-probs")
        return replace(work, routes=routes, old=old, ref_lp=ref_lp, skip_zero=self.skips_zero_advantage(old),
                       cuts=self.forward.micro_batching.batch_cut(batch.attention_mask))

    def optimizer_updates(self, work: UpdateWork) -> int:
        """How many optimizer updates :meth:`prepare` cut ``work``'s batch into."""
        return len(work.cuts)

    def optimizer_update(self, work: UpdateWork, index: int) -> None:
        """Optimizer update ``index`` of the step on its mini-batch (:meth:`minibatch_step`), then the schedule's
        step.  Raises :class:`NonFiniteError` (``loss``, ``gradients``, ``optimizer``) with the update unfinished:
        the caller undoes it (the parameters of before its optimizer step) and calls :meth:`dropped_update`."""
        batch = work.batch
        # PR2: skip the predictor loss on the first mini-step of on-policy data (target = "no change")
        off_policy = not (batch.version == work.step and index == 0)
        mb = self._cut(batch, work.cuts[index], work.routes, pr2_on=off_policy,
                       adv=work.adv if work.skip_zero else None)
        mb = replace(mb, index=index, off_policy=off_policy, global_sel=self.global_selection(mb, work.adv, work.old))
        work.skipped_rows.append(mb.skipped_rows)
        work.grad_norms.append(self.minibatch_step(mb, work.adv, work.old, work.ref_lp, work.mini_metrics))

    def dropped_update(self, work: UpdateWork) -> None:
        """After an optimizer update dropped as non-finite (and undone by the caller): the schedule still takes its
        step, the gradients are dropped."""
        work.dropped.append(len(work.grad_norms))
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def finish(self, work: UpdateWork, nan_metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics once every optimizer update ran (``_tokens``: attention tokens processed);
        ``nan_metrics``: the loop's non-finite counts, logged with them."""
        batch, adv, metrics = work.batch, work.adv, work.metrics
        mini_metrics = work.mini_metrics
        if work.grad_norms:
            mini_metrics.append({"actor/grad_norm": torch.stack([g.float() for g in work.grad_norms]).mean()})
        metrics.update(mean_metrics(mini_metrics))
        metrics.update(work.old.finish(clean=not work.dropped))
        metrics["actor/zero_adv_share"] = float((adv == 0).float().mean()) if adv.numel() else 0.0
        metrics["actor/rows_skipped_share"] = sum(work.skipped_rows) / max(batch.size, 1)
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics.update(nan_metrics)
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

    def no_update(self, work: UpdateWork, nan_metrics: dict[str, float]) -> dict[str, float]:
        """The metrics of a consumed batch with nothing left to train on (dynamic sampling dropped every group, or
        a non-finite reference or old log-prob under ``on_nan=skip``): no optimizer step; the schedule does not
        advance.  ``nan_metrics``: the loop's non-finite counts."""
        metrics = work.metrics
        metrics.update({"actor/lr": float(self.optimizer.param_groups[0]["lr"]), "actor/updates": float(self.updates),
                        "_tokens": 0.0, **nan_metrics})
        return metrics

    def global_selection(self, mb: _MiniBatch, adv: torch.Tensor, old: BatchOldLogp) -> list[dict]:
        """The loss's selection over the WHOLE mini-batch (M2PO's token mask or adaptive cap), from one no-grad
        pass over its micro-batches; empty when the loss needs none or the loss call sees the whole mini-batch
        anyway (one micro-batch, one process)."""
        if not self.spec.global_pass or (len(mb.parts) <= 1 and self.world == 1):
            return [{} for _ in mb.parts]
        with torch.no_grad():
            lrs = [self.forward.logp(self.bare_model, p, r) - old.rows(m)
                   for p, r, m in zip(mb.parts, mb.routes, mb.rows)]
        advs = [adv.index_select(0, m).to(self.device) for m in mb.rows]
        masks = [p.response_mask.to(self.device) for p in mb.parts]
        opts = {k: v for k, v in self.spec.options.items() if k != "process_group"}
        return self.spec.spec.run_global_pass(lrs, advs, masks, opts, self.process_group)

    # ------------------------------------------------------------------ one optimizer update
    def minibatch_step(self, mb: _MiniBatch, adv: torch.Tensor, old: BatchOldLogp, ref_lp: Optional[torch.Tensor],
                       mini_metrics: list[dict]) -> torch.Tensor:
        """Backward over the micro-batches (DDP syncs on the last), clip, step, schedule; returns the gradient norm.
        A non-finite loss, gradient norm or parameter raises :class:`NonFiniteError` before the schedule's step
        (the metrics of the micro-batches before it are in ``mini_metrics``)."""
        losses: list[torch.Tensor] = []
        for j in range(len(mb.parts)):
            last = j == len(mb.parts) - 1
            sync_ctx = self.acc.no_sync(self.model) if (not last and self.world > 1) else contextlib.nullcontext()
            with sync_ctx:
                loss, lm = self.micro_loss(mb, j, adv, old, ref_lp)
                self.acc.backward(loss * self.world)    # DDP averages gradients over ranks; global counts already
            losses.append(loss.detach())
            mini_metrics.append(lm)
        if mb.skipped_rows:
            zero_missing_grads(self.model)
        self.sync_predictor_grads()
        probes.poison_("gradients", self._step, next((p.grad for p in self.model.parameters()
                                                      if p.grad is not None), None))
        gn = grad_norm(self.acc, self.model, self.cfg.optim.grad_clip)
        self.finite.require(torch.as_tensor(gn), "gradient norm", "gradients")
        self.checked_step()
        self.updates += 1
        mini_metrics.append({"actor/loss": torch.stack(losses).sum() if losses else torch.zeros(())})
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.as_tensor(gn).detach()

    def checked_step(self) -> None:
        """``optimizer.step()`` followed by one fused finiteness check of the parameters
        (:func:`~offpolicy_moe.trainer.step_guard.max_abs`): non-finite parameters raise :class:`NonFiniteError`
        (stage ``optimizer``), left for the caller's transaction to put back."""
        self.optimizer.step()
        probes.poison_("optimizer", self._step, self.params[0] if self.params else None)
        self.finite.require(max_abs(self.params), "parameters after the optimizer step", "optimizer")

    def micro_loss(self, mb: _MiniBatch, j: int, adv: torch.Tensor, old: BatchOldLogp,
                   ref_lp: Optional[torch.Tensor]):
        """Micro-batch ``j``: its update forward (replaying its routes; recording what PR2, the drift metrics or
        the old-log-prob strategy need), its old log-probs and weights (:meth:`BatchOldLogp.micro`), and its loss
        (:func:`~offpolicy_moe.trainer.micro_loss.micro_batch_loss`) with its metrics; a non-finite loss (on any
        process) raises :class:`NonFiniteError` (stage ``loss``)."""
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
            with nonfinite_as("loss", "loss input"):
                res = micro_batch_loss(tensors, self.loss_options, pr2_term, len(mb.parts))
        except NonFiniteError as err:
            # the loss library refused a NaN/Inf input (e.g. the update forward's log-probs): a non-finite loss,
            # decided below with the other processes (they must agree before any backward)
            nan = torch.full((), float("nan"), device=dev)
            res, what = MicroLoss(nan, nan, {}), err.what
        self.finite.require(res.policy.detach(), what, "loss")
        lm = res.metrics
        if own is not None:
            lm = dict(lm, **compare_traces(p.routes, own, p.attention_mask).zero_deviation_metrics("drift/"))
        return res.total, lm

    # ------------------------------------------------------------------ multi-process details
    def sync_predictor_grads(self) -> None:
        """The PR2 predictors' gradients averaged over processes by hand (:func:`average_predictor_grads`)."""
        average_predictor_grads(self.predictors, self.world)
