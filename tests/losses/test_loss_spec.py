"""Losses that describe themselves: options, capabilities, global pass; callers that never name a loss."""
import ast
import dataclasses
import pathlib
import sys
import types

import pytest
import torch

from loss_refs import make_batch, ref_cispo, ref_unclipped
from offpolicy_moe.losses import (
    get_loss_spec,
    get_policy_loss,
    list_policy_losses,
    loss_options_problem,
    m2po_mask,
    register_policy_loss,
    resolve_loss_options,
    unregister_policy_loss,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_capabilities_declared_in_the_registry():
    grpo, gspo, m2po, unclipped = (get_loss_spec(n) for n in ("grpo", "gspo", "m2po", "unclipped"))
    assert grpo.clips and gspo.clips and not m2po.clips and not unclipped.clips
    assert gspo.sequence_level and not grpo.sequence_level
    assert m2po.needs_global_pass and m2po.distributed and not grpo.needs_global_pass
    assert m2po.wants_global_pass({}) and m2po.wants_global_pass({"scope": "global"})
    assert not m2po.wants_global_pass({"scope": "local"}) and not grpo.wants_global_pass({})
    assert m2po.options == ("tau", "variant", "scope")   # runtime arguments are not user options
    assert grpo.option_defaults == {"clip_low": None, "clip_high": None, "dual_clip": None}


def test_options_typo_names_the_loss_and_suggests():
    with pytest.raises(ValueError, match=r"loss 'm2po' has no option 'tua' \(did you mean 'tau'\?\); its options: tau, variant, scope"):
        resolve_loss_options("m2po", {"tua": 0.1})
    with pytest.raises(ValueError, match=r"loss 'unclipped' has no option 'clip_low'; its options: none"):
        resolve_loss_options("unclipped", {"clip_low": 0.2})
    with pytest.raises(ValueError, match=r"unknown policy loss 'm2p0' \(did you mean 'm2po'\?\)"):
        resolve_loss_options("m2p0", {})
    with pytest.raises(ValueError, match=r"loss 'm2po': unknown variant 'clip'"):
        resolve_loss_options("m2po", {"variant": "clip"})
    for bad in ({"tau": 0.0}, {"tau": float("nan")}, {"tau": -1.0}):
        with pytest.raises(ValueError, match=r"loss 'm2po': tau must be a finite number > 0"):
            resolve_loss_options("m2po", bad)
    with pytest.raises(ValueError, match=r"loss 'grpo': dual_clip must be a finite number > 1"):
        resolve_loss_options("grpo", {"dual_clip": 1.0})
    assert resolve_loss_options("m2po", {"tau": 0.01, "variant": None}) == {"tau": 0.01}
    assert loss_options_problem("grpo", {"clip_low": 0.1}) is None
    assert "did you mean 'clip_low'" in loss_options_problem("grpo", {"clip_lo": 0.1})


def test_global_pass_is_m2po_selection_over_all_micro_batches():
    parts = [make_batch(B=3, T=6, seed=s, scale=0.6) for s in (1, 2)]
    lrs = [lp.detach() - old for lp, old, _, _, _ in parts]
    advs = [a for _, _, a, _, _ in parts]
    masks = [m for _, _, _, m, _ in parts]
    spec = get_loss_spec("m2po")
    extra = spec.run_global_pass(lrs, advs, masks, {"tau": 0.01})
    keeps = m2po_mask(lrs, advs, masks, tau=0.01)
    assert len(extra) == 2 and all(torch.equal(e["m2po_keep"], k) for e, k in zip(extra, keeps))
    capped = spec.run_global_pass(lrs, advs, masks, {"tau": 0.01, "variant": "adaptive_clip"})
    assert set(capped[0]) == {"m2po_cap"} and torch.equal(capped[0]["m2po_cap"], capped[1]["m2po_cap"])
    assert get_loss_spec("grpo").run_global_pass(lrs, advs, masks, {}) == [{}, {}]


def test_user_loss_with_capabilities_plugs_in():
    def check(scale=1.0):
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale!r}")

    @register_policy_loss("test_spec_scaled", clips=True, check_options=check)
    def scaled(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None,
               num_seqs=None, norm_length=None, scale=1.0):
        loss, m = get_policy_loss("unclipped")(logp, old_logp, advantages, mask, agg=agg, weights=weights,
                                                num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
        return scale * loss, m

    try:
        spec = get_loss_spec("test_spec_scaled")
        assert spec.clips and spec.options == ("scale",) and spec.option_defaults == {"scale": 1.0}
        with pytest.raises(ValueError, match=r"loss 'test_spec_scaled': scale must be > 0"):
            resolve_loss_options("test_spec_scaled", {"scale": -1})
    finally:
        unregister_policy_loss("test_spec_scaled")


def _string_constants(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    return {
        node.value for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    }


CALLERS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "offpolicy_moe" / "engine").rglob("*.py")) + [
    "offpolicy_moe/config/validate.py", "offpolicy_moe/integrations/verl.py"]


