"""The gradient probe of the longtail job (experiments/bench/probe_gradient.py): its response mask, and its loss's
gradient against a plain reference on the embedded model."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "experiments" / "bench"
sys.path.insert(0, str(BENCH))

import probe_gradient  # noqa: E402
from offpolicy_moe.models.presets import tiny_qwen3_moe_config  # noqa: E402


def test_response_mask_keeps_tokens_through_the_first_eos():
    eos = 3
    comp = torch.tensor([[5, 6, 3, 0, 0], [5, 3, 3, 7, 0], [5, 6, 7, 8, 9], [3, 5, 5, 5, 5]])
    want = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert torch.equal(probe_gradient.response_mask(comp, eos), want)


def _model():
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(tiny_qwen3_moe_config(12, special_ids={"pad_token_id": 0, "bos_token_id": 1,
                                                                         "eos_token_id": 2}))


def test_gradient_matches_a_row_by_row_reference():
    """The batched token-mean GRPO gradient equals sum_i A_i sum_t grad log p / N computed one row at a time."""
    model = _model()
    params = [p for p in model.parameters()]
    G = probe_gradient.GROUP
    rng = np.random.default_rng(0)
    n = 2 * G
    ids = torch.tensor(rng.integers(3, 12, size=(n, 4)))
    mask = torch.ones_like(ids)
    comp = torch.tensor(rng.integers(3, 12, size=(n, 6)))
    comp[1, 2] = 2                                     # an eos mid-row: what follows is not trained
    rewards = rng.integers(0, 2, size=n).astype(float)
    got = probe_gradient.grpo_gradient(model, params, ids, mask, comp, rewards, eos=2)
    r = rewards.reshape(-1, G)
    adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    cm = probe_gradient.response_mask(comp, 2)
    model.zero_grad()
    total = torch.zeros(())
    for i in range(n):
        L = int(cm[i].sum())
        x = torch.cat([ids[i], comp[i, :L]])[None]
        logp = torch.log_softmax(model(input_ids=x).logits[0, ids.shape[1] - 1:-1], -1)
        total = total - float(adv[i]) * logp.gather(-1, comp[i, :L, None]).sum()
    (total / cm.sum()).backward()
    want = torch.cat([p.grad.reshape(-1) for p in params])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_equal_rewards_give_no_gradient():
    model = _model()
    G = probe_gradient.GROUP
    ids = torch.full((G, 3), 4)
    comp = torch.full((G, 5), 5)
    got = probe_gradient.grpo_gradient(model, list(model.parameters()), ids, torch.ones_like(ids), comp,
                                       np.ones(G), eos=2)
    assert torch.count_nonzero(got) == 0


def test_temperature_scales_the_log_probs():
    """At temperature T the gradient is that of log softmax(logits / T): T = 2 on the model equals T = 1 on a
    model whose lm_head is halved."""
    model = _model()
    G = probe_gradient.GROUP
    rng = np.random.default_rng(1)
    ids = torch.tensor(rng.integers(3, 12, size=(G, 3)))
    comp = torch.tensor(rng.integers(3, 12, size=(G, 4)))
    rewards = np.arange(G, dtype=float) % 2
    hot = probe_gradient.grpo_gradient(model, [model.lm_head.weight], ids, torch.ones_like(ids), comp, rewards,
                                       eos=2, temperature=2.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)
    cold = probe_gradient.grpo_gradient(model, [model.lm_head.weight], ids, torch.ones_like(ids), comp, rewards,
                                        eos=2, temperature=1.0)
    # d/dW of f(W x / 2) = 1/2 f'(.) x: the halved head's gradient is twice the hot one's
    torch.testing.assert_close(hot, cold / 2, rtol=1e-4, atol=1e-7)


def test_paired_difference_of_the_sampled_accuracy_probe():
    import probe_sampled_accuracy

    x = np.array([1.0, 0.5, 0.25, 0.0])
    d, (lo, hi) = probe_sampled_accuracy.paired_difference(x, x - 0.125)
    assert d == 0.125 and lo == hi == 0.125            # a constant difference has no spread
    d, (lo, hi) = probe_sampled_accuracy.paired_difference(np.array([1.0, 0.0] * 50), np.full(100, 0.5))
    assert d == 0.0 and -0.15 < lo < 0 < hi < 0.15


@pytest.mark.parametrize("args, message", [
    (["--eta", "0,x"], "--eta must be comma-separated numbers"),
    (["--eta", "0,inf"], "--eta must be finite"),
    (["--batches", "1"], "--batches must be >= 2"),
    (["--temperature", "0"], "--temperature must be finite and > 0"),
    ([], "not an exported model folder"),
])
def test_gradient_probe_refuses_bad_input_before_loading(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        probe_gradient.main(["--warm", str(tmp_path), *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_sampled_accuracy_probe_refuses_a_folder_without_a_model(tmp_path, capsys):
    import probe_sampled_accuracy

    with pytest.raises(SystemExit) as e:
        probe_sampled_accuracy.main([str(tmp_path)])
    assert e.value.code == 2 and "not an exported model folder" in capsys.readouterr().err
