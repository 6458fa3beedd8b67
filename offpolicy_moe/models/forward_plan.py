"""Which trainer forward runs a batch: plain rows, packed groups, or a shared prompt KV cache — by a cost model.

The three forwards give the same log-probs and gradients up to float rounding but cost very different amounts.
For ``B`` rows of prompt length ``P`` and ``T`` response positions (``R = T - 1`` fed), in ``U`` distinct prompts
of ``n_u`` samples each:

========  =====================================  ==========================================================
forward   tokens fed                             attention entries (dense mask: every query x every key)
========  =====================================  ==========================================================
plain     ``B (P + T)``                          ``B (P + T)^2``
pack(c)   ``U_c (P + c R)``                      ``U_c (P + c R)^2``,  ``U_c = sum_u ceil(n_u / c)`` rows
cache     ``U P + B R``                          ``U P^2 + B R (P + R)``, plus the cache copied to ``B`` rows
========  =====================================  ==========================================================

The estimate, in units of one fed token's forward+backward, is

    cost = tokens + w * entries + o * (passes - 1) (+ k * B (P + R) for the cache's copy)

with ``w`` read from the model's config (:meth:`ForwardCostModel.from_config`), ``o`` a fixed per-forward overhead
and ``k`` the per-position cost of repeating the prompt cache, fitted on the 4-layer, hidden-128, 8-expert top-2
model on one CPU thread (``experiments/bench/bench_share_prompt.py``).  A shared forward is chosen only when its
estimate is below ``MARGIN`` times the plain forward's; the choice is a deterministic function of the shapes and
the config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

__all__ = ["ForwardCostModel", "ForwardPlan", "forward_costs", "choose_forward", "MODES"]

MODES = ("plain", "pack", "cache")
ENTRY_FACTOR = 2.7          # CPU attention (softmax over a dense additive mask) per multiply-add, against matmuls
PASS_OVERHEAD = 384.0       # fixed cost of one extra forward+backward, in token units
CACHE_COPY = 0.02            # cost of repeating one cached position to one row (all layers), in token units
MARGIN = 0.85               # a shared forward must be estimated at most this fraction of the plain one


@dataclass(frozen=True)
class ForwardCostModel:
    """Cost weights of one model: ``entry_weight`` = cost of one attention entry (all layers) in token units."""

    entry_weight: float
    pass_overhead: float = PASS_OVERHEAD
    cache_copy: float = CACHE_COPY
    margin: float = MARGIN

    @classmethod
    def from_config(cls, config: Any) -> "ForwardCostModel":
        """Weights from a transformers config: ``w = ENTRY_FACTOR * 2 H d / (q,k,v,o + experts + router)`` per
        layer, the head's ``h V`` added to a token's cost (a missing field counts as the dense defaults)."""
        h = int(getattr(config, "hidden_size"))
        heads = int(getattr(config, "num_attention_heads", 1) or 1)
        hd = int(getattr(config, "head_dim", None) or h // heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        layers = int(getattr(config, "num_hidden_layers", 1) or 1)
        experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0)
        top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        ffn = int(getattr(config, "moe_intermediate_size", 0) or 0) if experts and top_k else 0
        mlp = top_k * 3 * h * ffn + h * experts if ffn else 3 * h * int(getattr(config, "intermediate_size", 4 * h))
        per_token = layers * (2 * h * heads * hd + 2 * h * kv * hd + mlp) + h * int(getattr(config, "vocab_size", 0))
        per_entry = layers * 2 * heads * hd
        return cls(entry_weight=ENTRY_FACTOR * per_entry / max(per_token, 1))


def _pack_cost(counts: Sequence[int], P: int, R: int, c: int, w: float) -> tuple[float, int]:
    rows = sum((n + c - 1) // c for n in counts)
    L = P + c * R
    return rows * L + w * rows * L * L, rows * L * L


def forward_costs(prompt_len: int, fed: int, counts: Sequence[int], model: ForwardCostModel, *,
                  max_mask_elements: Optional[int] = None) -> dict[str, tuple[float, int]]:
    """Estimated cost of each forward, ``{mode: (cost, detail)}``: for ``"pack"`` the detail is the samples packed
    per row ``c`` (the group size present, or a smaller power of two, with the lowest estimate; left out when no
    ``c > 1`` fits ``max_mask_elements``), else 0.  ``counts``: samples of each distinct prompt; ``fed = T - 1``."""
    P, R = int(prompt_len), int(fed)
    counts = [int(n) for n in counts]
    if P <= 0 or R < 0 or not counts or min(counts) <= 0:
        raise ValueError(f"forward_costs needs prompt_len > 0, fed >= 0 and positive group sizes, got P={P}, "
                         f"fed={R}, counts={counts}")
    B, U, w, o = sum(counts), len(counts), model.entry_weight, model.pass_overhead
    S = P + R + 1
    # one forward's fixed overhead is common to all ways and left out (the margin compares what differs)
    out = {"plain": (B * S + w * B * S * S, 0)}
    cands = sorted({n for n in counts} | {1 << i for i in range(1, max(counts).bit_length())})
    best = None
    for c in cands:
        if c < 2:
            continue
        cost, entries = _pack_cost(counts, P, R, c, w)
        if max_mask_elements is not None and entries > max_mask_elements:
            continue
        if best is None or cost < best[0]:
            best = (cost, c)
    if best is not None:
        out["pack"] = best
    cache = U * P + w * U * P * P
    if R:
        cache += B * R + w * B * R * (P + R) + o + model.cache_copy * B * (P + R)
    out["cache"] = (cache, 0)
    return out


def choose_forward(costs: dict[str, tuple[float, int]], allowed: Sequence[str], margin: float = MARGIN) -> str:
    """The cheapest allowed shared forward when its estimate is at most ``margin`` x the plain one, else
    ``"plain"`` (ties go to the earlier of ``MODES``)."""
    bad = [m for m in allowed if m not in MODES]
    if bad:
        raise ValueError(f"unknown forward modes {bad}; expected a subset of {MODES}")
    plain = costs["plain"][0]
    shared = [(costs[m][0], MODES.index(m), m) for m in MODES[1:] if m in allowed and m in costs]
    if not shared:
        return "plain"
    cost, _, mode = min(shared)
    return mode if cost <= margin * plain else "plain"


@dataclass(frozen=True)
class ForwardPlan:
    """The chosen forward of one batch and the estimates it was chosen from (``samples_per_row``: packing's ``c``)."""

    mode: str
    costs: dict = field(default_factory=dict)
    samples_per_row: int = 0

    def metrics(self, prefix: str = "perf/forward_") -> dict[str, float]:
        """One-hot of the mode (``perf/forward_pack`` = 1.0 when packed, ...) and the estimated saving
        ``perf/forward_est_speedup`` = plain estimate / chosen estimate (1.0 when nothing was estimated); the same
        keys every time (the trainer averages metrics across processes)."""
        out = {f"{prefix}{m}": float(m == self.mode) for m in MODES}
        ok = self.mode in self.costs and self.costs[self.mode][0] > 0
        out[f"{prefix}est_speedup"] = float(self.costs["plain"][0] / self.costs[self.mode][0]) if ok else 1.0
        return out


def plan_forward(config: Any, prompt_len: int, fed: int, inverse: torch.Tensor, allowed: Sequence[str], *,
                 max_mask_elements: Optional[int] = None) -> ForwardPlan:
    """:class:`ForwardPlan` for a batch whose row ``b`` holds distinct prompt ``inverse[b]``."""
    counts = torch.bincount(inverse).tolist()
    counts = [n for n in counts if n > 0]
    costs = forward_costs(prompt_len, fed, counts, ForwardCostModel.from_config(config),
                          max_mask_elements=max_mask_elements)
    mode = choose_forward(costs, allowed)
    return ForwardPlan(mode=mode, costs=costs, samples_per_row=costs["pack"][1] if mode == "pack" else 0)
