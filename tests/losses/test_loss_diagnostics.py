"""The importance-ratio diagnostics every registered loss reports: ``actor/m2`` and ``actor/ess``.

``M2 = (1/N) sum_t (log r_t)^2`` (M2PO, arXiv 2510.01161) and ``ESS = (sum_t r_t)^2 / (N sum_t r_t^2)`` (Kong 1992)
over the valid tokens, checked against float64 formulas, their invariants, extreme and empty inputs, and the
registry, which adds them to every loss (the built-in ones and a user's).
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch

from offpolicy_moe.losses import get_loss_spec, list_policy_losses
from offpolicy_moe.losses.diagnostics import RATIO_DIAGNOSTICS, ratio_diagnostics
from offpolicy_moe.losses.registry import register_policy_loss, unregister_policy_loss, with_ratio_diagnostics


def _batch(seed: int = 0, b: int = 5, t: int = 7, scale: float = 0.4, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    logp = (old + scale * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, 0] = True
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return logp.to(dtype).requires_grad_(), old.to(dtype), adv.to(dtype), mask


def _formula(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """The two statistics written out in float64 on the valid tokens, no stabilisation."""
    d = (logp.detach().double() - old.double())[mask.bool()]
    r = torch.exp(d)
    return float((d ** 2).mean()), float(r.sum() ** 2 / (d.numel() * (r ** 2).sum()))


def test_values_match_the_formulas():
    logp, old, _, mask = _batch()
    m = ratio_diagnostics(logp, old, mask)
    m2, ess = _formula(logp, old, mask)
    assert set(m) == set(RATIO_DIAGNOSTICS)
    assert m["actor/m2"].dtype == torch.float32 and m["actor/m2"].dim() == 0
    assert m["actor/m2"].item() == pytest.approx(m2, rel=1e-6)
    assert m["actor/ess"].item() == pytest.approx(ess, rel=1e-6)
    assert 0.0 < m2 and ess < 1.0                   # a non-trivial batch: neither statistic at its on-policy value


def test_masked_positions_do_not_count_even_when_not_finite():
    logp, old, _, mask = _batch(seed=1)
    dirty = logp.detach().clone()
    dirty[~mask] = float("nan")
    old_dirty = old.clone()
    old_dirty[~mask] = float("-inf")
    a, b = ratio_diagnostics(logp, old, mask), ratio_diagnostics(dirty, old_dirty, mask.to(torch.float32))
    assert a["actor/m2"].item() == b["actor/m2"].item() and a["actor/ess"].item() == b["actor/ess"].item()


def test_on_policy_gives_m2_zero_and_ess_one():
    logp, _, _, mask = _batch(seed=2)
    m = ratio_diagnostics(logp, logp.detach(), mask)
    assert m["actor/m2"].item() == 0.0 and m["actor/ess"].item() == pytest.approx(1.0, abs=1e-7)


def test_ess_is_one_over_n_when_one_token_carries_the_weight():
    # ratios e^15 on one token and 1 elsewhere: ESS = (e^15 + n - 1)^2 / (n (e^30 + n - 1)) ~ 1/n
    n = 20
    old = torch.full((1, n), -3.0, dtype=torch.float64)
    logp = old.clone()
    logp[0, 3] = 12.0                               # log-ratio 15 on token 3
    mask = torch.ones(1, n, dtype=torch.bool)
    d = float(logp[0, 3] - old[0, 3])
    expect = (math.exp(d) + n - 1) ** 2 / (n * (math.exp(2 * d) + n - 1))
    ess = ratio_diagnostics(logp, old, mask)["actor/ess"].item()
    assert ess == pytest.approx(expect, rel=1e-6) and 1.0 / n <= ess < 1.0 / n + 1e-4


def test_ess_lies_in_its_range_and_m2_is_scale_free_in_the_weights():
    for seed in range(5):
        logp, old, _, mask = _batch(seed=seed, scale=3.0)
        m = ratio_diagnostics(logp, old, mask)
        n = int(mask.sum())
        assert 1.0 / n - 1e-6 <= m["actor/ess"].item() <= 1.0 + 1e-6
    # the ESS does not change when every weight is multiplied by one factor (old_logp shifted by a constant)
    logp, old, _, mask = _batch(seed=7)
    assert ratio_diagnostics(logp, old - 5.0, mask)["actor/ess"].item() == pytest.approx(
        ratio_diagnostics(logp, old, mask)["actor/ess"].item(), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_finite_for_extreme_finite_inputs_in_every_float_dtype(dtype):
    logp = torch.tensor([[0.0, -1.0, -50.0, -2.0]], dtype=dtype)
    old = torch.tensor([[-60.0, -1.0, 0.0, -2.5]], dtype=dtype)     # log-ratios +60 and -50: past the clamp
    mask = torch.ones(1, 4, dtype=torch.bool)
    m = ratio_diagnostics(logp, old, mask)
    assert all(torch.isfinite(v).item() for v in m.values())
    bound = 20.0 if dtype != torch.float16 else math.log(65504.0) - 1.0
    d = torch.tensor([bound, 0.0, -bound, float(logp[0, 3]) - float(old[0, 3])], dtype=torch.float64)
    assert m["actor/m2"].item() == pytest.approx(float((d ** 2).mean()), rel=1e-2)
    assert 0.25 - 1e-6 <= m["actor/ess"].item() <= 0.26            # one token carries almost all the weight


def test_no_valid_token_gives_m2_zero_and_ess_one():
    logp, old, _, _ = _batch()
    m = ratio_diagnostics(logp, old, torch.zeros(logp.shape, dtype=torch.bool))
    assert m["actor/m2"].item() == 0.0 and m["actor/ess"].item() == 1.0
    empty = ratio_diagnostics(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool))
    assert empty["actor/m2"].item() == 0.0 and empty["actor/ess"].item() == 1.0


def test_no_gradient_flows_into_the_diagnostics():
    logp, old, _, mask = _batch()
    m = ratio_diagnostics(logp, old, mask)
    assert not any(v.requires_grad for v in m.values())


@pytest.mark.parametrize("name", list_policy_losses())
def test_every_registered_loss_reports_them(name):
    logp, old, adv, mask = _batch(seed=3)
    spec = get_loss_spec(name)
    loss, metrics = spec.fn(logp, old, adv, mask)
    expect = ratio_diagnostics(logp, old, mask)
    for key in RATIO_DIAGNOSTICS:
        assert metrics[key].item() == expect[key].item(), (name, key)
    loss.backward()                                  # the wrapper leaves the loss and its gradient alone
    assert logp.grad is not None and torch.isfinite(logp.grad).all()


def test_a_users_loss_gets_them_and_its_own_keys_win():
    def my_loss(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
                norm_length=None, scale: float = 1.0):
        return -(scale * advantages.unsqueeze(-1) * logp * mask).sum(), {"actor/ess": torch.tensor(-1.0)}

    fn = register_policy_loss("diag_test_loss")(my_loss)
    try:
        assert get_loss_spec("diag_test_loss").fn is fn and fn.__wrapped__ is my_loss
        assert get_loss_spec("diag_test_loss").options == ("scale",)           # read through the wrapper
        assert inspect.signature(fn) == inspect.signature(my_loss) and fn.__doc__ == my_loss.__doc__
        logp, old, adv, mask = _batch(seed=4)
        loss, metrics = fn(logp, old, adv, mask=mask, scale=2.0)
        assert metrics["actor/ess"].item() == -1.0                            # the loss's own value
        assert metrics["actor/m2"].item() == pytest.approx(_formula(logp, old, mask)[0], rel=1e-6)
        assert loss.item() == pytest.approx(my_loss(logp, old, adv, mask, scale=2.0)[0].item())
        # the same function registered again is accepted and keeps its wrapper; another one needs overwrite
        assert register_policy_loss("diag_test_loss")(my_loss) is fn
        assert with_ratio_diagnostics(fn) is fn
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("diag_test_loss")(lambda *a, **k: my_loss(*a, **k))
    finally:
        unregister_policy_loss("diag_test_loss")
