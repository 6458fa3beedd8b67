"""Exact top-k / top-p: the trainer's log-probs are over the engine's kept sets (sampling-mask replay).

Before kept sets were replayed the trainer took its log-probs over the whole vocabulary while the engine sampled from
the truncated distribution.  On the batch of the first test (tiny model, fp32 weights on both sides, temperature 0.7,
both samplers) the two disagreed on every response token: by 0.080 nats on average (0.088 at most) with
``top_p = 0.9`` (18 of 20 tokens kept), 1.40 (1.47) with ``top_k = 4``, 1.20 (1.26) with ``top_p = 0.8, top_k = 6``;
they agree to 5e-7 at ``top_p = 1``.  Now they agree to float rounding by every way the trainer runs its forward.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from offpolicy_moe.models.kept_tokens import KeptTokens
from offpolicy_moe.models.token_logprobs import token_logprobs
from offpolicy_moe.logprobs.forward import RoutedForward
from offpolicy_moe.models.response_logprobs import response_logprobs
from offpolicy_moe.logprobs.micro_batch import MicroBatching
from tests.tiny import rollout_engine, tiny_policy

PROMPTS = ["1+2=", "7+8=", "3+3=", "9+0="]
ANSWERS = ["3", "15", "6", "9"]
TAU = 0.7


@pytest.fixture(scope="module")
def tiny():
    return tiny_policy()


def full_softmax_logp(model, batch) -> torch.Tensor:
    """The trainer's log-probs over the whole vocabulary (what it took before kept sets were replayed)."""
    with torch.no_grad():
        return response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len, temperature=TAU,
                                 response_mask=batch.response_mask)


@pytest.mark.parametrize("sampler", ["native", "hf"])
@pytest.mark.parametrize("settings,old_gap", [(dict(top_p=0.9), 1e-2), (dict(top_k=4), 1e-1),
                                              (dict(top_p=0.8, top_k=6), 1e-1)])
def test_engine_and_trainer_logprobs_agree_under_truncation(tiny, sampler, settings, old_gap):
    """Same fp32 weights: the trainer's log-probs of a truncated batch equal the engine's behaviour log-probs by
    every forward the trainer runs (plain, packed prompt groups, shared KV cache, micro-batches), where the
    whole-vocabulary log-probs disagree by more than ``old_gap``."""
    model, tok = tiny
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=6, sampler=sampler, temperature=TAU,
                         **settings)
    batch = eng.generate(PROMPTS, ANSWERS, group_size=4, seed=3)
    m = batch.response_mask.bool()
    assert float((full_softmax_logp(model, batch) - batch.behav_logp)[m].abs().max()) > old_gap
    for share in (False, "pack", "cache"):
        lp = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len, temperature=TAU,
                               response_mask=batch.response_mask, share_prompt=share, kept=batch.kept_tokens)
        assert torch.allclose(lp[m], batch.behav_logp[m], atol=2e-6, rtol=0), (share, (lp - batch.behav_logp)[m])
    for share, tokens in ((False, None), (True, None), (False, 40)):   # RoutedForward, as the update runs it
        fwd = RoutedForward(device=torch.device("cpu"), controller=None, replay="none", share_prompt=share,
                            temperature=TAU, group_size=4, micro_batching=MicroBatching(max_tokens=tokens))
        lp = fwd.logp_pieces(model, batch)
        assert torch.allclose(lp[m], batch.behav_logp[m], atol=2e-6, rtol=0), (share, pieces)
    assert len(fwd.micro_batching.pieces(batch.size, int(batch.input_ids.shape[1]))) > 1


def test_a_packed_forward_was_really_packed(tiny):
    """The ``pack`` way above is not a silent fall-back to the plain forward: on this batch the planner packs."""
    from offpolicy_moe.models.response_logprobs import plan_shared_forward

    model, tok = tiny
    batch = rollout_engine(model, tok, dtype="float32", max_new_tokens=6, top_p=0.9).generate(
        PROMPTS, ANSWERS, group_size=4, seed=3)
    plan, packing = plan_shared_forward(model, batch.input_ids, batch.attention_mask, batch.prompt_len, "pack")
    assert plan.mode == "pack" and packing is not None


