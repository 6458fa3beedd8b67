"""The no-grad passes that give old log-probs, and the train/inference and routing measurements made with them.

Every function here returns values; none writes a batch.  :class:`OldLogpPass` runs the pass right after
generation (:meth:`OldLogpPass.after_generation`: the trainer's own routing, the engine's replayed routes, or both)
and the pass at consumption (:meth:`OldLogpPass.at_weights`), and turns a fused update's log-probs into the
measurements the skipped pass would have made (:meth:`OldLogpPass.fused_measurements`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from offpolicy_moe.losses import metrics_to_floats, mismatch_metrics
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.engine import REPLAY_ENGINE
from offpolicy_moe.routing import replay_guardrails, routing_metrics
from offpolicy_moe.logprobs.forward import RoutedForward, eval_mode

__all__ = ["OldLogpPass", "PassValues", "FusedOldLogp", "conditioning_positions"]


def _to_cpu(x: Any) -> Any:
    return x.to("cpu") if hasattr(x, "to") else x


def conditioning_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` bool: the attended positions whose expert choice can reach a scored log-prob, i.e. every attended
    position but the last of its row.  The last token's logits predict nothing and no other position sees its
    hidden state under causal attention; an engine never feeds the token it sampled last, so it records no route
    there (vLLM and SGLang leave that row out)."""
    am = attention_mask.bool()
    last = am & (am.long().flip(1).cumsum(1).flip(1) == 1)
    return am & ~last


@dataclass(frozen=True)
class PassValues:
    """What one pass after generation gives: ``own`` (log-probs under the trainer's own routing) and ``replayed``
    (under the engine's routes), each None when not run; R2's recorded ``trainer_routes``; the routing
    measurements ``extras``."""

    own: Optional[torch.Tensor] = None
    replayed: Optional[torch.Tensor] = None
    trainer_routes: Any = None
    extras: dict = field(default_factory=dict)


class FusedOldLogp:
    """Old log-probs gathered from the update forwards of one batch (rows in batch order), plus the routes that
    forward used when routing is measured (``record_routes``)."""

    def __init__(self, shape: tuple[int, int], device: torch.device, record_routes: bool):
        self.values = torch.zeros(shape, dtype=torch.float32, device=device)
        self.record_routes = bool(record_routes)
        self.routes: Any = None

    def add(self, rows: torch.Tensor, logp: torch.Tensor, routes: Any = None) -> torch.Tensor:
        """Store the detached ``logp`` of batch rows ``rows`` (and the routes its forward used); returns it as the
        micro-batch's ``old_logp``."""
        old = logp.detach()
        self.values.index_copy_(0, rows.to(self.values.device), old.float())
        if routes is not None:
            self.routes = routes
        return old


