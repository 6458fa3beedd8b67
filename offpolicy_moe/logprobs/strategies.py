"""Where a batch's old log-probs come from: one strategy per run, chosen in
:func:`~offpolicy_moe.trainer.build.old_logp_strategy`.

=================  ==========================================================================================
strategy           the old log-probs (the PPO ratio's denominator) of a consumed batch
=================  ==========================================================================================
``Recomputed``     the trainer's pass right after generation, under the generating weights (``trainer``)
``Fused``          the detached log-probs of the single on-policy update's own forward (``trainer`` where that
                   pass would be redundant; a batch that cannot fuse gets the pass)
``FromEngine``     the engine's behaviour log-probs (``engine``, bypass)
``AtConsumption``  a no-grad pass under the weights at consumption (``proximal``, decoupled PPO)
``Loglinear``      AReaL's log-linear proximal estimate from each update forward (``proximal`` + ``loglinear``)
=================  ==========================================================================================

Each strategy answers twice.  :meth:`OldLogpStrategy.after_generation` runs the passes it needs right after
generation and returns the batch's old log-probs (or None: taken later), R2 routes and measurements; the
preparation stage (:mod:`~offpolicy_moe.logprobs.stage`) calls it.  :meth:`OldLogpStrategy.take` is the one
call the policy update makes on a consumed batch: a :class:`BatchOldLogp` with the whole batch's behaviour weights
and metrics, and per micro-batch the old log-probs and weights of its rows (:meth:`BatchOldLogp.micro`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from offpolicy_moe.losses import correction_weights, metrics_to_floats
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.run.nonfinite import NonFiniteError, all_finite, nonfinite_as
from offpolicy_moe.logprobs.passes import FusedOldLogp, OldLogpPass

__all__ = ["OldLogpStrategy", "AfterGeneration", "BatchOldLogp", "MicroOldLogp", "Recomputed", "Fused",
           "FromEngine", "AtConsumption", "Loglinear", "loglinear_proximal", "decoupled_weights"]


def loglinear_proximal(logp: torch.Tensor, part: RolloutBatch, update: int, step: int,
                       updates_per_step: int) -> torch.Tensor:
    """AReaL's proximal log-prob approximation (Fu et al. 2025, arXiv 2505.24298, "prox_approx"), interpolated in
    log space between the behaviour and the current policy by version:

        log pi_prox ~= log mu + alpha (log pi_theta - log mu),   alpha = (v_prox - v_mu) / (v_theta - v_mu),

    versions counted in optimizer updates: ``v_mu`` = the token's version x U, ``v_prox`` = ``step`` x U,
    ``v_theta`` = ``v_prox + update``.  On the step's first update ``alpha = 1``: the current log-prob, exactly."""
    U = int(updates_per_step)
    behav = part.behav_logp.to(logp.device)
    tv = part.token_versions if part.token_versions is not None else torch.full_like(behav, part.version,
                                                                                     dtype=torch.long)
    v_mu = tv.to(logp.device).double() * U
    v_prox, v_theta = float(step * U), float(step * U + update)
    span = v_theta - v_mu
    alpha = torch.where(span > 0, (v_prox - v_mu) / span.clamp(min=1.0), torch.ones_like(span)).to(logp.dtype)
    return torch.where(part.response_mask.to(logp.device).bool(), behav + alpha * (logp - behav), logp)