@pytest.mark.parametrize("rel", CALLERS)
def test_callers_never_name_a_loss(rel):
    """The engine (trainer and its parts), the config validator and the verl adapter ask the registry; no loss
    name in their code."""
    named = _string_constants(ROOT / rel) & set(list_policy_losses())
    assert not named, f"{rel} names losses {sorted(named)} in code"


# ------------------------------------------------------------------------------------ verl adapter

@pytest.fixture
def fake_verl(monkeypatch):
    registry = {}

    def register(name):
        def deco(fn):
            registry[name] = fn
            return fn
        return deco

    core = types.ModuleType("verl.trainer.ppo.core_algos")
    core.POLICY_LOSS_REGISTRY = registry
    core.register_policy_loss = register
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", core)
    return registry


def test_verl_registers_cispo_and_user_losses_with_options_under_their_key(fake_verl):
    from offpolicy_moe.integrations import verl as opm_verl

    @register_policy_loss("test_verl_scaled")
    def scaled(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None,
               num_seqs=None, norm_length=None, scale=1.0):
        loss, m = get_policy_loss("unclipped")(logp, old_logp, advantages, mask, agg=agg, weights=weights,
                                                num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)
        return scale * loss, m

    try:
        names = opm_verl.register()
        assert "offpolicy_moe/cispo" in names and "offpolicy_moe/test_verl_scaled" in names
        logp, old, adv, mask, w = make_batch(B=6, T=8, seed=5, scale=0.6)
        adv_bt = adv[:, None].expand(6, 8)
        # options under the loss's own key (config.policy_loss.<name>) beat verl's own clip keys
        cfg = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "policy_loss": {"cispo": {"clip_high": 0.5}}}
        loss, metrics = fake_verl["offpolicy_moe/cispo"](old, logp, adv_bt, mask, "token-mean", cfg, w)
        torch.testing.assert_close(loss, ref_cispo(logp, old, adv, mask, weights=w, lo=0.2, hi=0.5))
        assert isinstance(metrics["actor/pg_clipfrac"], float)
        # verl's own keys alone feed clip_low / clip_high
        loss2, _ = fake_verl["offpolicy_moe/cispo"](old, logp, adv_bt, mask, "token-mean",
                                                    {"clip_ratio": 0.3}, None)
        torch.testing.assert_close(loss2, ref_cispo(logp, old, adv, mask, lo=0.3, hi=0.3))
        # config.<name> works too, for a user's loss the adapter never heard of
        loss3, _ = fake_verl["offpolicy_moe/test_verl_scaled"](old, logp, adv_bt, mask, "token-mean",
                                                               {"test_verl_scaled": {"scale": 3.0}}, None)
        torch.testing.assert_close(loss3, 3 * ref_unclipped(logp, old, adv, mask))
        with pytest.raises(ValueError, match=r"loss 'm2po' has no option 'tua' \(did you mean 'tau'\?\)"):
            fake_verl["offpolicy_moe/m2po"](old, logp, adv_bt, mask, "token-mean", {"m2po": {"tua": 0.1}}, None)
    finally:
        unregister_policy_loss("test_verl_scaled")


def test_verl_cross_rank_process_group_only_when_asked(monkeypatch):
    """Per-call selection by default (safe with verl's uneven micro-batch counts); the world group on request."""
    from offpolicy_moe.integrations import verl as opm_verl

    seen = []
    spec = get_loss_spec("m2po")

    def spy(logp, old_logp, advantages, mask, **kw):
        seen.append(kw.get("process_group"))
        return spec.fn(logp, old_logp, advantages, mask, **{k: v for k, v in kw.items() if k != "process_group"})

    monkeypatch.setattr(opm_verl.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(opm_verl.dist, "group", types.SimpleNamespace(WORLD="WORLD"))
    monkeypatch.setattr(opm_verl, "get_loss_spec", lambda name: dataclasses.replace(spec, fn=spy))
    logp, old, adv, mask, _ = make_batch(B=4, T=5, seed=9)
    for cross_rank, cfg, expected in ((False, None, None), (True, None, "WORLD"),
                                      (True, {"m2po": {"scope": "local"}}, None)):
        opm_verl.make_verl_loss("m2po", cross_rank=cross_rank)(old, logp, adv, mask, "token-mean", cfg, None)
        assert seen[-1] == expected, (cross_rank, cfg)
