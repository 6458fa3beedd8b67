"""evaluate_greedy (batched, left-padded, KV cache) equals a per-example full-forward greedy loop."""
import pytest
import torch

from offpolicy_moe.config.schema import ModelConfig, TaskConfig
from offpolicy_moe.models import load_policy
from offpolicy_moe.tasks import compute_rewards, evaluate_greedy, greedy_completions, make_task


def reference_greedy(model, tok, prompt, max_new_tokens):
    """One prompt at a time, no padding, no cache: argmax of a full forward at every step, stop at eos."""
    ids = tok(prompt)["input_ids"]  # bos + prompt
    assert ids[0] == tok.bos_token_id
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids + new])).logits[0, -1]
            nxt = int(torch.argmax(logits))
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
    return "".join(tok.convert_ids_to_tokens(new))


@pytest.mark.parametrize("hidden,seed", [(32, 0), (32, 3)])
def test_matches_per_example_loop(hidden, seed):
    task = make_task(TaskConfig(min_digits=1, max_digits=2, num_terms=3, operators="+-", train_size=10, eval_size=12,
                                seed=seed))
    model, tok = load_policy(ModelConfig(num_layers=2, hidden_size=hidden, num_experts=4), seed=seed)
    prompts = list(task.eval_dataset["prompt"])
    assert len({len(p) for p in prompts}) > 1  # left padding really happens
    expected = [reference_greedy(model, tok, p, 4) for p in prompts]
    got = greedy_completions(model, tok, prompts, max_new_tokens=4, batch_size=5)
    assert got == expected
    metrics = evaluate_greedy(model, tok, task.eval_dataset, max_new_tokens=4, batch_size=5)
    answers = list(task.eval_dataset["answer"])
    assert metrics["eval/accuracy"] == pytest.approx(sum(compute_rewards(expected, answers, "exact")) / len(answers))
    assert metrics["eval/partial"] == pytest.approx(sum(compute_rewards(expected, answers, "partial")) / len(answers))
    assert not model.training


def test_perfect_model_scores_one():
    """A 'model' that always emits the right digits then eos scores 1.0 (checks the decode/cut path)."""
    from offpolicy_moe.tasks import build_char_tokenizer

    tok = build_char_tokenizer()
    task = make_task(TaskConfig(max_digits=1, num_terms=3, train_size=10, eval_size=6, seed=1))
    answers = dict(zip(task.eval_dataset["prompt"], task.eval_dataset["answer"]))
    model, _ = load_policy(ModelConfig(num_layers=1, hidden_size=32, num_experts=4), tokenizer=tok)

    class Oracle(torch.nn.Module):
        """Wraps generate: writes the answer + eos (+ pads), as a finished KV-cached generate would."""

        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
            rows = []
            for ids, m in zip(input_ids.tolist(), attention_mask.tolist()):
                prompt = tok.decode([i for i, k in zip(ids, m) if k], skip_special_tokens=True)
                new = tok(answers[prompt], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                rows.append(ids + (new + [tok.pad_token_id] * max_new_tokens)[:max_new_tokens])
            return torch.tensor(rows)

    assert evaluate_greedy(Oracle(), tok, task.eval_dataset, max_new_tokens=4) == {"eval/accuracy": 1.0,
                                                                                  "eval/partial": 1.0}
    del model


def test_bad_arguments():
    from offpolicy_moe.tasks import build_char_tokenizer

    with pytest.raises(ValueError):
        greedy_completions(torch.nn.Linear(1, 1), build_char_tokenizer(), ["1+1="], max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        evaluate_greedy(torch.nn.Linear(1, 1), build_char_tokenizer(), {"prompt": [], "answer": []})


def test_with_the_task_the_eval_reports_its_own_rewards():
    """eval/reward and eval/reward/<name> are the task's rewards of the very completions eval/accuracy scored."""
    task = make_task(TaskConfig(min_digits=1, max_digits=2, num_terms=2, train_size=10, eval_size=12, seed=1,
                                rewards=[{"fn": "exact", "weight": 2.0}, {"fn": "partial", "weight": 1.0}]))
    model, tok = load_policy(ModelConfig(num_layers=1, hidden_size=32, num_experts=4), seed=1)
    metrics = evaluate_greedy(model, tok, task.eval_dataset, max_new_tokens=4, task=task)
    completions = greedy_completions(model, tok, list(task.eval_dataset["prompt"]), max_new_tokens=4)
    answers = list(task.eval_dataset["answer"])
    exact, partial = compute_rewards(completions, answers, "exact"), compute_rewards(completions, answers, "partial")
    assert metrics["eval/reward/exact"] == pytest.approx(metrics["eval/accuracy"])
    assert metrics["eval/reward/partial"] == pytest.approx(sum(partial) / len(partial))
    assert metrics["eval/reward"] == pytest.approx(sum(2 * e + p for e, p in zip(exact, partial)) / len(answers))
    assert "eval/reward" not in evaluate_greedy(model, tok, task.eval_dataset, max_new_tokens=4)
