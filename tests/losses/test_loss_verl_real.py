"""The 2026 objectives against verl 0.9's own functions (verl.trainer.ppo.core_algos), values and gradients.

Skipped unless verl imports (``OFFPOLICY_MOE_REQUIRE_VERL=1``: an import error instead, as in CI).  On CPU it imports with light extra packages, none of which pulls torch:
``pip install --no-deps verl==0.9.1 ray msgpack jsonschema jsonschema-specifications attrs referencing rpds-py
tensordict pyvers cloudpickle codetiming orjson`` (omegaconf, numpy and pydantic come with this project).
"""
import importlib
import os

import pytest
import torch

if os.environ.get("OFFPOLICY_MOE_REQUIRE_VERL") == "1":     # CI installs verl and runs this file with it: no skip
    core = importlib.import_module("verl.trainer.ppo.core_algos")
    verl_config = importlib.import_module("verl.workers.config")
else:
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    verl_config = pytest.importorskip("verl.workers.config")

from loss_refs import make_batch  # noqa: E402
from offpolicy_moe.integrations import verl as opm_verl  # noqa: E402
from offpolicy_moe.losses import dppo_kl_loss, dppo_tv_loss, gmpo_loss, grpo_loss, sapo_loss  # noqa: E402


def _cfg(**kw):
    base = dict(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1)
    return verl_config.FSDPActorConfig(**base, **kw)


def _batch(seed, B=6, T=9):
    logp, old, adv, mask, w = make_batch(B=B, T=T, seed=seed, empty_row=False)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():   # probabilities in (1e-3, 0.99): away from 1, where verl's 1e-8 epsilon would matter
        logp.copy_(torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.989 + 1e-3))
        old.copy_((logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=torch.log(torch.tensor(0.99)).item()))
    return logp, old, adv[:, None].expand(B, T).contiguous(), mask, w


def _grad(loss, logp):
    (g,) = torch.autograd.grad(loss, logp)
    return g


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_dppo_gradient_equals_verls(kind, agg):
    """verl's DPPO loss is -A sg[min(r, c)] logp M (a REINFORCE surrogate); ours is -A M r with the weight
    truncated at c: the gradients agree exactly, the values by design do not (ours is the paper's surrogate)."""
    d = (0.1, 0.15) if kind == "tv" else (0.02, 0.03)
    ours = dppo_tv_loss if kind == "tv" else dppo_kl_loss
    for seed in (1, 2):
        logp, old, adv, mask, w = _batch(seed)
        cfg = _cfg(clip_ratio_low=d[0], clip_ratio_high=d[1], clip_ratio_c=1.3)
        theirs, tm = core.get_policy_loss_fn(f"dppo_{kind}")(old, logp, adv, mask.double(), agg, cfg, w)
        mine, mm = ours(logp, old, adv, mask, agg=agg, weights=w, delta_low=d[0], delta_high=d[1], ratio_cap=1.3)
        # verl divides a row by (sum_t m + 1e-8) in seq-mean-token-mean: relative 1e-9 apart there
        torch.testing.assert_close(_grad(mine, logp), _grad(theirs, logp), rtol=1e-7, atol=1e-12)
        assert 0 < tm["actor/pg_clipfrac"] < 1
        assert float(mm["actor/clipfrac"]) == pytest.approx(tm["actor/pg_clipfrac"])
        # through the adapter, with verl's own config object: the same thresholds and cap, read from verl's keys
        opm_verl.register()
        via, _ = core.get_policy_loss_fn(f"offpolicy_moe/dppo_{kind}")(old, logp, adv, mask.double(), agg, cfg, w)
        again, _ = ours(logp, old, adv, mask, agg=agg, weights=w, delta_low=d[0], delta_high=d[1], ratio_cap=1.3)
        torch.testing.assert_close(via, again)
        torch.testing.assert_close(_grad(via, logp), _grad(again, logp))


def test_sapo_equals_verls():
    for seed in (3, 4):
        logp, old, adv, mask, w = _batch(seed)
        cfg = _cfg(tau_pos=1.0, tau_neg=1.05)
        theirs, _ = core.get_policy_loss_fn("sapo")(old, logp, adv, mask.double(), "token-mean", cfg, w)
        mine, _ = sapo_loss(logp, old, adv, mask, weights=w)          # default seq-mean-token-mean, as verl forces
        torch.testing.assert_close(mine, theirs, rtol=1e-7, atol=1e-12)
        logp2 = logp.detach().clone().requires_grad_(True)
        t2, _ = core.get_policy_loss_fn("sapo")(old, logp2, adv, mask.double(), "token-mean", cfg, w)
        m2, _ = sapo_loss(logp, old, adv, mask, weights=w)
        torch.testing.assert_close(_grad(m2, logp), _grad(t2, logp2), rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.05, 0.1)])
