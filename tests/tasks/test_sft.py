"""SFT warm start: answer-only loss mask, loss decreases, determinism."""
import pytest
import torch

from offpolicy_moe.config.schema import ModelConfig, TaskConfig
from offpolicy_moe.trainer.sft import answer_nll, build_sft_batch, sft_warm_start
from offpolicy_moe.models import load_policy
from offpolicy_moe.tasks import make_task

TINY = ModelConfig(num_layers=1, hidden_size=32, num_experts=4)


def test_batch_layout():
    ids, attn, mask = build_sft_batch([[1, 4, 13, 5, 16]], [[7, 2]], pad_id=0)
    assert ids.tolist() == [[1, 4, 13, 5, 16, 7, 2]]
    ids, attn, mask = build_sft_batch([[1, 4, 16], [1, 4, 13, 5, 16]], [[5, 2], [6, 6, 2]], pad_id=0)
    assert ids.tolist() == [[1, 4, 16, 5, 2, 0, 0, 0], [1, 4, 13, 5, 16, 6, 6, 2]]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1] * 8]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 1, 1]]


def test_answer_nll_matches_loop_reference():
    model, _ = load_policy(TINY, seed=0)
    ids, attn, mask = build_sft_batch([[1, 4, 16], [1, 4, 13, 5, 16]], [[5, 2], [6, 6, 2]], pad_id=0)
    with torch.no_grad():
        got = answer_nll(model, ids, attn, mask)
        total, count = 0.0, 0
        for seq, n_prompt in (([1, 4, 16, 5, 2], 3), ([1, 4, 13, 5, 16, 6, 6, 2], 5)):
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            for t in range(n_prompt, len(seq)):
                total -= float(logp[t - 1, seq[t]])
                count += 1
    assert float(got) == pytest.approx(total / count, rel=1e-5)


def test_loss_decreases_and_is_deterministic():
    task = make_task(TaskConfig(max_digits=1, num_terms=2, train_size=64, eval_size=8))
    runs = []
    for _ in range(2):
        model, tok = load_policy(TINY, seed=0)
        m = sft_warm_start(model, tok, task, steps=12, lr=1e-2, batch_size=16, seed=3)
        runs.append((m, model.state_dict()))
    (m, sd), (m2, sd2) = runs
    hist = m["sft/loss_history"]
    assert len(hist) == 12 and m["sft/loss"] == hist[-1]
    assert sum(hist[-3:]) / 3 < 0.7 * sum(hist[:3]) / 3
    assert hist == m2["sft/loss_history"]
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_zero_steps_and_bad_arguments():
    task = make_task(TaskConfig(max_digits=1, train_size=8, eval_size=4))
    model, tok = load_policy(TINY, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert sft_warm_start(model, tok, task, steps=0)["sft/steps"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError):
        sft_warm_start(model, tok, task, steps=-1)
    with pytest.raises(ValueError):
        sft_warm_start(model, tok, task, steps=1, batch_size=0)


def test_lr_schedule():
    from offpolicy_moe.trainer.sft import lr_factor

    assert lr_factor(0, 10, "constant") == lr_factor(9, 10, "constant") == 1.0
    assert lr_factor(0, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(5, 10, "cosine") == pytest.approx(0.55)
    assert lr_factor(10, 10, "cosine") == pytest.approx(0.1)
    vals = [lr_factor(s, 10, "cosine") for s in range(10)]
    assert vals == sorted(vals, reverse=True)
    with pytest.raises(ValueError, match="schedule"):
        lr_factor(0, 10, "step")


def test_the_warm_start_trains_on_the_tasks_demonstrations_not_its_split():
    """A task whose teacher answers differently (longtail's estimates) is learned from those answers: the SFT loss
    history equals that of a task whose training split holds the demonstrations themselves."""
    from datasets import Dataset

    class Taught:
        def __init__(self, prompts, answers, demos):
            self.train_dataset = Dataset.from_dict({"prompt": prompts, "answer": answers})
            self.demonstrations = Dataset.from_dict({"prompt": prompts, "answer": demos})

    base = make_task(TaskConfig(name="longtail", train_size=32, eval_size=8, estimate_share=0.5))
    prompts, answers = base.train_prompts, base.train_answers
    demos = list(base.demonstrations["answer"])
    assert demos != answers
    runs = []
    for task in (Taught(prompts, answers, demos), Taught(prompts, demos, demos), Taught(prompts, answers, answers)):
        model, tok = load_policy(TINY, seed=0)
        runs.append(sft_warm_start(model, tok, task, steps=3, lr=1e-2, batch_size=8, seed=1)["sft/loss_history"])
    assert runs[0] == runs[1] and runs[0] != runs[2]
