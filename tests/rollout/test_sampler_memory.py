"""The native sampler holds one step's ``[B, V]`` scores at a time once a step reaches its threshold, as with a real
vocabulary (all ``T`` steps' scores would be ``B * T * V`` floats), and its behaviour log-probs are still ``log_softmax(s_t)[x_t]`` of the scores each
token was drawn from; the no-grad log-prob blocks give the one-block values."""
from __future__ import annotations

import gc
import weakref

import torch

from tests.tiny import rollout_engine
from offpolicy_moe.config.schema import ModelConfig, TaskConfig
from offpolicy_moe.models.token_logprobs import token_logprobs
from offpolicy_moe.rollout.engine import HFRolloutEngine
from offpolicy_moe.models import load_policy
from offpolicy_moe.tasks import make_task


def test_sampler_keeps_one_step_of_scores():
    torch.set_num_threads(1)
    task = make_task(TaskConfig())
    model, tok = load_policy(ModelConfig(num_layers=1, hidden_size=32, num_experts=4, top_k=2), seed=0, task=task)
    rows = task.sample_prompts(0, 2)
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=12, sampler="native")
    process = eng._process_scores
    alive: list[weakref.ref] = []
    drawn: list[torch.Tensor] = []
    peak = [0]

    def spy(logits):
        scores = process(logits)
        alive.append(weakref.ref(scores))
        drawn.append(torch.log_softmax(scores, -1).clone())     # a copy: the spy does not keep the tensor alive
        return scores

    def between_tokens(_engine):
        gc.collect()
        peak[0] = max(peak[0], sum(r() is not None for r in alive))

    eng._process_scores = spy
    eng.call_between_tokens(between_tokens)
    eng.scores_held_elements = 1          # as with a real vocabulary: one step's scores reach the threshold
    batch = eng.generate([r["prompt"] for r in rows], [r["answer"] for r in rows], group_size=3, seed=1)
    assert len(alive) >= 5
    assert peak[0] == 1            # only the current step's scores (all earlier ones were freed)
    # the default threshold holds this tiny vocabulary's steps to the end: the same samples and log-probs
    eng2 = rollout_engine(model, tok, dtype="float32", max_new_tokens=12, sampler="native")
    assert eng2.scores_held_elements > 12 * 6 * len(tok)
    again = eng2.generate([r["prompt"] for r in rows], [r["answer"] for r in rows], group_size=3, seed=1)
    assert torch.equal(again.input_ids, batch.input_ids)
    torch.testing.assert_close(again.behav_logp, batch.behav_logp, rtol=0, atol=1e-6)
    # the behaviour log-probs are the drawn tokens' log-softmax entries of the scores they were drawn from
    resp = batch.input_ids[:, batch.prompt_len:]
    want = torch.stack([d.gather(-1, resp[:, t:t + 1]).squeeze(-1) for t, d in enumerate(drawn)], 1)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(batch.behav_logp[mask], want[:, :resp.shape[1]][mask], rtol=0, atol=1e-6)


def test_token_logprobs_blocks_equal_one_block():
    g = torch.Generator().manual_seed(0)
    for B, T, V, block in ((3, 5, 7, 1), (3, 5, 7, 40), (4, 6, 50, 333), (2, 9, 11, 10 ** 9)):
        for dtype in (torch.float32, torch.bfloat16):
            z = (torch.randn(B, T, V, generator=g) * 4).to(dtype).requires_grad_()
            x = torch.randint(0, V, (B, T), generator=g)
            for temp in (1.0, 0.7):
                whole = torch.log_softmax(z.float() / temp, -1).gather(-1, x.unsqueeze(-1)).squeeze(-1)
                got = token_logprobs(z, x, temp, block_elements=block)
                assert got.dtype == torch.float32 and got.shape == (B, T)
                torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)
                gw, = torch.autograd.grad(whole.sum(), z)
                gg, = torch.autograd.grad(token_logprobs(z, x, temp, block_elements=block).sum(), z)
                torch.testing.assert_close(gg.float(), gw.float(), rtol=0, atol=1e-5)


