"""The pass right after generation and every train/inference and routing measurement, in one place.

The pass recomputes ``old_logp`` (the log-probs of the generating weights θ_v, the PPO ratio's denominator) when
the run's old-log-prob strategy (:mod:`~offpolicy_moe.trainer.old_logp_strategy`) takes them then, and measures
the train/inference mismatch (``mismatch/*``, k3 KL to the behaviour log-probs, with and without R3 replay on an
MoE) and the routing mismatch (``routing/*``).

"Fused": when the batch is consumed by the very next, single update, that update's forward runs under θ_v with the
same routes, so ``old_logp = logp.detach()`` of that forward is bit for bit the recompute's value and the extra
pass is skipped; :class:`FusedOldLogp` collects the values during the update and :meth:`OldLogpPass.finish_fused`
makes the measurements the skipped pass would have made.
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

    Built with the routed forward, the bare actor model, ``cfg`` (``algo``, ``trainer`` sections), whether the model
    is MoE and whether routing is measured."""

    def __init__(self, forward: RoutedForward, model: torch.nn.Module, cfg: Any, *, is_moe: bool,
                 measure_routing: bool):
        self.forward = forward
        self.model = model
        self.cfg = cfg
        self.is_moe = bool(is_moe)
        self.measure_routing = bool(measure_routing)

    def one_micro_batch(self, batch: Optional[RolloutBatch]) -> bool:
        """The whole batch is one micro-batch (``trainer.grad_accum`` and ``trainer.micro_batch_tokens``); without a
        batch, only ``grad_accum`` is known."""
        if batch is None:
            return self.cfg.trainer.grad_accum == 1
        return len(self.forward.micro_batching.pieces(batch.size, int(batch.input_ids.shape[1]))) == 1

    @property
    def records_fused_routes(self) -> bool:
        """A fused batch's update forward records its routes (for ``routing/*``)."""
        return self.measure_routing and self.forward.controller is not None

    # ------------------------------------------------------------------ right after generation
    @torch.no_grad()
    def prepare(self, batch: RolloutBatch, src: str) -> None:
        """The old log-probs where ``src`` says they are taken now (``trainer``: this pass; ``engine``: a copy of
        the behaviour log-probs; ``consumption``: left to the update), R2 routes, mismatch and routing
        measurements → ``batch.extras``."""
        cfg = self.cfg
        replay = cfg.algo.routing.replay
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
        # src == consumption: old_logp computed when the batch is consumed
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

    @torch.no_grad()
    def prepare_fused(self, batch: RolloutBatch) -> None:
        """A batch whose old log-probs the update forward will give: marked fused; under routing measurements the
        replayed pass for ``mismatch/*_r3`` (only with ``trainer.mismatch_metrics``)."""
        batch.old_logp, batch.old_logp_fused = None, True
        batch.extras = self._fused_r3_counterfactual(batch)

    def _fused_r3_counterfactual(self, batch: RolloutBatch) -> dict[str, float]:
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
    def recompute(self, batch: RolloutBatch, routes: Any) -> dict[str, float]:
        """``batch.old_logp`` under the current weights (replaying ``routes``) and its mismatch to the behaviour
        log-probs."""
        with eval_mode(self.model) as model, torch.no_grad():
            batch.old_logp = self.forward.logp_pieces(model, batch, routes).cpu()
        return self.mismatch(batch.old_logp, batch)

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
