"""Engine/trainer mismatch on a briefly trained tiny Qwen3-MoE: R3 removes the error attributable to routing."""
import copy

import pytest
import torch
import torch.nn.functional as F

from routing_models import markov_batch, trained_qwen
from offpolicy_moe.routing import RoutingController, compare_traces

PROMPT = 8


@pytest.fixture(scope="module")
def trained():
    return trained_qwen(60)


def _kl(a, b):
    """KL(softmax a ‖ softmax b) over the vocabulary, per token."""
    return (F.softmax(a, -1) * (F.log_softmax(a, -1) - F.log_softmax(b, -1))).sum(-1)


def _engine_vs_trainer(model, table, engine_dtype, sigma):
    engine = copy.deepcopy(model).to(engine_dtype)
    ectl, tctl = RoutingController(engine), RoutingController(model)
    prompts = markov_batch(16, PROMPT, torch.Generator().manual_seed(1), table)
    torch.manual_seed(0)
    noise = ectl.logit_noise(sigma, torch.Generator().manual_seed(2)) if sigma else torch.no_grad()
    with ectl.record() as rec, noise:
        out = engine.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=24, min_new_tokens=24,
                              do_sample=True, top_k=0, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0)
    routes, seq = rec.trace(), out.sequences
    engine_logits = torch.stack(out.logits, 1).float()  # predicts seq[:, PROMPT:] from positions PROMPT-1 .. S-2
    with torch.no_grad():
        with tctl.record() as own:
            plain = model(seq).logits[:, PROMPT - 1:-1].float()
        with tctl.replay(routes):
            r3 = model(seq).logits[:, PROMPT - 1:-1].float()
    flipped = compare_traces(routes, own.trace()).differs.any(-1)[:, PROMPT - 1:-1]
    return _kl(engine_logits, plain), _kl(engine_logits, r3), flipped


def test_fp32_engine_without_noise_has_no_mismatch(trained):
    kl_plain, kl_r3, flipped = _engine_vs_trainer(*trained, torch.float32, 0.0)
    assert not bool(flipped.any())
    assert kl_plain.abs().max() < 1e-6 and kl_r3.abs().max() < 1e-6


def test_bf16_engine_r3_cuts_kl_on_flipped_tokens(trained):
    kl_plain, kl_r3, flipped = _engine_vs_trainer(*trained, torch.bfloat16, 0.0)
    assert 0 < flipped.float().mean() < 0.2
    assert kl_plain[flipped].mean() >= 5 * kl_r3[flipped].mean()


def test_router_noise_engine_r3_cuts_mean_kl(trained):
    kl_plain, kl_r3, flipped = _engine_vs_trainer(*trained, torch.float32, 0.05)
    assert flipped.float().mean() > 0.05
    assert kl_plain.mean() >= 20 * kl_r3.mean()