def test_token_logprobs_gradcheck():
    g = torch.Generator().manual_seed(1)
    for block in (7, 10 ** 9):
        z = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
        x = torch.randint(0, 5, (2, 3), generator=g)
        for temp in (1.0, 0.6):
            assert torch.autograd.gradcheck(lambda t: token_logprobs(t, x, temp, block_elements=block), (z,))


def test_token_logprobs_saves_the_logits_not_a_float32_copy():
    """Under autograd, a bfloat16 model's logits are kept as they are for the backward (plus one float per
    position), not as float32 copies of every block (which would be twice their size)."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 9, 8, generator=g).bfloat16().requires_grad_()
    w = torch.randn(300, 8, generator=g).bfloat16()
    x = torch.randint(0, 300, (4, 9), generator=g)
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    logits = h @ w.t()                                   # an intermediate, as a model's logits are
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = token_logprobs(logits, x, 0.8, block_elements=300 * 9)      # four blocks of one row
    float_bytes = sum(t.numel() * t.element_size() for t in saved if t.is_floating_point() and t.dim() == 3
                      and t.dtype == torch.float32)
    assert float_bytes == 0
    lp.sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad.float()).all()


def test_generate_sampler_holds_one_step_of_scores():
    """``rollout.sampler=hf``: ``generate`` is asked for no per-step scores (it would return all ``T`` of them);
    the behaviour log-probs come from the last logits processor and equal the native sampler's."""
    torch.set_num_threads(1)
    task = make_task(TaskConfig())
    model, tok = load_policy(ModelConfig(num_layers=1, hidden_size=32, num_experts=4, top_k=2), seed=0, task=task)
    rows = task.sample_prompts(0, 2)
    prompts, answers = [r["prompt"] for r in rows], [r["answer"] for r in rows]
    out = {}
    for sampler in ("hf", "native"):
        eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=9, sampler=sampler, temperature=0.9,
                              top_p=0.95, decode_attention="sdpa")
        calls = []
        generate = eng.model.generate

        def spy(*args, **kwargs):
            calls.append(kwargs)
            return generate(*args, **kwargs)

        eng.model.generate = spy
        out[sampler] = eng.generate(prompts, answers, group_size=3, seed=4)
        assert len(calls) == (1 if sampler == "hf" else 0)
        if calls:
            assert calls[0]["output_scores"] is False
    assert torch.equal(out["hf"].input_ids, out["native"].input_ids)
    torch.testing.assert_close(out["hf"].behav_logp, out["native"].behav_logp, rtol=0, atol=1e-5)


def test_token_logprobs_refuses_bad_input():
    import pytest

    z = torch.randn(2, 3, 5)
    x = torch.randint(0, 5, (2, 3))
    cases = [
        ((torch.randn(6, 5), x, 1.0, None), "float \\[B, T, V\\]"),
        ((z.long(), x, 1.0, None), "float \\[B, T, V\\]"),
        ((z, x[:, :2], 1.0, None), "targets must be integer ids shaped \\[B, T\\] = \\(2, 3\\)"),
        ((z, x.float(), 1.0, None), "targets must be integer ids"),
        ((z, x + 5, 1.0, None), "target ids must be in \\[0, 5\\)"),
        ((z, x - 9, 1.0, None), "target ids must be in \\[0, 5\\)"),
        ((z, x, 0.0, None), "temperature must be finite and > 0"),
        ((z, x, float("nan"), None), "temperature must be finite and > 0"),
        ((z, x, 1.0, 0), "block_elements must be >= 1"),
    ]
    for (zz, xx, temp, block), match in cases:
        with pytest.raises(ValueError, match=match):
            token_logprobs(zz, xx, temp, block_elements=block)
    assert token_logprobs(torch.randn(0, 3, 5), torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3)
