"""Group-relative advantages (GRPO, arXiv 2402.03300; Dr. GRPO, arXiv 2503.20783)."""
from __future__ import annotations

from typing import Union

import torch

from ._validate import check_choice, check_positive, check_tensor

Metrics = dict[str, torch.Tensor]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    norm: str = "std",
    eps: float = 1e-6,
    return_metrics: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, Metrics]]:
    """Per-sequence advantages ``A_i`` [B] from scalar rewards [B] grouped by ``group_ids`` [B] (any integers).

    ``norm="std"``: ``A_i = (R_i - mean_g R) / (std_g R + eps)`` with the unbiased (n-1) std
    (GRPO, arXiv 2402.03300).  ``norm="none"``: ``A_i = R_i - mean_g R`` (Dr. GRPO,
    arXiv 2503.20783).  A group of size 1, or whose rewards are all equal, gets exactly 0.

    ``return_metrics=True`` adds ``reward/mean`` and ``reward/frac_zero_std`` (the fraction of groups whose
    advantages are all zero), detached 0-d tensors.
    """
    check_tensor("rewards", rewards)
    check_tensor("group_ids", group_ids)
    check_choice("norm", norm, ("std", "none"))
    if norm == "std":
        check_positive("eps", eps)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"shape mismatch: rewards has shape {tuple(rewards.shape)} but group_ids has shape {tuple(group_ids.shape)}"
        )
    if torch.is_floating_point(group_ids) or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    if rewards.numel() and not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or Inf")
    r = rewards.detach().to(torch.float64)
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    g = uniq.numel()
    count = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, inv, r) / count.clamp(min=1)
    centred = r - mean[inv]
    sq = torch.zeros(g, dtype=torch.float64, device=r.device).index_add_(0, inv, centred * centred)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    rmax = torch.full((g,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, inv, r, "amax")
    rmin = torch.full((g,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce(0, inv, r, "amin")
    degenerate = (rmax == rmin) | (count < 2)  # all equal or a single response
    adv = centred / (std[inv] + eps) if norm == "std" else centred
    adv = torch.where(degenerate[inv], torch.zeros_like(adv), adv).to(rewards.dtype)
    if not return_metrics:
        return adv
    metrics: Metrics = {
        "reward/mean": r.mean().to(torch.float32) if r.numel() else torch.zeros(()),
        "reward/frac_zero_std": degenerate.to(torch.float32).mean() if g else torch.zeros(()),
    }
    return adv, metrics


__all__ = ["group_advantages"]