def decoupled_weights(corr: Any, old_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                      adv: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """Behaviour weights from ``old_logp`` (or the proximal log-probs) and ``behav_logp``: the configured correction
    ``corr`` (:func:`correction_weights`), or with ``corr.mode=none`` the plain decoupled-PPO weight
    ``pi_prox / mu = exp(clamp(old_logp - behav_logp, +-20))`` (Fu et al. 2025, arXiv 2505.24298), 0 where masked."""
    if corr.mode != "none":
        return correction_weights(old_logp, behav_logp, mask, level=corr.level, mode=corr.mode, high=corr.high,
                                  low=corr.low, advantages=adv, opsm_delta=corr.opsm_delta)
    lw = (old_logp - behav_logp).clamp(-20, 20)
    return torch.where(mask.bool(), lw.exp(), torch.zeros_like(lw)), {}


@dataclass(frozen=True)
class AfterGeneration:
    """What a strategy takes right after generation: the old log-probs (None: taken at consumption), R2's routes and
    the measurements."""

    old_logp: Optional[torch.Tensor]
    trainer_routes: Any = None
    extras: dict = field(default_factory=dict)


@dataclass
class MicroOldLogp:
    """One micro-batch's old log-probs, the behaviour weights of its rows (None: no correction) and the metrics of
    those weights when computed per micro-batch."""

    old_logp: torch.Tensor
    weights: Optional[torch.Tensor] = None
    metrics: dict = field(default_factory=dict)


class BatchOldLogp:
    """The old log-probs of one consumed batch as the update reads them: ``values`` (the whole batch's, or None
    where each micro-batch's come from its update forward), the behaviour ``weights`` (or None), ``metrics``, and
    ``error`` (a :class:`NonFiniteError` that makes the batch unusable, or None).  ``every_row``: each row's update
    forward gives its old log-probs, so no row may be left out; ``record_routes``: the update forward records the
    routes it used."""

    every_row = False
    record_routes = False

    def __init__(self, batch: RolloutBatch, device: torch.device, values: Optional[torch.Tensor] = None,
                 weights: Optional[torch.Tensor] = None, metrics: Optional[dict] = None,
                 error: Optional[NonFiniteError] = None):
        self.batch, self.device = batch, device
        self.values, self.weights = values, weights
        self.metrics = dict(metrics or {})
        self.error = error

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The old log-probs of batch rows ``rows`` on the update's device."""
        return self.values.index_select(0, rows).to(self.device)

    def micro(self, rows: torch.Tensor, part: RolloutBatch, logp: torch.Tensor, update: int,
              adv: torch.Tensor, routes: Any = None) -> MicroOldLogp:
        """Micro-batch rows ``rows`` (the part ``part``, its update forward's ``logp``, the ``update``-th optimizer
        update of the step, its advantages ``adv``, the routes the forward recorded)."""
        w = self.weights.index_select(0, rows).to(self.device) if self.weights is not None else None
        return MicroOldLogp(self.rows(rows), w)

    def finish(self, clean: bool) -> dict[str, float]:
        """After the last update on the batch (``clean``: none was dropped as non-finite): its metrics."""
        return {}


class _FusedBatch(BatchOldLogp):
    """A fused batch: each row's old log-probs are its update forward's, collected in :class:`FusedOldLogp`."""

    every_row = True

    def __init__(self, batch: RolloutBatch, device: torch.device, passes: OldLogpPass):
        super().__init__(batch, device)
        self.passes = passes
        self.collector = FusedOldLogp(tuple(batch.response_mask.shape), device, passes.records_fused_routes)
        self.record_routes = self.collector.record_routes

    def micro(self, rows, part, logp, update, adv, routes=None) -> MicroOldLogp:
        return MicroOldLogp(self.collector.add(rows, logp, routes))

    def finish(self, clean: bool) -> dict[str, float]:
        """The measurements of the skipped pass, from the update forward's values (nothing after a dropped update:
        its rows' old log-probs are unknown)."""
        return self.passes.fused_measurements(self.batch, self.collector)[1] if clean else {}


class _LoglinearBatch(BatchOldLogp):
    """The log-linear proximal estimate of each micro-batch from its update forward, with its behaviour weights."""

    every_row = True

    def __init__(self, batch: RolloutBatch, device: torch.device, passes: OldLogpPass, corr: Any, step: int,
                 updates_per_step: int):
        super().__init__(batch, device)
        self.passes, self.corr, self.step, self.updates_per_step = passes, corr, step, updates_per_step
        self.collector = FusedOldLogp(tuple(batch.response_mask.shape), device, False)

    def micro(self, rows, part, logp, update, adv, routes=None) -> MicroOldLogp:
        old = self.collector.add(rows, loglinear_proximal(logp.detach(), part, update, self.step,
                                                          self.updates_per_step))
        w, wm = decoupled_weights(self.corr, old, part.behav_logp.to(self.device),
                                  part.response_mask.to(self.device), adv)
        return MicroOldLogp(old, w, wm)

    def finish(self, clean: bool) -> dict[str, float]:
        """The mismatch of the proximal log-probs collected (nothing after a dropped update)."""
        return self.passes.mismatch(self.collector.values.cpu(), self.batch) if clean else {}


class OldLogpStrategy:
    """Where the old log-probs come from (module docstring); built with the passes, the correction config
    (``algo.correction``), the device of the update and the live policy (read by passes at consumption)."""

    def __init__(self, passes: OldLogpPass, corr: Any, device: torch.device, model: Optional[torch.nn.Module] = None):
        self.passes, self.corr, self.device, self.model = passes, corr, device, model

    # ------------------------------------------------------------------ right after generation
    def stage_after_generation(self, batch: RolloutBatch) -> str:
        """What a NaN right after generation spoils: ``old_logp`` where the old log-probs are taken then, else
        ``metrics`` (the measurements only)."""
        return "metrics"

    def after_generation(self, model: torch.nn.Module, batch: RolloutBatch) -> AfterGeneration:
        """The passes this strategy runs on a freshly generated ``batch`` under ``model`` (which holds the weights
        that generated it)."""
        return self._measured(model, batch, None)

    def _measured(self, model: torch.nn.Module, batch: RolloutBatch, old: Optional[torch.Tensor],
                  compare_old: bool = False) -> AfterGeneration:
        """Measurements only (``mismatch_metrics``: against the replayed or own pass); old log-probs ``old``."""
        p, tc = self.passes, self.passes.cfg.trainer
        own = p.measure_routing or (compare_old and bool(tc.mismatch_metrics))
        values = p.after_generation(model, batch, own=own,
                                    replayed=p.is_moe and p.measure_routing and bool(tc.mismatch_metrics))
        extras = dict(values.extras)
        if compare_old and tc.mismatch_metrics:
            ref = values.replayed if (p.replays_engine and values.replayed is not None) else values.own
            if ref is not None:
                extras.update(p.mismatch(ref, batch))
        extras.update(p.both_extras(values, batch))
        return AfterGeneration(old, values.trainer_routes, extras)

    # ------------------------------------------------------------------ at consumption
    def take(self, batch: RolloutBatch, *, step: int, routes: Any, adv: torch.Tensor) -> BatchOldLogp:
        """The update's call on a consumed batch at policy version ``step`` (``routes``: what its forwards replay;
        ``adv``: its advantages).  Non-finite old log-probs (or weights refused for them) are its ``error``."""
        metrics: dict[str, float] = {}
        values = None
        try:
            with nonfinite_as("old_logp", "old log-probs at consumption"):
                values = self.at_consumption(batch, routes, metrics)
                if values is not None and not all_finite(values, batch.response_mask):
                    raise NonFiniteError("old_logp", "old log-probs")
                weights = self.behaviour_weights(batch, values, adv, metrics)
        except NonFiniteError as exc:
            return BatchOldLogp(batch, self.device, values, metrics=metrics, error=exc)
        return BatchOldLogp(batch, self.device, values, weights, metrics)

    def at_consumption(self, batch: RolloutBatch, routes: Any, metrics: dict) -> Optional[torch.Tensor]:
        """The batch's old log-probs when it is consumed (those prepared after generation, by default), their
        metrics added to ``metrics``."""
        return batch.old_logp

    def behaviour_weights(self, batch: RolloutBatch, old: torch.Tensor, adv: torch.Tensor,
                          metrics: dict) -> Optional[torch.Tensor]:
        """The whole batch's per-token correction weights (``algo.correction``; None without a correction)."""
        if self.corr.mode == "none":
            return None
        weights, wm = decoupled_weights(self.corr, old, batch.behav_logp, batch.response_mask, adv)
        metrics.update(metrics_to_floats(wm, drop_nonfinite=True))
        return weights


class Recomputed(OldLogpStrategy):
    """``trainer``: the trainer's own pass right after generation, under the generating weights (replaying the
    engine's routes under R3/PR2)."""

    def stage_after_generation(self, batch: RolloutBatch) -> str:
        return "old_logp"

    def after_generation(self, model: torch.nn.Module, batch: RolloutBatch) -> AfterGeneration:
        p, tc = self.passes, self.passes.cfg.trainer
        values = p.after_generation(model, batch, own=not p.replays_engine or p.measure_routing,
                                    replayed=p.replays_engine or (p.is_moe and p.measure_routing
                                                                  and bool(tc.mismatch_metrics)))
        old = values.replayed if p.replays_engine else values.own
        extras = dict(values.extras)
        if old is not None:
            extras.update(p.mismatch(old, batch))
        extras.update(p.both_extras(values, batch))
        return AfterGeneration(old, values.trainer_routes, extras)


class Fused(Recomputed):
    """``trainer`` where the pass is redundant (:func:`~offpolicy_moe.trainer.build.fuses_old_logp`): the single
    on-policy update's forward gives the old log-probs; a batch that cannot fuse (routing measured over several
    micro-batches) gets the pass."""

    def can_fuse(self, batch: RolloutBatch) -> bool:
        return not self.passes.measure_routing or self.passes.one_micro_batch(batch)

    def stage_after_generation(self, batch: RolloutBatch) -> str:
        return "metrics" if self.can_fuse(batch) else "old_logp"

    def after_generation(self, model: torch.nn.Module, batch: RolloutBatch) -> AfterGeneration:
        if not self.can_fuse(batch):
            return super().after_generation(model, batch)
        p = self.passes
        extras: dict[str, float] = {}
        if p.measure_routing and p.cfg.trainer.mismatch_metrics and batch.routes is not None:
            # under routing measurements the "with R3" counterfactual keeps its one replayed pass
            values = p.after_generation(model, batch, own=False, replayed=True)
            extras = p.mismatch_extras(values.replayed, batch, "r3")
        return AfterGeneration(None, None, extras)

    def take(self, batch: RolloutBatch, *, step: int, routes: Any, adv: torch.Tensor) -> BatchOldLogp:
        """A fused batch (no old log-probs yet) gets a collector; refused unless consumed by the single on-policy
        update it was planned for."""
        if batch.old_logp is not None:
            return super().take(batch, step=step, routes=routes, adv=adv)
        if batch.version != step:
            raise RuntimeError(f"batch of version {batch.version} fused its old log-probs into the update, but the "
                               f"trainer is at version {step} with 1 update per step: they can only come from a "
                               "single on-policy update")
        return _FusedBatch(batch, self.device, self.passes)


class FromEngine(OldLogpStrategy):
    """``engine`` (bypass): the behaviour log-probs are the old log-probs; no correction weights."""

    def after_generation(self, model: torch.nn.Module, batch: RolloutBatch) -> AfterGeneration:
        return self._measured(model, batch, batch.behav_logp.clone(), compare_old=True)

    def behaviour_weights(self, batch, old, adv, metrics):
        return None


class AtConsumption(OldLogpStrategy):
    """``proximal``: a no-grad pass under the weights at consumption, replaying the update's routes; its behaviour
    weights are the correction's or the plain decoupled-PPO ``pi_prox / mu``."""

    def at_consumption(self, batch: RolloutBatch, routes: Any, metrics: dict) -> torch.Tensor:
        values = self.passes.at_weights(self.model, batch, routes)
        metrics.update(self.passes.mismatch(values, batch))
        return values

    def behaviour_weights(self, batch, old, adv, metrics):
        weights, wm = decoupled_weights(self.corr, old, batch.behav_logp, batch.response_mask, adv)
        metrics.update(metrics_to_floats(wm, drop_nonfinite=True))
        return weights


class Loglinear(OldLogpStrategy):
    """``proximal`` with ``algo.proximal_logp=loglinear``: no pass; each micro-batch's proximal log-probs are
    interpolated from its update forward (:func:`loglinear_proximal`)."""

    def __init__(self, passes: OldLogpPass, corr: Any, device: torch.device, model: Optional[torch.nn.Module],
                 updates_per_step: int):
        super().__init__(passes, corr, device, model)
        self.updates_per_step = int(updates_per_step)

    def take(self, batch: RolloutBatch, *, step: int, routes: Any, adv: torch.Tensor) -> BatchOldLogp:
        return _LoglinearBatch(batch, self.device, self.passes, self.corr, step, self.updates_per_step)
