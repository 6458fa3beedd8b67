"""Levers that cut update time: rows of zero advantage skip the forward and backward
(``trainer.skip_zero_advantage``), and DAPO's dynamic sampling (``algo.dynamic_sampling=drop``)."""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.losses import get_policy_loss, list_policy_losses
from offpolicy_moe.models import load_policy
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.tasks import RewardScores
from offpolicy_moe.trainer.trainer import Trainer
from offpolicy_moe.logprobs import loglinear_proximal
from offpolicy_moe.trainer.update import drop_constant_groups
from tests.tiny import tiny_config

G = 4


def _zero_groups(completions, answers):
    """Rewards of a batch (rows grouped by prompt, G each) whose even groups all score 1 (zero advantage) and odd
    groups 0/1 alternately."""
    return [1.0 if (i // G) % 2 == 0 else float(i % 2) for i in range(len(completions))]


def _run(tmp_path, name, *overrides, steps=3):
    cfg = tiny_config(tmp_path / name, f"trainer.steps={steps}", f"rollout.group_size={G}", "rollout.prompts_per_step=4",
                      "buffer.staleness=1", "rollout.dtype=float32", "trainer.threads=1", "algo.routing.metrics=false",
                      "trainer.mismatch_metrics=false", *overrides)
    tr = Trainer(cfg)
    tr.task.score = lambda completions, answers, **columns: RewardScores(_zero_groups(completions, answers))
    tr.run()
    return tr


def _same(a: Trainer, b: Trainer) -> bool:
    sa, sb = a.unwrapped.state_dict(), b.unwrapped.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def test_whole_micro_batches_of_zero_advantage_skip_bit_identically(tmp_path):
    """grad_accum = groups: every even group is a micro-batch of zero advantages; skipping it leaves the
    accumulated gradient, the optimizer's moments and so the parameters bit for bit as they were (fp32)."""
    base = _run(tmp_path, "plain", "trainer.grad_accum=4")
    skip = _run(tmp_path, "skip", "trainer.grad_accum=4", "trainer.skip_zero_advantage=true")
    assert skip.last_metrics["actor/rows_skipped_share"] == pytest.approx(0.5)
    assert skip.last_metrics["actor/zero_adv_share"] >= 0.5
    assert base.last_metrics["actor/rows_skipped_share"] == 0.0
    assert _same(base, skip)
    init = load_policy(base.cfg.model, seed=base.cfg.seed)[0].state_dict()
    moved = max((v - init[k]).abs().max().item() for k, v in base.unwrapped.state_dict().items())
    assert moved > 1e-4       # the comparison is not vacuous: training changed the weights


def test_rows_of_zero_advantage_inside_a_micro_batch_skip_up_to_summation_order(tmp_path):
    """One micro-batch: the skipped rows leave it, so the weight gradients sum the same non-zero terms in another
    order: equal to float32 rounding, not bit for bit."""
    base = _run(tmp_path, "plain")
    skip = _run(tmp_path, "skip", "trainer.skip_zero_advantage=true")
    assert skip.last_metrics["actor/rows_skipped_share"] > 0
    for k, v in base.unwrapped.state_dict().items():
        torch.testing.assert_close(skip.unwrapped.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_the_skip_is_off_where_zero_advantage_rows_still_carry_a_gradient(tmp_path):
    """A KL penalty does not vanish with the advantage; the fused on-policy pass needs every row's forward."""
    kl = _run(tmp_path, "kl", "trainer.skip_zero_advantage=true", "algo.kl.coef=0.1", steps=2)
    assert kl.last_metrics["actor/rows_skipped_share"] == 0.0
    fused = _run(tmp_path, "fused", "trainer.skip_zero_advantage=true", "buffer.staleness=0", steps=2)
    assert fused.last_metrics["actor/rows_skipped_share"] == 0.0


@pytest.mark.parametrize("name", sorted(list_policy_losses()))
def test_every_registered_loss_gives_zero_gradient_to_zero_advantage_rows(name):
    """What makes the skip exact: for every loss in the registry, the gradient of the loss with respect to a
    zero-advantage row's log-probs is exactly zero (with nonzero rows beside it)."""
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    logp = (-torch.rand(B, T, generator=g) - 0.1).requires_grad_()
    old = logp.detach() + 1e-5 * torch.randn(B, T, generator=g)      # inside every clip range (GSPO: 3e-4)
    adv = torch.tensor([0.0, 1.0, 0.0, -1.0, 0.0, 0.5])
    mask = torch.ones(B, T)
    loss, _ = get_policy_loss(name)(logp, old, adv, mask)
    loss.backward()
    assert torch.all(logp.grad[adv == 0] == 0), name
    assert torch.any(logp.grad[adv != 0] != 0), name


def test_dynamic_sampling_drops_groups_whose_rewards_do_not_vary():
    ids = torch.zeros(6, 3, dtype=torch.long)
    batch = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(6, 1),
                         behav_logp=torch.zeros(6, 1), group_ids=torch.tensor([7, 7, 3, 3, 9, 9]),
                         answers=["a"] * 6, completions=[str(i) for i in range(6)], prompt_len=2, version=0,
                         generated_at=0)
    adv = torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0])
    kept, kadv, m = drop_constant_groups(batch, adv)
    assert kept.completions == ["2", "3"] and torch.equal(kadv, torch.tensor([1.0, -1.0]))
    assert m["dynamic_sampling/dropped_groups"] == 2.0 and m["dynamic_sampling/kept_share"] == pytest.approx(1 / 3)
    none, _, m = drop_constant_groups(batch, torch.zeros(6))
    assert none is None and m["dynamic_sampling/dropped_groups"] == 3.0


