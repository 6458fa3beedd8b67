"""PR2 (Predictive Routing Replay, Dong et al., arXiv:2606.00395): predictors, feature cache, predictor loss.

Per MoE layer a zero-initialised bias-free linear predictor maps the router input h to a logit bias ``b = h W_p``.
The engine selects ``Î = TopK(softmax(logits + b))`` (weights too when ``in_weights``, the paper's default); Î is
recorded and replayed in training exactly like R3, predictor OFF, and a subsample of sequences gives features
``(h_old, logits_old)``.  Predictor loss (paper Eq. 15): ``L_p = Σ_l mean_t KL(ρ_cur^l ‖ softmax(logits_old^l +
h_old^l W_p^l))``, ``ρ_cur`` the current router's softmax on the same token, detached; only ``W_p`` gets gradient.
For sigmoid routers (DeepSeek-V3) the same softmax KL is a surrogate (ours).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .metrics import set_overlap, zero_deviation
from .trace import RouteTrace, repad_destinations

#: the no-predictor KL (nats) below which ``pr2/skill_ratio`` is not reported: no drift to predict
SKILL_MIN_BASE_KL = 1e-6

__all__ = ["PR2Predictors", "FeatureCache", "PR2Features", "pr2_predictor_loss", "pr2_param_group",
           "cat_features"]


class PR2Predictors(nn.Module):
    """One zero-initialised bias-free ``Linear(hidden_size, num_experts)`` per MoE layer (PR2, arXiv:2606.00395).

    ``forward(layer, h)`` returns the logit bias ``b = h W_p`` in the predictor's dtype; ``h`` is cast to that dtype,
    so fp32 predictors work on a bf16 engine copy. Sync an engine copy with
    ``engine_predictors.load_state_dict(trainer_predictors.state_dict())``.
    """

    def __init__(self, hidden_size: int, num_experts: int, num_layers: int, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        if min(hidden_size, num_experts, num_layers) <= 0:
            raise ValueError(f"hidden_size, num_experts, num_layers must be positive, got "
                             f"{(hidden_size, num_experts, num_layers)}")
        self.hidden_size, self.num_experts, self.num_layers = hidden_size, num_experts, num_layers
        self.layers = nn.ModuleList(
            nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype, device=device) for _ in range(num_layers))
        for lin in self.layers:
            nn.init.zeros_(lin.weight)

    @classmethod
    def from_controller(cls, controller, dtype: torch.dtype = torch.float32, device=None) -> "PR2Predictors":
        """Predictors sized for ``controller``'s model (hidden size of the router input, E, number of MoE layers)."""
        return cls(controller.hidden_size, controller.num_experts, controller.num_moe_layers, dtype, device)

    def forward(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Logit bias ``[..., E] = h W_p^layer`` (h cast to the predictor's dtype and device)."""
        w = self.layers[layer].weight
        return F.linear(h.to(device=w.device, dtype=w.dtype), w)

    def all_layers(self, h: torch.Tensor) -> torch.Tensor:
        """Bias for every layer at once: ``h[M, L, H] -> [M, L, E]``."""
        if h.dim() != 3 or h.shape[1] != self.num_layers or h.shape[2] != self.hidden_size:
            raise ValueError(f"h must be [M, L={self.num_layers}, H={self.hidden_size}], got {tuple(h.shape)}")
        w = torch.stack([lin.weight for lin in self.layers])  # [L, E, H]
        return torch.einsum("mlh,leh->mle", h.to(device=w.device, dtype=w.dtype), w)


def pr2_param_group(predictors: PR2Predictors, base_lr: float, lr_mult: float = 1e3, weight_decay: float = 0.0,
                    **extra) -> dict:
    """Optimizer param group for the predictors: ``lr = lr_mult * base_lr`` (PR2's α, default 1e3 as in the authors'
    launch scripts; the draft also uses 1e4). ``weight_decay`` defaults to 0 (ours; the paper is silent)."""
    if base_lr < 0 or lr_mult <= 0:
        raise ValueError(f"base_lr must be >= 0 and lr_mult > 0, got base_lr={base_lr}, lr_mult={lr_mult}")
    return {"params": list(predictors.parameters()), "lr": base_lr * lr_mult, "weight_decay": weight_decay,
            "name": "pr2_predictors", **extra}


# ------------------------------------------------------------------------------------------------ features
@dataclass
class PR2Features:
    """Cached predictor features of M tokens, aligned with a trace by ``(batch_index, position)`` (``[M]`` int64):
    router inputs ``h[M, L, H]`` and router logits ``logits[M, L, E]`` BEFORE the predictor bias (engine dtype)."""

    batch_index: torch.Tensor
    position: torch.Tensor
    h: torch.Tensor
    logits: torch.Tensor

    def __post_init__(self):
        m = self.batch_index.shape[0]
        if (self.position.shape != (m,) or self.h.dim() != 3 or self.logits.dim() != 3 or self.h.shape[0] != m
                or self.logits.shape[0] != m or self.h.shape[1] != self.logits.shape[1]):
            raise ValueError(f"inconsistent PR2Features shapes: batch_index {tuple(self.batch_index.shape)}, "
                             f"position {tuple(self.position.shape)}, h {tuple(self.h.shape)}, "
                             f"logits {tuple(self.logits.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.batch_index.shape[0]

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(batch_index, position)``, e.g. for ``RoutingController.capture_router_logits``."""
        return self.batch_index, self.position

    def _sel(self, keep: torch.Tensor, batch_index: torch.Tensor | None = None,
             position: torch.Tensor | None = None) -> "PR2Features":
        return PR2Features(self.batch_index[keep] if batch_index is None else batch_index,
                           self.position[keep] if position is None else position, self.h[keep], self.logits[keep])

    def to(self, device=None) -> "PR2Features":
        return PR2Features(self.batch_index.to(device), self.position.to(device), self.h.to(device),
                           self.logits.to(device))

    def index_select(self, index: torch.Tensor) -> "PR2Features":
        """Follow ``trace.index_select(index)``: keep tokens of the selected rows, renumbered to their new row."""
        index = index.to(self.batch_index.device).long()
        hit = self.batch_index[:, None] == index[None, :]  # [M, n]
        tok, new_row = hit.nonzero(as_tuple=True)
        order = torch.argsort(new_row * (int(self.position.max()) + 1 if self.num_tokens else 1)
                              + self.position[tok], stable=True)
        tok, new_row = tok[order], new_row[order]
        return PR2Features(new_row, self.position[tok], self.h[tok], self.logits[tok])

    def filter(self, mask: torch.Tensor) -> "PR2Features":
        """Keep tokens with ``mask[batch_index, position]`` True (e.g. attention mask, drop pads)."""
        mask = mask.to(self.batch_index.device).bool()
        if self.num_tokens and (int(self.batch_index.max()) >= mask.shape[0] or int(self.position.max()) >= mask.shape[1]):
            raise ValueError(f"mask shape {tuple(mask.shape)} is too small for features at rows up to "
                             f"{int(self.batch_index.max())} and positions up to {int(self.position.max())}")
        return self._sel(mask[self.batch_index, self.position])

    def slice(self, start: int) -> "PR2Features":
        """Follow ``trace.slice(start)``: keep positions ``>= start`` and shift them by ``-start``."""
        keep = self.position >= start
        return self._sel(keep, position=self.position[keep] - start)

    def repad(self, attention_mask: torch.Tensor, side: str) -> "PR2Features":
        """Follow ``trace.repad(attention_mask, side)``: new positions of the real tokens; pad tokens dropped."""
        m = attention_mask.bool()
        dst, _ = repad_destinations(m, side)
        old_to_new = torch.where(m, dst, torch.full_like(dst, -1))
        np_ = old_to_new.to(self.batch_index.device)[self.batch_index, self.position]
        keep = np_ >= 0
        return self._sel(keep, position=np_[keep])

    def gather_trace(self, trace: RouteTrace) -> torch.Tensor:
        """Replayed ids at these tokens: ``[M, L, K]`` int64 (-1 where not recorded)."""
        ids = trace.long_ids()
        return ids[self.batch_index.to(ids.device), self.position.to(ids.device)]

    def state_dict(self) -> dict:
        """Plain tensors for checkpoints and staleness buffers."""
        return {"batch_index": self.batch_index, "position": self.position, "h": self.h, "logits": self.logits}

    @classmethod
    def from_state_dict(cls, state: dict) -> "PR2Features":
        return cls(state["batch_index"], state["position"], state["h"], state["logits"])


def cat_features(parts: Sequence[PR2Features], batch_sizes: Sequence[int]) -> PR2Features:
    """Concatenate features of batches concatenated along the batch (``batch_sizes`` = rows of each batch)."""
    if len(parts) != len(batch_sizes) or not parts:
        raise ValueError(f"need one batch size per feature record, got {len(parts)} records and "
                         f"{len(batch_sizes)} sizes")
    offsets = [sum(batch_sizes[:i]) for i in range(len(parts))]
    return PR2Features(torch.cat([p.batch_index + off for p, off in zip(parts, offsets)]), torch.cat([p.position for p in parts]), torch.cat([p.h for p in parts]),
                       torch.cat([p.logits for p in parts]))


class FeatureCache:
    """Collects ``(h, logits)`` (logits before the predictor bias) at every MoE layer and position for a random
    subsample of ``max(1, round(B * sample_rate))`` SEQUENCES during a PR2 rollout, drawn at the first router call.
    One generate (or forward) per cache; ``store_device`` moves features off the accelerator as they arrive."""

    def __init__(self, sample_rate: float = 1 / 8, generator: torch.Generator | None = None, store_device=None):
        if not (0.0 < sample_rate <= 1.0):
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.generator = generator
        self.store_device = store_device
        self.reset()

    def reset(self) -> None:
        """Drop everything collected."""
        self.rows: torch.Tensor | None = None
        self.batch_size: int | None = None
        self._h: dict[int, list[torch.Tensor]] = {}
        self._logits: dict[int, list[torch.Tensor]] = {}
        self._pos: dict[int, int] = {}
        self.num_layers: int | None = None

    @property
    def has_data(self) -> bool:
        return bool(self._h)

    def _choose(self, batch: int) -> torch.Tensor:
        n = max(1, round(batch * self.sample_rate))
        perm = torch.randperm(batch, generator=self.generator)
        return perm[:n].sort().values

    def add(self, layer: int, h: torch.Tensor, logits: torch.Tensor, batch: int, seq: int) -> None:
        """Store layer ``layer``'s router input ``h[B*s, H]`` and logits ``[B*s, E]`` of one call of shape (B, s)."""
        if self.rows is None:
            self.batch_size = batch
            self.rows = self._choose(batch)
        elif batch != self.batch_size:
            raise ValueError(f"FeatureCache saw batch size {batch} after {self.batch_size}: one generate per cache "
                             f"(beam search and assisted decoding are not supported)")
        rows = self.rows.to(h.device)
        hh = h.detach().reshape(batch, seq, -1)[rows]
        ll = logits.detach().reshape(batch, seq, -1)[rows]
        if self.store_device is not None:
            hh, ll = hh.to(self.store_device), ll.to(self.store_device)
        self._h.setdefault(layer, []).append(hh)
        self._logits.setdefault(layer, []).append(ll)
        self._pos[layer] = self._pos.get(layer, 0) + seq

    def collect(self) -> PR2Features:
        """Features of the sampled sequences at every recorded position: ``M = n_sequences * positions``."""
        if not self._h:
            raise ValueError("FeatureCache is empty: use it in `ctl.offsets(predictors, feature_cache=cache)` "
                             "around a generate/forward")
        layers = sorted(self._h)
        if layers != list(range(len(layers))):
            raise ValueError(f"FeatureCache has features for MoE layers {layers}, expected 0..{len(layers) - 1}")
        lens = {self._pos[l] for l in layers}
        if len(lens) != 1:
            raise ValueError(f"MoE layers saw different numbers of positions {sorted(lens)}")
        s = lens.pop()
        h = torch.stack([torch.cat(self._h[l], 1) for l in layers], 2)  # [n, s, L, H]
        lg = torch.stack([torch.cat(self._logits[l], 1) for l in layers], 2)  # [n, s, L, E]
        n = h.shape[0]
        rows = self.rows.to(h.device)
        bi = rows[:, None].expand(n, s).reshape(-1)
        pos = torch.arange(s, device=h.device)[None, :].expand(n, s).reshape(-1)
        return PR2Features(bi, pos, h.reshape(n * s, h.shape[2], h.shape[3]), lg.reshape(n * s, lg.shape[2], lg.shape[3]))


# ------------------------------------------------------------------------------------------------- the loss
def pr2_predictor_loss(predictors: PR2Predictors, features: PR2Features, current_logits: torch.Tensor, *,
                       current_ids: torch.Tensor | None = None, replayed_ids: torch.Tensor | None = None,
                       current_is_probs: bool = False, top_k: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PR2 post-routing matching loss and ``pr2/*`` metrics (arXiv:2606.00395, Eq. 15).

    ``L_p = Σ_l mean_t KL(ρ_cur ‖ q̂)``, ``q̂ = softmax(logits_old + h_old W_p)``, ``ρ_cur = softmax(current_logits)``
    (or ``current_logits`` itself when ``current_is_probs``), detached; only the predictors get gradient.
    ``current_ids`` default to the top-k of ``current_logits``, ``replayed_ids`` (Î) to the top-k of q̂.

    Metrics (docs/metrics.md, ``pr2/``): ``pr2/pred_kl``, ``pr2/base_kl`` (without the predictor),
    ``pr2/skill_ratio = pred_kl / base_kl`` (< 1: the predictor anticipates the drift; left out while
    ``base_kl <= SKILL_MIN_BASE_KL``), ``pr2/zero_dev_*`` with their ``_r3`` counterfactual, and more.
    """
    m, nl, e = features.logits.shape
    if tuple(current_logits.shape) != (m, nl, e):
        raise ValueError(f"current_logits shape {tuple(current_logits.shape)} does not match the features' "
                         f"logits shape {(m, nl, e)}")
    if nl != predictors.num_layers or e != predictors.num_experts:
        raise ValueError(f"features have L={nl}, E={e} but the predictors have L={predictors.num_layers}, "
                         f"E={predictors.num_experts}")
    w = predictors.layers[0].weight
    if m == 0:
        zero = sum(p.sum() for p in predictors.parameters()) * 0.0
        return zero, {"pr2/num_tokens": 0.0}
    dev = w.device
    h_old = features.h.to(dev)
    logits_old = features.logits.to(device=dev, dtype=torch.float32).detach()
    bias = predictors.all_layers(h_old.detach()).float()  # [M, L, E]
    logq = F.log_softmax(logits_old + bias, dim=-1)
    cur = current_logits.detach().to(device=dev, dtype=torch.float32)
    if current_is_probs:
        rho = cur / cur.sum(-1, keepdim=True).clamp_min(1e-30)
    else:
        rho = F.softmax(cur, dim=-1)
    neg_ent = torch.xlogy(rho, rho)
    kl = (neg_ent - rho * logq).sum(-1)  # [M, L]
    per_layer = kl.mean(0)
    loss = per_layer.sum()
    with torch.no_grad():
        route = _route_metrics(cur, rho, neg_ent, logq, logits_old, current_ids, replayed_ids, top_k)
        ratio = float(bias.abs().mean() / logits_old.abs().mean().clamp_min(1e-12))
    pred_kl = float(per_layer.mean().detach())
    base_kl = route.pop("pr2/base_kl")
    metrics = {"pr2/loss": float(loss.detach()), "pr2/pred_kl": pred_kl, "pr2/base_kl": base_kl, **route,
               "pr2/bias_ratio": ratio, "pr2/num_tokens": float(m)}
    if base_kl > SKILL_MIN_BASE_KL:     # below it the ratio is float rounding over float rounding
        metrics["pr2/skill_ratio"] = pred_kl / base_kl
    if not math.isfinite(metrics["pr2/loss"]):
        raise ValueError("PR2 predictor loss is not finite (non-finite features or logits?)")
    return loss, metrics


def _route_metrics(cur, rho, neg_ent, logq, logits_old, current_ids, replayed_ids, top_k) -> dict[str, float]:
    """The route metrics of :func:`pr2_predictor_loss` (``[M, L, E]`` inputs, no gradient): ``pr2/base_kl``,
    ``pr2/topk_agreement``, ``pr2/coverage_gap``, ``pr2/zero_dev_*`` (with the R3 counterfactual) and
    ``pr2/bias_route_change``."""
    m, nl, _ = cur.shape
    dev = cur.device
    k = (current_ids.shape[-1] if current_ids is not None else
         replayed_ids.shape[-1] if replayed_ids is not None else top_k)
    if k is None:
        raise ValueError("pass current_ids, replayed_ids or top_k so that K is known")
    i_cur = current_ids.to(dev).long() if current_ids is not None else torch.topk(cur, k, -1)[1]
    i_rep = replayed_ids.to(dev).long() if replayed_ids is not None else torch.topk(logq, k, -1)[1]
    if i_cur.shape != (m, nl, k) or i_rep.shape != (m, nl, k):
        raise ValueError(f"current_ids {tuple(i_cur.shape)} and replayed_ids {tuple(i_rep.shape)} must both be "
                         f"{(m, nl, k)}")
    i_unb = torch.topk(logits_old, k, -1)[1]      # the unbiased route: what R3 would have replayed
    base_kl = float((neg_ent - rho * F.log_softmax(logits_old, dim=-1)).sum(-1).mean())
    valid = (i_rep >= 0).all(-1)  # [M, L]: recorded
    overlap = set_overlap(i_rep, i_cur).float()
    vf = valid.float()
    nvalid = vf.sum().clamp_min(1.0)
    cover = rho.gather(-1, i_rep.clamp_min(0)).sum(-1)
    zd = zero_deviation(overlap == k, valid)
    zd_r3 = zero_deviation(set_overlap(i_unb, i_cur) == k, valid)
    return {"pr2/base_kl": base_kl, "pr2/topk_agreement": float((overlap / k * vf).sum() / nvalid),
            "pr2/coverage_gap": float(((1.0 - cover) * vf).sum() / nvalid),
            "pr2/zero_dev_layer": zd[0], "pr2/zero_dev_token": zd[1],
            "pr2/zero_dev_layer_r3": zd_r3[0], "pr2/zero_dev_token_r3": zd_r3[1],
            "pr2/bias_route_change": float(((set_overlap(i_rep, i_unb) < k).float() * vf).sum() / nvalid)}
