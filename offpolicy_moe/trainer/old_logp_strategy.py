"""Where a batch's old log-probs come from: one strategy per run, chosen once by
:func:`~offpolicy_moe.trainer.build.old_logp_strategy` from ``algo.old_logp_source`` (no other module reads it).

=================  ==========================================================================================
strategy           the old log-probs (the PPO ratio's denominator) of a consumed batch
=================  ==========================================================================================
``Recomputed``     the trainer's pass right after generation, under the generating weights (``trainer``)
``Fused``          the detached log-probs of the single on-policy update's own forward (``trainer`` where that
                   pass would be redundant; a batch that cannot fuse falls back to the pass)
``FromEngine``     the engine's behaviour log-probs (``engine``, bypass)
``AtConsumption``  a no-grad pass under the weights at consumption (``proximal``, decoupled PPO)
``Loglinear``      AReaL's log-linear proximal estimate from each update forward (``proximal`` + ``loglinear``)
=================  ==========================================================================================

Each has two doors: :meth:`OldLogpStrategy.prepare`, which the batch source calls right after generation
(measurements, and the old log-probs where they are taken then), and :meth:`OldLogpStrategy.take`, the one call
the policy update makes on a consumed batch.  ``take`` returns a :class:`BatchOldLogp`: the whole batch's behaviour
weights and metrics, and per micro-batch the old log-probs and weights of its rows (:meth:`BatchOldLogp.micro`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from offpolicy_moe.losses import correction_weights, metrics_to_floats
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.run.nonfinite import NonFiniteError, all_finite, as_nonfinite
from offpolicy_moe.trainer.old_logp import FusedOldLogp, OldLogpPass

__all__ = ["OldLogpStrategy", "BatchOldLogp", "MicroOldLogp", "Recomputed", "Fused", "FromEngine",
           "AtConsumption", "Loglinear", "loglinear_proximal", "decoupled_weights"]


def loglinear_proximal(logp: torch.Tensor, part: RolloutBatch, update: int, step: int,
                       updates_per_step: int) -> torch.Tensor:
    """AReaL's proximal log-prob approximation (Fu et al. 2025, arXiv 2505.24298, "prox_approx"): the proximal
    policy's log-prob interpolated in log space between the behaviour and the current policy by version,

        log pi_prox ~= log mu + alpha (log pi_theta - log mu),   alpha = (v_prox - v_mu) / (v_theta - v_mu),

    counting versions in optimizer updates: ``v_mu`` = the token's version x U, ``v_prox`` = ``step`` x U (the
    weights at consumption), ``v_theta`` = ``v_prox + update`` (the ``update``-th of the step's U updates).  On the
    step's first update ``v_theta = v_prox``, so ``alpha = 1`` and the value is the current log-prob: exact."""
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
    ``corr`` (``algo.correction``, :func:`correction_weights`; its metrics as tensors), or with ``corr.mode=none``
    the plain decoupled-PPO weight ``pi_prox / mu = exp(clamp(old_logp - behav_logp, +-20))`` (AReaL, Fu et al.
    2025, arXiv 2505.24298), 0 at masked positions, without metrics."""
    if corr.mode != "none":
        return correction_weights(old_logp, behav_logp, mask, level=corr.level, mode=corr.mode, high=corr.high,
                                  low=corr.low, advantages=adv, opsm_delta=corr.opsm_delta)
    lw = (old_logp - behav_logp).clamp(-20, 20)
    return torch.where(mask.bool(), lw.exp(), torch.zeros_like(lw)), {}


@dataclass
class MicroOldLogp:
    """One micro-batch's old log-probs, the behaviour weights of its rows (None: no correction) and the metrics of
    those weights when they are computed per micro-batch."""

    old_logp: torch.Tensor
    weights: Optional[torch.Tensor] = None
    metrics: dict = field(default_factory=dict)


class BatchOldLogp:
    """The old log-probs of one consumed batch as the update reads them: ``batch.old_logp`` with the whole batch's
    behaviour ``weights`` (or None) and ``metrics``; ``error``: the :class:`NonFiniteError` (stage ``old_logp``)
    that makes the batch unusable, or None.  ``every_row``: each row's update forward is needed (the old
    log-probs come from it), so no row may be left out; ``record_routes``: the update forward must record the routes
    it used (for the measurements of :meth:`finish`)."""

    every_row = False
    record_routes = False

    def __init__(self, batch: RolloutBatch, device: torch.device, weights: Optional[torch.Tensor] = None,
                 metrics: Optional[dict] = None):
        self.batch, self.device = batch, device
        self.weights = weights
        self.metrics = dict(metrics or {})
        self.error: Optional[NonFiniteError] = None

    def micro(self, rows: torch.Tensor, part: RolloutBatch, logp: torch.Tensor, update: int,
              adv: torch.Tensor, routes: Any = None) -> MicroOldLogp:
        """Micro-batch rows ``rows`` (the part ``part``, its update forward's ``logp``, the ``update``-th optimizer
        update of the step, its advantages ``adv`` on the device, the routes the forward recorded)."""
        w = self.weights.index_select(0, rows).to(self.device) if self.weights is not None else None
        return MicroOldLogp(part.old_logp.to(self.device), w)

    def finish(self, clean: bool) -> dict[str, float]:
        """After the last update on the batch (``clean``: none was dropped as non-finite): its metrics."""
        return {}


class _FusedBatch(BatchOldLogp):
    """A fused batch: the old log-probs of each row are its update forward's, collected in :class:`FusedOldLogp`."""

    every_row = True

    def __init__(self, batch: RolloutBatch, device: torch.device, passes: OldLogpPass):
        super().__init__(batch, device)
        self.passes = passes
        self.collector = FusedOldLogp(tuple(batch.response_mask.shape), device, passes.records_fused_routes)
        self.record_routes = self.collector.record_routes

    def micro(self, rows, part, logp, update, adv, routes=None) -> MicroOldLogp:
        if routes is not None:
            self.collector.routes = routes
        return MicroOldLogp(self.collector.add(rows, logp))

    def finish(self, clean: bool) -> dict[str, float]:
        """Set ``batch.old_logp`` from the update forward and make the measurements the skipped pass would have made
        (a dropped update leaves its rows' old log-probs unknown: nothing then)."""
        return self.passes.finish_fused(self.batch, self.collector) if clean else {}


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
        """``batch.old_logp`` = the proximal log-probs collected, and their mismatch (nothing after a dropped
        update)."""
        if not clean:
            return {}
        self.batch.old_logp = self.collector.values.cpu()
        return self.passes.mismatch(self.batch.old_logp, self.batch)


