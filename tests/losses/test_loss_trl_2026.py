"""VESPO, OPSM and the sequence-level masked IS against TRL 1.16 (trl/trainer/grpo_trainer.py).

VESPO's kernel and OPSM's mask are TRL's own static methods (``GRPOTrainer.get_gamma_weights``,
``GRPOTrainer.get_off_policy_mask``), called here.  TRL computes its vLLM importance-sampling ratio inline in
``_generate_and_score_completions``; ``_trl_is_ratio`` below builds it the same way, step for step."""
import math

import pytest
import torch

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
GRPOTrainer = grpo_trainer.GRPOTrainer

from loss_refs import make_batch  # noqa: E402
from offpolicy_moe.losses import correction_weights, vespo_loss  # noqa: E402


def _trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vllm importance-sampling ratio: exp of the masked log difference, summed over the sequence in
    sequence_* modes ((B, 1)), then clamped (truncate) or zeroed outside [min, max] (mask)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


@pytest.mark.parametrize("trl_mode, level, mode", [
    ("sequence_mask", "sequence", "mask"), ("sequence_truncate", "sequence", "truncate"),
    ("token_mask", "token", "mask"), ("token_truncate", "token", "truncate"),
])
@pytest.mark.parametrize("clip_min", [None, 0.5])
def test_correction_weights_are_trls_vllm_importance_sampling(trl_mode, level, mode, clip_min):
    """Our (level, mode, high, low) reproduce TRL's four modes, its default sequence_mask included: MIS at the
    sequence level IS TRL's sequence mask (a product of token ratios, not a geometric mean)."""
    bit = kept = False
    for seed in (0, 1, 2):
        logp, sampling, _, mask, _ = make_batch(B=8, T=6, seed=seed, scale=1.0)
        old = logp.detach()
        theirs = _trl_is_ratio(old, sampling, mask.double(), trl_mode, clip_min, 3.0)
        mine, _ = correction_weights(old, sampling, mask, level=level, mode=mode, high=3.0, low=clip_min)
        expected = torch.where(mask, theirs.expand_as(old), torch.zeros_like(old))
        torch.testing.assert_close(mine, expected, rtol=1e-12, atol=0)
        bit, kept = bit or bool(((mine == 0) & mask).any()), kept or bool(((mine > 0) & mask).any())
    if trl_mode == "sequence_mask":
        assert bit and kept                         # the mask bites on these batches, and not everywhere


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_opsm_is_trls_off_policy_mask(per_token_adv):
    for seed, delta in ((2, 0.0), (3, 0.02), (4, 0.1)):
        logp, sampling, adv, mask, _ = make_batch(B=10, T=7, seed=seed, scale=0.3, per_token_adv=per_token_adv)
        a2 = adv.unsqueeze(1) if adv.dim() == 1 else adv
        theirs = GRPOTrainer.get_off_policy_mask(advantages=a2, per_token_logps=logp.detach(),
                                                 sampling_per_token_logps=sampling, mask=mask.double(),
                                                 off_policy_threshold=delta)
        mine, _ = correction_weights(logp.detach(), sampling, mask, mode="opsm", advantages=adv, opsm_delta=delta)
        torch.testing.assert_close(mine, torch.where(mask, theirs.expand_as(mine), torch.zeros_like(mine)))


@pytest.mark.parametrize("with_is", [False, True])
def test_vespo_is_trls(with_is):
    """TRL: phi from get_gamma_weights (the vLLM token IS ratio folded into w), per-token loss -phi A logp,
    normalised by num_items_in_batch (the token count) == our vespo_loss, token-mean, fold_weights=True."""
    for seed in (5, 6):
        logp, old, adv, mask, _ = make_batch(B=8, T=6, seed=seed, scale=0.1)
        sampling = old + 0.05 * torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        is_ratio = _trl_is_ratio(old, sampling, mask.double(), "token_mask", 0.9, 1.1) if with_is else None
        a2 = adv.unsqueeze(1)
        log_ratio = logp - old
        phi = GRPOTrainer.get_gamma_weights(advantages=a2, log_ratio_per_token=log_ratio, mask=mask.double(),
                                            importance_sampling_ratio=is_ratio, k_pos=2.0, lambda_pos=3.0,
                                            k_neg=3.0, lambda_neg=2.0)
        per_token = -phi * a2 * logp
        theirs = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        logp2 = logp.detach().clone().requires_grad_(True)
        mine, metrics = vespo_loss(logp2, old, adv, mask, weights=is_ratio)
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-14)
        (g_t,) = torch.autograd.grad(theirs, logp)
        (g_m,) = torch.autograd.grad(mine, logp2)
        torch.testing.assert_close(g_m, g_t, rtol=1e-12, atol=1e-14)
        assert float(metrics["vespo/phi_mean"]) < 0.999            # off-policy: the kernel reshapes