class OldLogpPass:
    """The passes and measurements of one run: the routed forward, ``cfg`` (``algo``, ``trainer``), whether the
    model is MoE and whether routing is measured."""

    def __init__(self, forward: RoutedForward, cfg: Any, *, is_moe: bool, measure_routing: bool):
        self.forward = forward
        self.cfg = cfg
        self.replay = cfg.algo.routing.replay
        self.is_moe = bool(is_moe)
        self.measure_routing = bool(measure_routing)

    def one_micro_batch(self, batch: Optional[RolloutBatch]) -> bool:
        """The whole batch is one micro-batch (without a batch, only ``trainer.grad_accum`` is known)."""
        if batch is None:
            return self.cfg.trainer.grad_accum == 1
        return len(self.forward.micro_batching.batch_pieces(batch.attention_mask)) == 1

    @property
    def records_fused_routes(self) -> bool:
        """A fused batch's update forward records its routes (for ``routing/*``)."""
        return self.measure_routing and self.forward.controller is not None

    @property
    def replays_engine(self) -> bool:
        """The update replays the engine's routes (R3, PR2) on an MoE model."""
        return self.is_moe and self.replay in REPLAY_ENGINE

    # ------------------------------------------------------------------ right after generation
    @torch.no_grad()
    def after_generation(self, model: torch.nn.Module, batch: RolloutBatch, *, own: bool,
                         replayed: bool) -> PassValues:
        """The passes of ``batch`` under ``model``'s weights: with the trainer's own routing (``own``; recording
        routes for R2 and the routing measurements) and replaying the engine's routes (``replayed``, when the batch
        has them)."""
        extras: dict[str, float] = {}
        lp_own = lp_r3 = trainer_routes = None
        with eval_mode(model):
            if own:
                lp_own, trainer_routes = self._own_pass(model, batch, extras)
            if replayed and batch.routes is not None:
                lp_r3 = self.forward.logp_pieces(model, batch, batch.routes).cpu()
        return PassValues(lp_own, lp_r3, trainer_routes, extras)

    def _own_pass(self, model: torch.nn.Module, batch: RolloutBatch, extras: dict) -> tuple[torch.Tensor, Any]:
        """The pass with the trainer's own routing; records the routes when R2 or routing metrics need them."""
        controller = self.forward.controller_for(model)
        if controller is None or not (self.measure_routing or self.replay == "r2"):
            return self.forward.logp_pieces(model, batch, None).cpu(), None
        lp_own, own_routes = self.forward.logp_pieces(model, batch, None, record=True)
        own_routes = _to_cpu(own_routes)
        if self.measure_routing and batch.routes is not None:
            extras.update(metrics_to_floats(routing_metrics(batch.routes, own_routes, batch.attention_mask),
                                            drop_nonfinite=True))
            if self.replay in REPLAY_ENGINE:    # what replaying the engine's routes will override in this trainer
                extras.update(replay_guardrails(batch.routes, own_routes, conditioning_positions(batch.attention_mask),
                                                unreplayed_layers=len(controller.unreplayed)))
        return lp_own.cpu(), (own_routes if self.replay == "r2" else None)

    # ------------------------------------------------------------------ measurements
    @staticmethod
    def mismatch(logp: torch.Tensor, batch: RolloutBatch) -> dict[str, float]:
        """``mismatch/*`` of trainer log-probs ``logp`` against the batch's behaviour log-probs."""
        return metrics_to_floats(mismatch_metrics(logp, batch.behav_logp, batch.response_mask), drop_nonfinite=True)

    def mismatch_extras(self, logp: torch.Tensor, batch: RolloutBatch, name: str) -> dict[str, float]:
        """``mismatch/k3_kl_<name>`` and ``mismatch/extreme_frac_<name>`` (``r3`` with replay, ``no_r3``
        without); empty for a dense model."""
        if not self.is_moe:
            return {}
        mm = self.mismatch(logp, batch)
        return {f"mismatch/k3_kl_{name}": mm["mismatch/k3_kl"],
                f"mismatch/extreme_frac_{name}": mm["mismatch/extreme_frac"]}

    def both_extras(self, values: PassValues, batch: RolloutBatch) -> dict[str, float]:
        """The ``_r3`` / ``_no_r3`` mismatch of each pass that ran."""
        extras: dict[str, float] = {}
        for name, lp in (("r3", values.replayed), ("no_r3", values.own)):
            if lp is not None:
                extras.update(self.mismatch_extras(lp, batch, name))
        return extras

    # ------------------------------------------------------------------ at consumption
    @torch.no_grad()
    def at_weights(self, model: torch.nn.Module, batch: RolloutBatch, routes: Any) -> torch.Tensor:
        """Log-probs of ``batch`` under ``model``'s current weights, replaying ``routes``."""
        with eval_mode(model):
            return self.forward.logp_pieces(model, batch, routes).cpu()

    def fused_measurements(self, batch: RolloutBatch, fused: FusedOldLogp) -> tuple[torch.Tensor, dict]:
        """The old log-probs a fused update collected, and the measurements the skipped pass would have made from
        the same values."""
        old = fused.values.cpu()
        metrics: dict[str, float] = {}
        if fused.routes is not None and batch.routes is not None:
            metrics.update(metrics_to_floats(routing_metrics(batch.routes, _to_cpu(fused.routes),
                                                             batch.attention_mask), drop_nonfinite=True))
        metrics.update(self.mismatch(old, batch))
        name = "r3" if self.replay == "r3" and batch.routes is not None else "no_r3"
        metrics.update(self.mismatch_extras(old, batch, name))
        return old, metrics