def reference_logp(z: torch.Tensor, x: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """log softmax restricted to ``mask``, by autograd through plain torch ops."""
    return torch.log_softmax((z / tau).masked_fill(~mask, float("-inf")), -1).gather(-1, x.unsqueeze(-1)).squeeze(-1)


def kept_case(B=3, T=4, V=40, seed=0):
    """Logits, targets and kept sets of mixed sizes (about 5% or 50% of V = 40 tokens: stored as ids when at most
    W = 3, else as a bitmask), each holding its target; one position without a kept set."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    density = torch.where(torch.arange(B * T).view(B, T, 1) % 2 == 0, 0.05, 0.5)
    mask = torch.rand(B, T, V, generator=g) < density
    x = torch.randint(0, V, (B, T), generator=g)
    mask.scatter_(-1, x.unsqueeze(-1), True)       # the sampled token is always kept
    mask[1, 2] = True                              # a whole-vocabulary position
    return z, x, mask


@pytest.mark.parametrize("block", [None, 40, 120])
def test_gradient_flows_through_the_renormalisation(block):
    """Values and gradients equal autograd through a masked log-softmax (blocked or not, with temperature), and
    pass ``gradcheck`` in float64; no gradient reaches tokens outside a kept set."""
    z, x, mask = kept_case()
    kept = KeptTokens.from_mask(mask)
    z1, z2 = z.clone().requires_grad_(), z.clone().requires_grad_()
    w = torch.randn(3, 4, dtype=torch.float64)
    assert bool((kept.counts <= kept.words).any()) and bool((kept.counts > kept.words).any())
    lp = token_logprobs(z1, x, 1.3, kept=kept, block_elements=block)
    ref = reference_logp(z2, x, mask, 1.3)
    assert torch.allclose(lp, ref, atol=1e-12)
    (lp * w).sum().backward()
    (ref * w).sum().backward()
    assert torch.allclose(z1.grad, z2.grad, atol=1e-12)
    assert bool((z1.grad[~mask] == 0).all()) and bool((z1.grad[mask].abs() > 0).any())
    assert torch.autograd.gradcheck(lambda t: token_logprobs(t, x, 0.8, kept=kept, block_elements=block),
                                    (z.clone().requires_grad_(),))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_finite_logits_give_finite_values_and_gradients_in_every_dtype(dtype):
    """Logits of +-3e4 beside ordinary ones, at temperature 0.5 (``exp`` overflows in every dtype; the largest logit
    of a position is often outside its kept set): the restricted log-probs and their gradients are finite, the
    log-probs at most 0, and they equal a float64 masked log-softmax of the same (rounded) logits."""
    z, x, mask = kept_case(seed=1)
    z = z.to(dtype)
    z[..., 0] = 3e4
    z[..., 1] = -3e4
    kept = KeptTokens.from_mask(mask)
    zz = z.clone().requires_grad_()
    lp = token_logprobs(zz, x, 0.5, kept=kept)
    lp.sum().backward()
    assert bool(torch.isfinite(lp).all()) and bool((lp <= 0).all()), lp
    assert bool(torch.isfinite(zz.grad).all()) and bool((zz.grad[~mask] == 0).all())
    ref = reference_logp(z.double(), x, mask, 0.5)
    assert torch.allclose(lp.double(), ref, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_near_the_dtype_range_stay_exact(dtype):
    """A logit of ``finfo(bfloat16 or float32).max / 2`` outside the kept sets (where an additive mask alone would
    leave it above the kept tokens): the log-probs still equal the masked log-softmax and stay finite, gradients
    too (temperature 1: beyond that the temperature division itself overflows float32)."""
    z, x, mask = kept_case(seed=3)
    z = z.to(dtype)
    out = ~mask[..., 0]
    z[..., 0] = torch.where(out, torch.tensor(torch.finfo(dtype).max / 2, dtype=dtype), z[..., 0])
    zz = z.clone().requires_grad_()
    lp = token_logprobs(zz, x, kept=KeptTokens.from_mask(mask))
    lp.sum().backward()
    ref = reference_logp(z.double(), x, mask, 1.0)
    assert bool(torch.isfinite(lp).all()) and torch.allclose(lp.double(), ref, rtol=1e-6, atol=1e-4)
    assert bool(torch.isfinite(zz.grad).all()) and bool((zz.grad[~mask] == 0).all())


def test_a_token_outside_its_kept_set_is_refused():
    z, x, mask = kept_case(seed=2)
    mask[0, 1, x[0, 1]] = False
    mask[0, 1, (x[0, 1] + 1) % 40] = True
    with pytest.raises(ValueError, match=r"token \d+ at \(row 0, position 1\) is outside its kept set"):
        token_logprobs(z, x, kept=KeptTokens.from_mask(mask))


def test_kept_sets_that_do_not_fit_are_refused(tiny):
    z, x, mask = kept_case()
    with pytest.raises(ValueError, match="do not fit logits"):
        token_logprobs(z[:, :3], x[:, :3], kept=KeptTokens.from_mask(mask))
    model, tok = tiny
    batch = rollout_engine(model, tok, max_new_tokens=4, top_p=0.9).generate(PROMPTS, ANSWERS, group_size=2, seed=0)
    with pytest.raises(ValueError, match="kept sets .* do not fit the batch's responses"):
        response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                          kept=batch.kept_tokens.narrow(0, 2))
    holes = batch.kept_tokens.masked(torch.zeros_like(batch.response_mask))     # no kept set anywhere
    with pytest.raises(ValueError, match="a response token has no kept set"):
        response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_len,
                          response_mask=batch.response_mask, kept=holes)


def test_default_sampling_is_bit_identical_to_a_no_op_truncation(tiny):
    """``top_p = 1, top_k = 0`` (the default) records nothing; ``top_k = V`` keeps every token, so the truncation
    path must then reproduce the default one bit for bit: the same samples, behaviour log-probs and trainer
    log-probs.  (The default path itself was compared with the code before kept sets existed, commit 8fdf9b7: a
    sha256 over the samples, behaviour and trainer log-probs of both samplers with bf16 and fp32 engines was the
    same.)"""
    model, tok = tiny
    V = model.config.vocab_size
    for sampler in ("native", "hf"):
        a = rollout_engine(model, tok, max_new_tokens=5, sampler=sampler, temperature=TAU).generate(
            PROMPTS, ANSWERS, group_size=3, seed=9)
        b = rollout_engine(model, tok, max_new_tokens=5, sampler=sampler, temperature=TAU, top_k=V).generate(
            PROMPTS, ANSWERS, group_size=3, seed=9)
        assert a.kept_tokens is None and b.kept_tokens is not None
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.behav_logp, b.behav_logp)
        assert int(b.kept_tokens.counts[b.response_mask.bool()].min()) == V
        fwd = RoutedForward(device=torch.device("cpu"), controller=None, replay="none", share_prompt=True,
                            temperature=TAU, group_size=3)
        assert torch.equal(fwd.logp(model, a), fwd.logp(model, b))


@pytest.mark.parametrize("mode", ["fixed", "async"])
def test_a_truncated_run_trains_with_matching_logprobs(make_cfg, mode):
    """A tiny run with ``top_p = 0.9`` and an fp32 engine, in the trainer's process and with a rollout worker
    process (kept sets through the worker's pipe): the old-logp pass and the behaviour log-probs describe one
    distribution (k3 KL to float rounding; with the whole-vocabulary trainer log-probs of before, and top_p = 0.9
    alone, it was 3.1e-3 and 3.9e-3 in the fixed-mode run)."""
    from offpolicy_moe.trainer.trainer import Trainer

    cfg = make_cfg("rollout.top_p=0.9", "rollout.top_k=12", "rollout.dtype=float32", "rollout.temperature=0.7",
                   "trainer.steps=2", "trainer.log_every=1", "trainer.fuse_old_logp=false", f"buffer.mode={mode}")
    Trainer(cfg).run()
    rows = [json.loads(line) for line in open(Path(cfg.run_dir) / "metrics.jsonl")]
    kl = [r["mismatch/k3_kl"] for r in rows if "mismatch/k3_kl" in r]
    assert len(kl) == 2 and max(abs(k) for k in kl) < 1e-9, kl
    assert all(torch.isfinite(torch.tensor(r["actor/loss"])) for r in rows if "actor/loss" in r)