def test_gmpo_equals_verls_geo_mean(clip):
    """verl's geo_mean: a plain mean over rows, exp(sum / (n + 1e-8)); no empty rows here, so only that 1e-8
    separates the two (relative 1e-9)."""
    for seed in (5, 6):
        logp, old, adv, mask, _ = _batch(seed)
        cfg = _cfg(clip_ratio_low=clip[0], clip_ratio_high=clip[1])
        theirs, tm = core.get_policy_loss_fn("geo_mean")(old, logp, adv, mask.double(), "token-mean", cfg, None)
        logp2 = logp.detach().clone().requires_grad_(True)
        mine, _ = gmpo_loss(logp2, old, adv, mask, clip_low=clip[0], clip_high=clip[1])
        torch.testing.assert_close(mine, theirs, rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(_grad(mine, logp2), _grad(theirs, logp), rtol=1e-7, atol=1e-10)


def test_grpo_equals_verls_vanilla_with_dual_clip():
    logp, old, adv, mask, w = _batch(7)
    cfg = _cfg(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    theirs, _ = core.get_policy_loss_fn("vanilla")(old, logp, adv, mask.double(), "token-mean", cfg, w)
    logp2 = logp.detach().clone().requires_grad_(True)
    mine, _ = grpo_loss(logp2, old, adv, mask, weights=w, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(_grad(mine, logp2), _grad(theirs, logp), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------------------------
# docs/losses.md, "Aggregation and all-masked rows": every verl row run against verl's own function
from aggregation_table import rows as table_rows  # noqa: E402
from offpolicy_moe.losses import get_policy_loss  # noqa: E402

VERL_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _with_empty_row(seed):
    logp, old, adv, mask, w = _batch(seed)
    mask = mask.clone()
    mask[2] = False                                  # an all-masked row
    return logp, old, adv, mask, w


@pytest.mark.parametrize("row", table_rows("verl"), ids=lambda r: r.loss)
@pytest.mark.parametrize("global_rows", [False, True])
def test_docs_aggregation_table_row_against_verl(row, global_rows):
    """The row's aggregation and its treatment of an all-masked row, measured on verl's own function: with
    ``loss_agg_mode`` every mode passed is the one applied (ours with that ``agg``); with a fixed mode, any mode
    passed gives that one; "counted in global_batch_size": without ``global_batch_info`` the empty row is not
    counted (ours' default count), with ``global_batch_size = B`` it is (ours with ``num_seqs=B``); "counted": always
    (``num_seqs=B``). DPPO: gradients (verl's value is a REINFORCE surrogate of the same gradient)."""
    logp, old, adv, mask, w = _with_empty_row(11)
    if row.loss == "geo_mean":    # verl folds token weights as a geometric mean (the options table says so)
        w = None
    B, T = mask.shape
    theirs_fn, ours_fn = core.get_policy_loss_fn(row.loss), get_policy_loss(row.ours)
    for passed in VERL_MODES:
        cfg = _cfg(**row.settings)
        if global_rows:
            cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B,
                                         loss_scale_factor=None)
        applied = passed if row.aggregation == "loss_agg_mode" else row.aggregation
        counted = row.empty_rows == "counted" or (global_rows and row.empty_rows == "counted in global_batch_size")
        kw = dict(num_seqs=B if counted else None, num_tokens=int(mask.sum()))
        if applied == "row mean":
            applied = "seq-mean-token-mean"
        l1 = logp.detach().clone().requires_grad_(True)
        theirs, _ = theirs_fn(old, l1, adv, mask.double(), passed, cfg, w)
        l2 = logp.detach().clone().requires_grad_(True)
        mine, _ = ours_fn(l2, old, adv, mask, agg=applied, weights=w, **kw, **row.options)
        if not row.loss.startswith("dppo"):
            torch.testing.assert_close(mine, theirs, rtol=1e-7, atol=1e-10, msg=f"{row.loss} {passed}")
        torch.testing.assert_close(_grad(mine, l2), _grad(theirs, l1), rtol=1e-7, atol=1e-10,
                                   msg=f"{row.loss} {passed}")
        if row.empty_rows != "–" and applied != "token-mean":    # the count matters here: the other one differs
            other, _ = ours_fn(l2, old, adv, mask, agg=applied, weights=w, num_tokens=int(mask.sum()),
                               num_seqs=None if counted else B, **row.options)
            assert not torch.allclose(other, mine, rtol=1e-6), f"{row.loss} {passed}: the row count did not matter"