class OldLogpStrategy:
    """Where the old log-probs come from (module docstring); built with the pass after generation (its
    measurements), the correction config (``algo.correction``) and the device of the update."""

    #: what :meth:`OldLogpPass.prepare` does for this strategy: recompute (``trainer``), copy the engine's
    #: (``engine``) or leave them to the update (``consumption``)
    prepared_by = "trainer"

    def __init__(self, passes: OldLogpPass, corr: Any, device: torch.device):
        self.passes, self.corr, self.device = passes, corr, device

    def can_fuse(self, batch: Optional[RolloutBatch] = None) -> bool:
        """True when ``batch``'s old log-probs come from its update forward (no pass after generation)."""
        return False

    def takes_at_prepare(self, batch: RolloutBatch) -> bool:
        """True when :meth:`prepare` computes ``batch``'s old log-probs (a non-finite one there is stage
        ``old_logp``, not ``metrics``)."""
        return self.prepared_by == "trainer" and not self.can_fuse(batch)

    @torch.no_grad()
    def prepare(self, batch: RolloutBatch) -> None:
        """Right after generation: the measurements, and the old log-probs where this strategy takes them then."""
        self.passes.prepare(batch, self.prepared_by)

    def take(self, batch: RolloutBatch, *, step: int, routes: Any, adv: torch.Tensor) -> BatchOldLogp:
        """The update's call on a consumed batch at policy version ``step`` (``routes``: what its forwards replay;
        ``adv``: its advantages).  Non-finite old log-probs (or weights refused for them) are its ``error``, with
        the metrics taken until then."""
        old = BatchOldLogp(batch, self.device)
        try:
            old.metrics.update(self.at_consumption(batch, routes))
            if batch.old_logp is not None and not all_finite(batch.old_logp, batch.response_mask):
                raise NonFiniteError("old_logp", "old log-probs")
            old.weights, wm = self.behaviour_weights(batch, adv)
            old.metrics.update(wm)
        except (ValueError, RuntimeError) as exc:
            old.error = as_nonfinite(exc, "old_logp", "old log-probs at consumption")
            if old.error is None:
                raise
        return old

    def at_consumption(self, batch: RolloutBatch, routes: Any) -> dict[str, float]:
        """What is computed when the batch is consumed, before its behaviour weights (nothing by default)."""
        return {}

    def behaviour_weights(self, batch: RolloutBatch, adv: torch.Tensor) -> tuple[Optional[torch.Tensor], dict]:
        """The whole batch's per-token correction weights (``algo.correction``; None without a correction)."""
        if self.corr.mode == "none":
            return None, {}
        weights, wm = decoupled_weights(self.corr, batch.old_logp, batch.behav_logp, batch.response_mask, adv)
        return weights, metrics_to_floats(wm, drop_nonfinite=True)


