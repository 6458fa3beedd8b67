"""Routing metrics between two route traces (R3, arXiv:2510.11370, section 2; PR2, arXiv:2606.00395, section 5).

Over the (token, MoE layer) pairs recorded in both traces (and inside ``mask``): decision mismatch (expert SETs
differ), token mismatch (a token with at least one differing layer: the R3 paper's "94%"), top-k agreement
``|A ∩ B| / K``, coverage gap ``1 − Σ_{j∈A} p_j`` under B's router probabilities, and zero deviation (PR2, Fig. 1:
``1 −`` each mismatch).  :func:`replay_guardrails`: docs/routing.md, "Replay guardrails".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .trace import RouteTrace

__all__ = ["GUARDRAIL_METRICS", "RouteComparison", "compare_traces", "replay_guardrails", "routing_metrics",
           "set_overlap", "zero_deviation"]

#: stable names of the replay guardrail metrics (see :func:`replay_guardrails`)
GUARDRAIL_METRICS = ("routing/replay_fallback", "routing/replay_outside_topk", "routing/replay_outside_topk_decisions",
                     "routing/replay_decisions")


def in_set(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` bool: whether each id of ``a[..., K]`` is among the ids of ``b[..., K']`` of the same row."""
    return (a[..., :, None] == b[..., None, :]).any(-1)


