"""A fixed, seeded perturbation of router weights: a systematic engine/trainer routing mismatch.

A rollout engine whose router runs another kernel (another matmul order or precision, a fused gate) sees the
trainer's router logits ``z = h W^T`` plus an error that is the same at every forward. This module models it as a
fixed error ``dW_l`` of each MoE layer's router weights, drawn once from the run's seed alone, applied as a
:class:`~offpolicy_moe.routing.pr2.PR2Predictors` through ``RoutingController.offsets`` (docs/routing.md, "A fixed
engine/trainer mismatch").
"""
from __future__ import annotations

import math

import torch

from .pr2 import PR2Predictors

__all__ = ["router_perturbation", "perturbation_seed", "PERTURB_SALT"]

PERTURB_SALT = 0x7065727475726221     # b"perturb!": keeps the stream apart from every other use of the run's seed
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea and Flood 2014, https://doi.org/10.1145/2660193.2660195): a
    bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def perturbation_seed(seed: int) -> int:
    """The generator seed of the router perturbation of a run seeded with ``seed``: ``splitmix64(seed XOR salt)``
    truncated to 63 bits, a pure function of ``seed`` (any Python int; negative seeds wrap modulo 2^64)."""
    return _splitmix64((int(seed) & _MASK64) ^ PERTURB_SALT) & ((1 << 63) - 1)


def router_perturbation(hidden_size: int, num_experts: int, num_layers: int, sigma: float, seed: int,
                        device: torch.device | str | None = None) -> PR2Predictors:
    """The fixed router-weight perturbation ``dW`` of a run: ``dW_l ~ N(0, sigma^2 / H)`` of shape ``[E, H]`` for
    ``l = 0 .. L-1``, as a frozen float32 :class:`PR2Predictors` whose ``forward(l, h) = h dW_l^T``.

    Drawn with ``torch.randn([E, H], generator=g) * sigma / sqrt(H)`` per layer in order, ``g`` a CPU generator
    seeded with :func:`perturbation_seed` ``(seed)``; then moved to ``device``.  ``sigma = 0`` gives zeros."""
    if not (sigma >= 0.0 and math.isfinite(sigma)):
        raise ValueError(f"router perturbation sigma must be finite and >= 0, got {sigma}")
    pert = PR2Predictors(hidden_size, num_experts, num_layers, dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(perturbation_seed(seed))
    scale = float(sigma) / math.sqrt(hidden_size)
    with torch.no_grad():
        for lin in pert.layers:
            lin.weight.copy_(torch.randn((num_experts, hidden_size), generator=gen, dtype=torch.float32) * scale)
    pert.requires_grad_(False)
    pert.eval()
    return pert.to(device) if device is not None else pert
