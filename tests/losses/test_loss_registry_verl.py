"""Registry of policy losses and the verl adapter (with a fake verl module)."""
import sys
import types

import pytest
import torch

from loss_refs import greedy_m2po, make_batch, ref_grpo, ref_gspo_token, ref_m2po, ref_unclipped
from offpolicy_moe.losses import (
    get_policy_loss,
    grpo_loss,
    list_policy_losses,
    policy_loss_options,
    register_policy_loss,
    unregister_policy_loss,
)


def test_builtins_registered():
    assert {"grpo", "gspo", "m2po", "unclipped"} <= set(list_policy_losses())
    assert get_policy_loss("grpo") is grpo_loss
    assert policy_loss_options("grpo") == ("clip_low", "clip_high", "dual_clip")
    assert "tau" in policy_loss_options("m2po")


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="grpo.*gspo.*m2po.*unclipped"):
        get_policy_loss("ppo2")


def test_user_loss_plugs_in_by_name():
    @register_policy_loss("test_scaled_pg")
    def scaled(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None,
               num_seqs=None, norm_length=None, scale=1.0):
        loss, m = get_policy_loss("unclipped")(logp, old_logp, advantages, mask, agg=agg, weights=weights,
                                                num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
        return scale * loss, m

    try:
        logp, old, adv, mask, _ = make_batch(seed=0)
        fn = get_policy_loss("test_scaled_pg")
        loss, _ = fn(logp, old, adv, mask, agg=None, weights=None, num_tokens=None, num_seqs=None,
                     norm_length=None, scale=2.0)
        torch.testing.assert_close(loss, 2 * ref_unclipped(logp, old, adv, mask))
        assert policy_loss_options("test_scaled_pg") == ("scale",)
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("test_scaled_pg")(grpo_loss)
    finally:
        unregister_policy_loss("test_scaled_pg")
    assert "test_scaled_pg" not in list_policy_losses()


def test_registration_checks_the_calling_convention():
    with pytest.raises(TypeError, match="num_tokens"):
        register_policy_loss("test_bad")(lambda logp, old_logp, advantages, mask, agg=None: (0, {}))
    with pytest.raises(TypeError, match="positionally"):
        register_policy_loss("test_bad")(lambda logp, **kw: (0, {}))
    assert "test_bad" not in list_policy_losses()


# ------------------------------------------------------------------------------------ verl adapter

@pytest.fixture
def fake_verl(monkeypatch):
    registry = {}

    def register_policy_loss(name):
        def deco(fn):
            if name in registry:
                raise ValueError(f"duplicate {name}")
            registry[name] = fn
            return fn
        return deco

    core = types.ModuleType("verl.trainer.ppo.core_algos")
    core.POLICY_LOSS_REGISTRY = registry
    core.register_policy_loss = register_policy_loss
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", core)
    return registry


class _Cfg:
    """Attribute-style config like verl's ActorConfig, with a nested policy_loss section."""

    def __init__(self, **kw):
        self.policy_loss = types.SimpleNamespace(**kw.pop("policy_loss", {}))
        self.__dict__.update(kw)


def test_verl_register_and_calling_convention(fake_verl):
    from offpolicy_moe.integrations import verl as opm_verl

    names = opm_verl.register()
    assert names == [f"offpolicy_moe/{n}" for n in list_policy_losses()]
    assert {"offpolicy_moe/cispo", "offpolicy_moe/grpo", "offpolicy_moe/gspo", "offpolicy_moe/m2po",
            "offpolicy_moe/unclipped"} <= set(names)
    assert set(names) <= set(fake_verl)
    assert opm_verl.register() == names  # idempotent

    logp, old, adv, mask, w = make_batch(B=6, T=8, seed=3, scale=0.4)
    adv_bt = adv[:, None].expand(6, 8)
    # verl's keyword call: old_log_prob first, then log_prob
    cfg = _Cfg(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.3, clip_ratio_c=None)
    loss, metrics = fake_verl["offpolicy_moe/grpo"](
        old_log_prob=old, log_prob=logp, advantages=adv_bt, response_mask=mask.float(),
        loss_agg_mode="seq-mean-token-mean", config=cfg, rollout_is_weights=w,
    )
    exp = ref_grpo(logp, old, adv, mask, agg="seq-mean-token-mean", weights=w, lo=0.1, hi=0.3)
    torch.testing.assert_close(loss, exp)
    assert isinstance(metrics["actor/pg_clipfrac"], float) and isinstance(metrics["actor/ppo_kl"], float)

    # clip_ratio fallback + dual clip from clip_ratio_c, positional call
    cfg2 = {"clip_ratio": 0.15, "clip_ratio_c": 1.5}
    loss2, _ = fake_verl["offpolicy_moe/grpo"](old, logp, adv_bt, mask, "token-mean", cfg2, None)
    torch.testing.assert_close(loss2, ref_grpo(logp, old, adv, mask, lo=0.15, hi=0.15, dual=1.5))

    # GSPO reads the same keys
    loss3, _ = fake_verl["offpolicy_moe/gspo"](old, logp, adv_bt, mask, "seq-mean-token-mean",
                                               _Cfg(clip_ratio_low=0.01, clip_ratio_high=0.02), None)
    torch.testing.assert_close(loss3, ref_gspo_token(logp, old, adv, mask, lo=0.01, hi=0.02))

    # M2PO: tau under the loss's own key in config.policy_loss, global counts from global_batch_info
    # (scaled by dp_size)
    cfg4 = _Cfg(policy_loss={"m2po": {"tau": 0.01, "scope": "local"}},
                global_batch_info={"dp_size": 2, "batch_num_tokens": 77, "global_batch_size": 12})
    loss4, m4 = fake_verl["offpolicy_moe/m2po"](old, logp, adv_bt, mask, "token-mean", cfg4, None)
    keep = greedy_m2po(logp.detach() - old, adv, mask, 0.01)
    assert int((mask & ~keep).sum()) > 0
    torch.testing.assert_close(loss4, 2 * ref_m2po(logp, old, adv, mask, keep, num_tokens=77))
    assert m4["m2po/masked_frac"] > 0

    loss5, _ = fake_verl["offpolicy_moe/unclipped"](old, logp, adv_bt, mask, config=None)
    torch.testing.assert_close(loss5, ref_unclipped(logp, old, adv, mask))
    (g,) = torch.autograd.grad(loss5, logp)
    assert torch.isfinite(g).all()


def test_verl_missing_gives_install_hint(hide_package):
    """Hidden for this test, whether verl is installed or not, and whether another test imported it first."""
    hide_package("verl")
    from offpolicy_moe.integrations import verl as opm_verl

    with pytest.raises(ImportError, match="pip install verl"):
        opm_verl.register()


def test_verl_adapter_feeds_the_2026_losses_from_verls_keys(fake_verl):
    """DPPO's thresholds and ratio cap come from verl's clip keys, SAPO's temperatures from tau_pos/tau_neg,
    GMPO's log-space clip from clip_ratio_low/high, VESPO's shape from its own section."""
    from loss_refs import ref_dppo, ref_sapo, ref_vespo
    from offpolicy_moe.integrations import verl as opm_verl

    opm_verl.register()
    assert {"offpolicy_moe/dppo_tv", "offpolicy_moe/dppo_kl", "offpolicy_moe/gmpo", "offpolicy_moe/sapo",
            "offpolicy_moe/vespo"} <= set(fake_verl)
    logp, old, adv, mask, w = make_batch(B=6, T=8, seed=4, scale=0.4)
    adv_bt = adv[:, None].expand(6, 8)
    cfg = _Cfg(clip_ratio=0.2, clip_ratio_low=0.05, clip_ratio_high=0.08, clip_ratio_c=1.5, tau_pos=2.0, tau_neg=3.0)
    loss, m = fake_verl["offpolicy_moe/dppo_tv"](old, logp, adv_bt, mask, "token-mean", cfg, w)
    torch.testing.assert_close(loss, ref_dppo("tv", logp, old, adv, mask, weights=w, lo=0.05, hi=0.08, cap=1.5))
    assert "actor/pg_clipfrac" in m
    loss, _ = fake_verl["offpolicy_moe/sapo"](old, logp, adv_bt, mask, "seq-mean-token-mean", cfg, None)
    torch.testing.assert_close(loss, ref_sapo(logp, old, adv, mask, tau_pos=2.0, tau_neg=3.0))
    cfg_v = _Cfg(policy_loss={"vespo": {"k_pos": 1.0, "fold_weights": False}})
    loss, _ = fake_verl["offpolicy_moe/vespo"](old, logp, adv_bt, mask, "token-mean", cfg_v, w)
    torch.testing.assert_close(loss, ref_vespo(logp, old, adv, mask, weights=w, k_pos=1.0, fold=False))
    with pytest.raises(ValueError, match="loss 'vespo' has no option 'k'"):
        fake_verl["offpolicy_moe/vespo"](old, logp, adv_bt, mask, "token-mean", _Cfg(vespo={"k": 1.0}), None)