def set_overlap(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a ∩ b|`` per row of id tensors ``[..., K]`` (ids unique within a row)."""
    return in_set(a, b).sum(-1)


def zero_deviation(same: torch.Tensor, valid: torch.Tensor) -> tuple[float, float]:
    """``(per-pair, per-token)`` zero-deviation shares from ``same[M, L]`` (route sets equal) and ``valid[M, L]``
    (the pair was recorded): ``Σ same·valid / Σ valid`` over (token, layer) pairs, and the share of tokens with at
    least one valid pair whose valid pairs are all equal. No valid pair -> ``(1.0, 1.0)``."""
    vf = valid.float()
    n = float(vf.sum())
    per_pair = float((same.float() * vf).sum()) / n if n else 1.0
    has = valid.any(-1)
    tok_ok = ((same | ~valid).all(-1) & has).float().sum()
    per_token = float(tok_ok) / float(has.sum()) if bool(has.any()) else 1.0
    return per_pair, per_token


@dataclass
class RouteComparison:
    """Per-(token, layer) comparison of two traces: ``overlap[B, S, L]`` int64 ``|A ∩ B|``, ``valid[B, S]``
    (recorded in both, inside the mask) and ``coverage[B, S, L]`` ``Σ_{j∈A} p_j`` (or None)."""

    overlap: torch.Tensor
    valid: torch.Tensor
    top_k: int
    coverage: torch.Tensor | None = None

    @property
    def differs(self) -> torch.Tensor:
        """``[B, S, L]`` bool: the expert sets differ (only meaningful where ``valid``)."""
        return self.overlap < self.top_k

    def zero_deviation_metrics(self, prefix: str = "drift/") -> dict[str, float]:
        """``prefix + "zero_dev_layer"`` (share of compared (token, layer) pairs whose expert sets are equal),
        ``prefix + "zero_dev_token"`` (share of compared tokens equal in every MoE layer) and
        ``prefix + "n_tokens"``; see :func:`zero_deviation`."""
        valid = self.valid[..., None].expand_as(self.overlap)
        per_pair, per_token = zero_deviation(self.overlap == self.top_k, valid)
        return {f"{prefix}zero_dev_layer": per_pair, f"{prefix}zero_dev_token": per_token,
                f"{prefix}n_tokens": float(int(self.valid.sum()))}

    def metrics(self, per_layer: bool = False, prefix: str = "routing/") -> dict[str, float]:
        """Scalar metrics; ``prefix + "decision_mismatch"`` etc. Zero tokens -> zeros (``n_tokens`` = 0)."""
        v = self.valid
        n = int(v.sum())
        out = {f"{prefix}n_tokens": float(n)}
        if n == 0:
            out.update({f"{prefix}decision_mismatch": 0.0, f"{prefix}token_mismatch": 0.0,
                        f"{prefix}topk_agreement": 1.0})
            if self.coverage is not None:
                out[f"{prefix}coverage_gap"] = 0.0
            return out
        d = self.differs[v].float()  # [n, L]
        out[f"{prefix}decision_mismatch"] = float(d.mean())
        out[f"{prefix}token_mismatch"] = float(d.amax(-1).mean())
        out[f"{prefix}topk_agreement"] = float((self.overlap[v].float() / self.top_k).mean())
        if self.coverage is not None:
            out[f"{prefix}coverage_gap"] = float((1.0 - self.coverage[v].float()).mean())
        if per_layer:
            for layer, val in enumerate(d.mean(0).tolist()):
                out[f"{prefix}decision_mismatch/layer_{layer}"] = val
        return out


def compare_traces(trace_a: RouteTrace, trace_b: RouteTrace, mask: torch.Tensor | None = None,
                   probs_b: torch.Tensor | None = None) -> RouteComparison:
    """Compare the expert sets of two traces of the same sequences.

    ``mask[B, S]`` restricts the tokens (e.g. response mask); ``probs_b[B, S, L, E]`` are the router probabilities
    of the B side (e.g. softmax of the trainer's current logits) for the coverage gap of A's sets under B's router.
    """
    if trace_a.ids.shape != trace_b.ids.shape:
        raise ValueError(f"trace shapes differ: {tuple(trace_a.ids.shape)} vs {tuple(trace_b.ids.shape)}")
    if trace_a.num_experts != trace_b.num_experts:
        raise ValueError(f"num_experts differ: {trace_a.num_experts} vs {trace_b.num_experts}")
    a = trace_a.long_ids()
    b = trace_b.long_ids().to(a.device)
    valid = trace_a.recorded_mask() & trace_b.recorded_mask().to(a.device)
    if mask is not None:
        valid = valid & _mask_like(mask, a.shape[0], a.shape[1], a.device)
    overlap = set_overlap(a, b)
    coverage = None
    if probs_b is not None:
        want = tuple(a.shape[:3]) + (trace_a.num_experts,)
        if tuple(probs_b.shape) != want:
            raise ValueError(f"probs_b shape {tuple(probs_b.shape)} does not match [B, S, L, E] = {want}")
        coverage = probs_b.to(a.device).float().gather(-1, a.clamp_min(0)).sum(-1)
    return RouteComparison(overlap, valid, trace_a.top_k, coverage)


def routing_metrics(trace_a: RouteTrace, trace_b: RouteTrace, mask: torch.Tensor | None = None,
                    probs_b: torch.Tensor | None = None, per_layer: bool = False,
                    prefix: str = "routing/") -> dict[str, float]:
    """``routing/decision_mismatch``, ``routing/token_mismatch``, ``routing/topk_agreement``,
    ``routing/coverage_gap`` (with ``probs_b``), ``routing/n_tokens`` and, with ``per_layer``,
    ``routing/decision_mismatch/layer_{l}``. See :func:`compare_traces`."""
    return compare_traces(trace_a, trace_b, mask, probs_b).metrics(per_layer=per_layer, prefix=prefix)


def replay_guardrails(replayed: RouteTrace, own: RouteTrace, mask: torch.Tensor | None = None,
                      unreplayed_layers: int = 0) -> dict[str, float]:
    """Guardrail metrics of one replayed forward (names in :data:`GUARDRAIL_METRICS`): ``replayed`` the trace handed
    to ``RoutingController.replay``, ``own`` the router's own top-k in that forward (``ctl.record("own")``),
    ``unreplayed_layers`` the routers left to themselves, counted as fallbacks at every token.

    With ``D`` the (token, layer) decisions inside ``mask`` over the ``L + unreplayed_layers`` routed layers, ``F``
    those not recorded in ``replayed`` (or unreplayed) and, over the ``R = D - F`` replayed decisions with ids ``A``
    and own top-k ``B``: ``replay_fallback = F / D``, ``replay_outside_topk = sum |A \\ B| / (K R)``,
    ``replay_outside_topk_decisions = #{A ⊄ B} / R``, ``replay_decisions = R``. No decision -> zeros.
    """
    if replayed.ids.shape != own.ids.shape:
        raise ValueError(f"replayed trace {tuple(replayed.ids.shape)} and own trace {tuple(own.ids.shape)} differ in "
                         f"shape: record the own routes in the replayed forward")
    if unreplayed_layers < 0:
        raise ValueError(f"unreplayed_layers must be >= 0, got {unreplayed_layers}")
    b, s, n_layers, k = replayed.ids.shape
    own_ok = own.recorded_mask()
    m = own_ok if mask is None else own_ok & _mask_like(mask, b, s, own_ok.device)
    rec = replayed.recorded_mask().to(m.device) & m
    n_tok, n_rec = int(m.sum()), int(rec.sum())
    decisions = n_tok * (n_layers + unreplayed_layers)
    replayed_decisions = n_rec * n_layers
    if decisions == 0 or replayed_decisions == 0:
        return {"routing/replay_fallback": 0.0 if decisions == 0 else 1.0, "routing/replay_outside_topk": 0.0,
                "routing/replay_outside_topk_decisions": 0.0, "routing/replay_decisions": float(replayed_decisions)}
    a = replayed.long_ids().to(m.device)[rec]          # [R_tok, L, K]
    o = own.long_ids().to(m.device)[rec]
    outside = ~in_set(a, o)   # [R_tok, L, K]
    return {"routing/replay_fallback": (decisions - replayed_decisions) / decisions,
            "routing/replay_outside_topk": float(outside.float().mean()),
            "routing/replay_outside_topk_decisions": float(outside.any(-1).float().mean()),
            "routing/replay_decisions": float(replayed_decisions)}


def _mask_like(mask: torch.Tensor, b: int, s: int, device) -> torch.Tensor:
    if tuple(mask.shape) != (b, s):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match the traces' [B, S] = {(b, s)}")
    return mask.to(device).bool()
