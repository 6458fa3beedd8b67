"""The old-log-prob pass and every train/inference and routing measurement, in one place.

``old_logp`` (the log-probs of the generating weights θ_v, the PPO ratio's denominator) comes from one of three
sources (``algo.old_logp_source``): a recompute pass by the trainer right after generation (``trainer``), the
engine's behaviour log-probs (``engine``, bypass) or a recompute at consumption under the current weights
(``proximal``, decoupled PPO).  The pass also measures the train/inference mismatch (``mismatch/*``, k3 KL to the
behaviour log-probs, with and without R3 replay on an MoE) and the routing mismatch (``routing/*``).

"Fused" (``trainer.fuse_old_logp``): when the batch is consumed by the very next, single update, that update's
forward runs under θ_v with the same routes, so ``old_logp = logp.detach()`` of that forward is bit for bit the
recompute's value and the extra pass is skipped; :class:`FusedOldLogp` collects the values during the update and
:meth:`OldLogpPass.finish_fused` makes the measurements the skipped pass would have made.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.engine import REPLAY_ENGINE
from offpolicy_moe.trainer.forward import RoutedForward, eval_mode
from offpolicy_moe.losses import metrics_to_floats, mismatch_metrics
from offpolicy_moe.routing import replay_guardrails, routing_metrics

__all__ = ["OldLogpPass", "FusedOldLogp"]


def _to_cpu(x: Any) -> Any:
    return x.to("cpu") if hasattr(x, "to") else x


def conditioning_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: the attended positions whose expert choice can reach a scored log-prob, i.e. every attended
    position but the last of its row.  The last token's logits predict nothing, and under causal attention no
    other position sees its hidden state; an engine never feeds the token it sampled last, so it records no route
    there (vLLM and SGLang leave that row out), and replaying it would change nothing."""
    am = attention_mask.bool()
    last = am & (am.long().flip(1).cumsum(1).flip(1) == 1)
    return am & ~last


class FusedOldLogp:
    """``old_logp`` gathered from the update forward of a fused batch (rows in batch order), plus the routes that
    forward used when routing is measured (``record_routes``)."""

    def __init__(self, shape: tuple[int, int], device: torch.device, record_routes: bool):
        self.values = torch.zeros(shape, dtype=torch.float32, device=device)
        self.record_routes = bool(record_routes)
        self.routes: Any = None

    def add(self, rows: torch.Tensor, logp: torch.Tensor, routes: Any = None) -> torch.Tensor:
        """Store the detached ``logp`` of batch rows ``rows`` (and the forward's routes); returns it as the
        micro-batch's ``old_logp``."""
        old = logp.detach()
        self.values.index_copy_(0, rows.to(self.values.device), old.float())
        if routes is not None:
            self.routes = routes
        return old


