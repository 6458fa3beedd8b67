"""Sampled evaluation (eval.samples): seeded samples from the engine's batched sampler, scored as the task scores
them, the unscorable references warned about once, the training's random streams and results untouched, and its
seconds a part of perf/time_eval_s."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from offpolicy_moe.config.load import load_config
from offpolicy_moe.config.validate import validate
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.tasks import clean_completion, make_task
from offpolicy_moe.tasks.answer_check import ExactCheck
from offpolicy_moe.tasks.sampled_metrics import pass_at_k
from offpolicy_moe.tasks.sampled_scores import sampled_metrics, score_samples
from offpolicy_moe.trainer.sampled_eval import TIME_KEY, SampledEvaluator, UnscorableReferenceWarning, eval_rollout
from offpolicy_moe.trainer.step_metrics import STEP_PARTS
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import TINY, tiny_policy


class HeldOut:
    """A task stand-in: a held-out split of given rows, no rewards (exact-match check)."""

    def __init__(self, prompts, answers):
        self.eval_prompts, self.eval_answers = list(prompts), list(answers)

    def rows(self, split):
        assert split == "eval"
        return {"prompt": list(self.eval_prompts), "answer": list(self.eval_answers)}


@pytest.fixture(scope="module")
def policy():
    task = make_task(load_config(None, TINY).task)
    model, tok = tiny_policy(seed=1, task=task)
    return model, tok, task


def _evaluator(policy, *overrides, ks=None):
    model, tok, _ = policy
    cfg = load_config(None, TINY + ["eval.samples=4", *overrides])
    return SampledEvaluator.build(model, tok, cfg, ks=ks), cfg


def test_the_eval_section_defaults_to_off_and_its_keys_need_samples():
    cfg = load_config(None, [])
    assert cfg.eval.samples == 0 and cfg.eval.temperature is None and cfg.eval.seed == 0
    assert any(w.startswith("eval.temperature=0.5 has no effect with eval.samples=0")
               for w in validate(load_config(None, ["eval.temperature=0.5"])))
    assert not validate(load_config(None, ["eval.samples=4", "eval.temperature=0.5"]))


def test_the_engine_samples_the_policy_with_the_eval_settings():
    cfg = load_config(None, ["rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.router_noise=0.5",
                             "rollout.router_perturb=0.1", "rollout.engine=hf", "trainer.eval_batch_size=32",
                             "eval.samples=2", "eval.top_p=0.5"])
    ro = eval_rollout(cfg)
    assert (ro.engine, ro.temperature, ro.top_p, ro.top_k, ro.batch_size) == ("hf", 0.7, 0.5, 0, 32)
    assert ro.router_noise == 0.0 and ro.router_perturb == 0.0 and ro.dtype == cfg.rollout.dtype
    assert cfg.rollout.top_p == 0.9      # the run's own section is left as it was


def test_same_seed_same_samples_other_seed_other_samples_and_the_global_rng_untouched(policy):
    _, _, task = policy
    prompts, answers = task.eval_prompts, task.eval_answers
    ev, _ = _evaluator(policy)
    torch.manual_seed(123)
    first = ev.completions(prompts, answers)
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)            # the sampler's seeding did not move the caller's stream
    assert ev.completions(prompts, answers) == first and len(first) == 4 * len(prompts)
    other, _ = _evaluator(policy, "eval.seed=1")
    assert other.completions(prompts, answers) != first


def test_metrics_are_the_scores_of_the_samples(policy):
    """Recomputed from the completions by hand: pass@k and avg@n of exact matches, answerless responses counted.
    The samples depend on the prompts and the seed only, so references taken from them make some samples right."""
    _, _, task = policy
    ev, _ = _evaluator(policy, "eval.temperature=3.0")
    prompts, n, m = task.eval_prompts, 4, len(task.eval_prompts)
    completions = ev.completions(prompts, task.eval_answers)
    refs = [clean_completion(completions[i * n + 1]) or a for i, a in enumerate(task.eval_answers)]
    right = [[clean_completion(c) == a for c in completions[i * n:(i + 1) * n]] for i, a in enumerate(refs)]
    out = ev.evaluate(HeldOut(prompts, refs))
    assert 0 < out["eval/avg@4"] < out["eval/pass@2"] < out["eval/pass@4"] <= 1
    assert out["eval/avg@4"] == out["eval/pass@1"] == sum(sum(r) / n for r in right) / m
    assert out["eval/pass@2"] == sum(pass_at_k(n, sum(r), 2) for r in right) / m
    assert out["eval/no_answer"] == sum(clean_completion(c) == "" for c in completions)
    assert out["eval/scored_problems"] == m and out["eval/unscorable_refs"] == 0
    assert sorted(k for k in out if k.startswith("eval/pass@")) == ["eval/pass@1", "eval/pass@2", "eval/pass@4"]
    assert out[TIME_KEY] > 0


def test_unscorable_references_are_excluded_counted_and_warned_about_once(policy):
    _, _, task = policy
    prompts, bad = task.eval_prompts[:6], list(task.eval_answers[:6])
    bad[1], bad[3] = "", "   "
    ev, _ = _evaluator(policy, "eval.temperature=3.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ev.evaluate(HeldOut(prompts, bad))
        again = ev.evaluate(HeldOut(prompts, bad))
    said = [w for w in caught if issubclass(w.category, UnscorableReferenceWarning)]
    assert len(said) == 1 and "2 of 6 held-out references" in str(said[0].message)
    assert "problems 1, 3 are excluded" in str(said[0].message)
    expected = sampled_metrics(score_samples(ExactCheck(), ev.completions(prompts, bad), bad, 4))
    first.pop(TIME_KEY), again.pop(TIME_KEY)
    assert first == again == expected
    assert first["eval/unscorable_refs"] == 2 and first["eval/scored_problems"] == 4


def test_non_finite_sampling_is_an_evaluation_error(policy):
    _, _, task = policy
    ev, _ = _evaluator(policy)
    model = policy[0]
    state = {k: (torch.full_like(v, float("nan")) if v.is_floating_point() else v)
             for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteError) as err:
        ev.evaluate(task, state_dict=state, step=3)
    assert err.value.stage == "evaluation" and err.value.step == 3 and "sampled evaluation" in str(err.value)


def test_k_above_n_and_n_below_one_are_refused(policy):
    with pytest.raises(ValueError, match=r"k=8 with n=4"):
        _evaluator(policy, ks=[1, 8])
    model, tok, _ = policy
    with pytest.raises(ValueError, match=r"n >= 1"):
        SampledEvaluator.build(model, tok, load_config(None, TINY))


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_in_training_it_changes_nothing_else_and_its_time_is_inside_the_eval_time(make_cfg):
    """The same run with and without sampled evaluation trains the same weights and logs the same training
    metrics; the sampled seconds are a part of perf/time_eval_s, and the step's parts still make the step."""
    runs = {}
    for samples in (0, 3):
        cfg = make_cfg("trainer.steps=2", "trainer.eval_every=1", f"eval.samples={samples}")
        tr = Trainer(cfg)
        tr.run()
        runs[samples] = (_rows(Path(cfg.run_dir)), {k: v.clone() for k, v in tr.unwrapped.state_dict().items()})
    (plain, w0), (sampled, w3) = runs[0], runs[3]
    assert all(torch.equal(w0[k], w3[k]) for k in w0)
    keep = [{k: v for k, v in r.items() if not k.startswith(("perf/", "eval/"))} for r in sampled]
    assert keep == [{k: v for k, v in r.items() if not k.startswith(("perf/", "eval/"))} for r in plain]
    assert [r.get("eval/accuracy") for r in sampled] == [r.get("eval/accuracy") for r in plain]
    for r in sampled:
        assert "eval/pass@3" in r and "eval/maj@3" in r and "eval/avg@3" in r
        assert 0 < r[TIME_KEY] <= r["perf/time_eval_s"]
    for r in sampled[1:]:
        parts = [r[k] for k in STEP_PARTS if k in r] + [r["perf/time_other_s"]]
        assert sum(parts) == pytest.approx(r["perf/time_step_s"], rel=1e-12, abs=1e-12)
    assert not any(k.startswith(("eval/pass@", "eval/avg@")) or k == TIME_KEY for r in plain for k in r)