class Recomputed(OldLogpStrategy):
    """``trainer``: the trainer's own pass right after generation, under the generating weights."""


class Fused(Recomputed):
    """``trainer`` where the pass is redundant (:func:`~offpolicy_moe.trainer.build.old_logp_strategy`): the
    single on-policy update's forward gives the old log-probs; a batch that cannot fuse (routing measured over
    several micro-batches) gets the pass."""

    def can_fuse(self, batch: Optional[RolloutBatch] = None) -> bool:
        return not self.passes.measure_routing or self.passes.one_micro_batch(batch)

    @torch.no_grad()
    def prepare(self, batch: RolloutBatch) -> None:
        if self.can_fuse(batch):
            self.passes.prepare_fused(batch)
        else:
            super().prepare(batch)

    def take(self, batch: RolloutBatch, *, step: int, routes: Any, adv: torch.Tensor) -> BatchOldLogp:
        """A fused batch's collector; refuses one that is not consumed by the single on-policy update it was
        planned for."""
        if not (batch.old_logp is None and batch.old_logp_fused):
            return super().take(batch, step=step, routes=routes, adv=adv)
        if batch.version != step:
            raise RuntimeError(f"batch of version {batch.version} fused its old log-probs into the update, but the "
                               f"trainer is at version {step} with 1 update per step: they can only come from a "
                               "single on-policy update")
        return _FusedBatch(batch, self.device, self.passes)


class FromEngine(OldLogpStrategy):
    """``engine`` (bypass): the behaviour log-probs are the old log-probs; no correction weights."""

    prepared_by = "engine"

    def behaviour_weights(self, batch, adv):
        return None, {}


class AtConsumption(OldLogpStrategy):
    """``proximal``: a no-grad pass under the weights at consumption, replaying the update's routes; its behaviour
    weights are the correction's or the plain decoupled-PPO ``pi_prox / mu``."""

    prepared_by = "consumption"

    def at_consumption(self, batch: RolloutBatch, routes: Any) -> dict[str, float]:
        return self.passes.recompute(batch, routes)

    def behaviour_weights(self, batch, adv):
        weights, wm = decoupled_weights(self.corr, batch.old_logp, batch.behav_logp, batch.response_mask, adv)
        return weights, metrics_to_floats(wm, drop_nonfinite=True)


class Loglinear(OldLogpStrategy):
    """``proximal`` with ``algo.proximal_logp=loglinear``: no pass; each micro-batch's proximal log-probs are
    interpolated from its update forward (:func:`loglinear_proximal`), its weights computed with them."""

    prepared_by = "consumption"

    def __init__(self, passes: OldLogpPass, corr: Any, device: torch.device, updates_per_step: int):
        super().__init__(passes, corr, device)
        self.updates_per_step = int(updates_per_step)

    def take(self, batch: RolloutBatch, *, step: int, routes: Any, adv: torch.Tensor) -> BatchOldLogp:
        return _LoglinearBatch(batch, self.device, self.passes, self.corr, step, self.updates_per_step)