class OldLogpPass:
    """Computes ``batch.old_logp`` (and R2's ``batch.trainer_routes``) and the mismatch / routing measurements.

    Built with the routed forward, the bare actor model, ``cfg`` (``algo``, ``buffer``, ``trainer`` sections), whether
    the model is MoE, whether routing is measured, and whether the loss needs ``old_logp`` before the update forward
    (a global selection pass, e.g. M2PO's), which rules fusion out."""

    def __init__(self, forward: RoutedForward, model: torch.nn.Module, cfg: Any, *, is_moe: bool,
                 measure_routing: bool, needs_global_pass: bool):
        self.forward = forward
        self.model = model
        self.cfg = cfg
        self.is_moe = bool(is_moe)
        self.measure_routing = bool(measure_routing)
        self.needs_global_pass = bool(needs_global_pass)

    # ------------------------------------------------------------------ when to fuse
    def can_fuse(self, batch: Optional[RolloutBatch] = None) -> bool:
        """True when the recompute pass is redundant (see the module docstring): fixed staleness 0, one update per
        step, ``old_logp_source=trainer``, no correction weights, no global selection pass, routing none or R3, and
        routing measurements only without replay and with one micro-batch (they record the update forward's
        routes).  Under R3 the "with R3" counterfactual mismatch keeps its one replayed pass (with
        ``trainer.mismatch_metrics``).  ``trainer.fuse_old_logp=false`` turns fusion off."""
        cfg = self.cfg
        replay = cfg.algo.routing.replay
        return (bool(getattr(cfg.trainer, "fuse_old_logp", True))
                and cfg.algo.old_logp_source == "trainer" and cfg.buffer.mode == "fixed" and cfg.buffer.staleness == 0
                and cfg.trainer.updates_per_step == 1 and cfg.algo.correction.mode == "none"
                and replay in ("none", "r3")
                and (not self.measure_routing or (replay == "none" and self._one_micro_batch(batch)))
                and not self.needs_global_pass)

    def _one_micro_batch(self, batch: Optional[RolloutBatch]) -> bool:
        """The whole batch is one micro-batch (``trainer.grad_accum`` and ``trainer.micro_batch_tokens``); without a
        batch, only ``grad_accum`` is known."""
        if batch is None:
            return self.cfg.trainer.grad_accum == 1
        return len(self.forward.micro_batching.pieces(batch.size, int(batch.input_ids.shape[1]))) == 1

    # ------------------------------------------------------------------ right after generation
    @torch.no_grad()
    def prepare(self, batch: RolloutBatch) -> None:
        """``old_logp`` (per ``algo.old_logp_source``), R2 routes, mismatch and routing measurements →
        ``batch.extras``."""
        if self.can_fuse(batch):
            batch.old_logp, batch.old_logp_fused = None, True
            batch.extras = self._fused_r3_counterfactual(batch)
            return
        cfg = self.cfg
        src, replay = cfg.algo.old_logp_source, cfg.algo.routing.replay
        engine_replay = self.is_moe and replay in REPLAY_ENGINE
        need_own = (src == "trainer" and not engine_replay) or self.measure_routing \
            or (src == "engine" and cfg.trainer.mismatch_metrics)
        # the R3 counterfactual of a run without replay costs a whole extra forward: only with mismatch_metrics
        need_r3 = self.is_moe and batch.routes is not None and (
            (src == "trainer" and replay in REPLAY_ENGINE)
            or (self.measure_routing and bool(cfg.trainer.mismatch_metrics)))
        extras: dict[str, float] = {}
        lp_own = lp_r3 = None
        with eval_mode(self.model) as model:
            if need_own:
                lp_own = self._own_pass(model, batch, extras)
            if need_r3:
                lp_r3 = self.forward.logp_pieces(model, batch, batch.routes).cpu()
        if src == "trainer":
            batch.old_logp = lp_r3 if engine_replay else lp_own
            if batch.old_logp is not None:
                extras.update(self.mismatch(batch.old_logp, batch))
        elif src == "engine":
            batch.old_logp = batch.behav_logp.clone()
            ref = lp_r3 if (replay in REPLAY_ENGINE and lp_r3 is not None) else lp_own
            if cfg.trainer.mismatch_metrics and ref is not None:
                extras.update(self.mismatch(ref, batch))
        # src == proximal: old_logp computed at consumption (:meth:`at_consumption`)
        for name, lp in (("r3", lp_r3), ("no_r3", lp_own)):
            if lp is not None:
                extras.update(self.mismatch_extras(lp, batch, name))
        batch.extras = extras

    def _own_pass(self, model: torch.nn.Module, batch: RolloutBatch, extras: dict) -> torch.Tensor:
        """The pass with the trainer's own routing; records the routes when R2 or routing metrics need them."""
        replay = self.cfg.algo.routing.replay
        if self.forward.controller is None or not (self.measure_routing or replay == "r2"):
            return self.forward.logp_pieces(model, batch, None).cpu()
        lp_own, own_routes = self.forward.logp_pieces(model, batch, None, record=True)
        own_routes = _to_cpu(own_routes)
        if replay == "r2":
            batch.trainer_routes = own_routes
        if self.measure_routing and batch.routes is not None:
            extras.update(metrics_to_floats(routing_metrics(batch.routes, own_routes, batch.attention_mask),
                                            drop_nonfinite=True))
            if replay in REPLAY_ENGINE:    # what replaying the engine's routes will override in this trainer
                extras.update(replay_guardrails(batch.routes, own_routes, conditioning_positions(batch.attention_mask),
                                                unreplayed_layers=len(self.forward.controller.unreplayed)))
        return lp_own.cpu()

    def _fused_r3_counterfactual(self, batch: RolloutBatch) -> dict[str, float]:
        """Fused batch under routing measurements: the replayed pass for ``mismatch/*_r3`` (only with
        ``trainer.mismatch_metrics``)."""
        if not (self.measure_routing and self.cfg.trainer.mismatch_metrics and batch.routes is not None):
            return {}
        with eval_mode(self.model) as model:
            lp_r3 = self.forward.logp_pieces(model, batch, batch.routes).cpu()
        return self.mismatch_extras(lp_r3, batch, "r3")

    # ------------------------------------------------------------------ measurements
    @staticmethod
    def mismatch(logp: torch.Tensor, batch: RolloutBatch) -> dict[str, float]:
        """``mismatch/*`` of trainer log-probs ``logp`` against the batch's behaviour log-probs."""
        return metrics_to_floats(mismatch_metrics(logp, batch.behav_logp, batch.response_mask), drop_nonfinite=True)

    def mismatch_extras(self, logp: torch.Tensor, batch: RolloutBatch, name: str) -> dict[str, float]:
        """``mismatch/k3_kl_<name>`` and ``mismatch/extreme_frac_<name>`` (``name``: ``r3`` with replay,
        ``no_r3`` without); empty for a dense model."""
        if not self.is_moe:
            return {}
        mm = self.mismatch(logp, batch)
        return {f"mismatch/k3_kl_{name}": mm["mismatch/k3_kl"],
                f"mismatch/extreme_frac_{name}": mm["mismatch/extreme_frac"]}

    # ------------------------------------------------------------------ at consumption
    def at_consumption(self, batch: RolloutBatch, routes: Any) -> dict[str, float]:
        """``old_logp_source=proximal``: ``old_logp`` under the current weights (replaying ``routes``) and its
        mismatch to the behaviour log-probs; nothing for the other sources."""
        if self.cfg.algo.old_logp_source != "proximal":
            return {}
        with eval_mode(self.model) as model, torch.no_grad():
            batch.old_logp = self.forward.logp_pieces(model, batch, routes).cpu()
        return self.mismatch(batch.old_logp, batch)

    def begin_fused(self, batch: RolloutBatch, step: int, device: torch.device) -> Optional[FusedOldLogp]:
        """The collector of a fused batch's ``old_logp`` (None when the batch is not fused); refuses a fused batch
        that is not consumed by the single on-policy update it was planned for."""
        if not (batch.old_logp is None and batch.old_logp_fused):
            return None
        if batch.version != step or self.cfg.trainer.updates_per_step != 1:
            raise RuntimeError(f"batch of version {batch.version} fused its old log-probs into the update, but the "
                               f"trainer is at version {step} with {self.cfg.trainer.updates_per_step} updates per "
                               "step: they can only come from a single on-policy update")
        record = self.measure_routing and self.forward.controller is not None
        return FusedOldLogp(tuple(batch.response_mask.shape), device, record)

    def finish_fused(self, batch: RolloutBatch, fused: FusedOldLogp) -> dict[str, float]:
        """Set ``batch.old_logp`` from the update forward and make the measurements the skipped pass would have
        made, from the same values."""
        batch.old_logp = fused.values.cpu()
        metrics: dict[str, float] = {}
        if fused.routes is not None and batch.routes is not None:
            metrics.update(metrics_to_floats(routing_metrics(batch.routes, _to_cpu(fused.routes), batch.attention_mask), drop_nonfinite=True))
        metrics.update(self.mismatch(batch.old_logp, batch))
        name = "r3" if self.cfg.algo.routing.replay == "r3" and batch.routes is not None else "no_r3"
        metrics.update(self.mismatch_extras(batch.old_logp, batch, name))
        return metrics