def test_dynamic_sampling_trains_only_on_varying_groups(tmp_path):
    """Dropped groups leave the loss's token counts: the run differs from one that keeps them (DAPO changes what
    is learned, unlike the zero-advantage skip)."""
    keep = _run(tmp_path, "keep", steps=2)
    drop = _run(tmp_path, "drop", "algo.dynamic_sampling=drop", steps=2)
    assert drop.last_metrics["dynamic_sampling/dropped_groups"] >= 2.0
    assert not _same(keep, drop)


# ---------------------------------------------------------------------------------------------------------------
# AReaL's proximal log-prob approximation (algo.proximal_logp=loglinear)

def _proximal(tmp_path, name, *overrides, steps=3):
    cfg = tiny_config(tmp_path / name, f"trainer.steps={steps}", f"rollout.group_size={G}", "rollout.prompts_per_step=4",
                      "buffer.staleness=2", "rollout.dtype=float32", "trainer.threads=1", "algo.old_logp_source=proximal",
                      *overrides)
    seen = []
    tr = Trainer(cfg, callbacks=[FunctionCallback(on_step_end=lambda t, step, m: seen.append(dict(m)))])
    tr.run()
    return tr, seen


def test_loglinear_proximal_is_exact_on_the_first_update_of_a_batch(tmp_path):
    """One optimizer update per step: the proximal policy IS the policy the update forward runs, so the
    approximation equals the exact pass (to the pass's own rounding) and the runs train alike."""
    exact, em = _proximal(tmp_path, "exact")
    approx, am = _proximal(tmp_path, "approx", "algo.proximal_logp=loglinear")
    for a, b in zip(em, am):
        assert a["mismatch/k3_kl"] == pytest.approx(b["mismatch/k3_kl"], rel=1e-4, abs=1e-9)
    for k, v in exact.unwrapped.state_dict().items():
        torch.testing.assert_close(approx.unwrapped.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_loglinear_proximal_interpolates_by_version_on_later_updates():
    ids = torch.zeros(2, 4, dtype=torch.long)
    part = RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(2, 2),
                        behav_logp=torch.tensor([[-1.0, -2.0], [-1.0, -2.0]]), group_ids=torch.tensor([0, 0]),
                        answers=["a", "a"], completions=["x", "y"], prompt_len=2, version=3, generated_at=3,
                        token_versions=torch.tensor([[3, 3], [5, 5]]))
    cur = torch.tensor([[-0.5, -1.0], [-0.5, -1.0]])
    # step 5, 2 updates per step: v_prox = 10, v_theta = 11; token versions 3 -> v_mu 6 (alpha 4/5), 5 -> 10 (0)
    got = loglinear_proximal(cur, part, update=1, step=5, updates_per_step=2)
    expect = torch.tensor([[-1.0 + 0.8 * 0.5, -2.0 + 0.8 * 1.0], [-1.0, -2.0]])
    torch.testing.assert_close(got, expect)
    assert torch.equal(loglinear_proximal(cur, part, update=0, step=5, updates_per_step=2)[0], cur[0])


def test_loglinear_proximal_is_refused_where_it_cannot_apply(tmp_path):
    from offpolicy_moe.config.validate import ConfigError, validate
    with pytest.raises(ConfigError, match="old_logp_source=proximal"):
        validate(tiny_config(tmp_path / "a", "algo.proximal_logp=loglinear"))
    with pytest.raises(ConfigError, match="algo.proximal_logp=exact"):
        validate(tiny_config(tmp_path / "b", "algo.proximal_logp=loglinear", "algo.old_logp_source=proximal",
                             "algo.loss.name=m2po", "trainer.grad_accum=2"))
