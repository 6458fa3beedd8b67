"""Sampled evaluation, as RL-for-reasoning papers report it (docs/evaluation.md): ``eval.samples`` = ``n`` responses
per held-out problem, drawn by the run's rollout engine's batched generation (``rollout.engine``: the built-in
engine or vLLM; the code path of the rollouts, so an evaluation costs what its tokens cost), scored with the task's answer check
(:func:`~offpolicy_moe.tasks.answer_check.answer_check`) into ``eval/avg@n``, ``eval/pass@k`` (the unbiased estimator
of Chen et al., 2021, https://arxiv.org/abs/2107.03374), ``eval/maj@k``, ``eval/unscorable_refs``,
``eval/no_answer`` and ``eval/scored_problems`` (:mod:`offpolicy_moe.tasks.sampled_scores`), with its own seconds in
``perf/time_eval_sampled_s`` (a part of ``perf/time_eval_s``).

The sampler is seeded by ``eval.seed`` alone, under a forked random state: the same seed and the same weights give
the same samples, so ``offpolicy-moe eval`` on a checkpoint reproduces the numbers the run logged at its step, and
the training's own random streams are left as they were.  The engine samples the policy itself: the rollout's
precision (``rollout.dtype``), sampler and ``max_new_tokens``, the ``eval`` sampling settings (else the rollout's),
no router noise or perturbation; ``trainer.eval_batch_size`` sequences per generate call (the built-in engine; vLLM
schedules its own batches).  Under vLLM each sample is its own request with its own seed, drawn from ``eval.seed``,
so there too the same seed and weights give the same samples.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Optional, Sequence

import torch

from offpolicy_moe.rollout.engine import RolloutEngine, make_engine
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.tasks.answer_check import answer_check
from offpolicy_moe.tasks.sampled_metrics import check_ks
from offpolicy_moe.tasks.sampled_scores import SampledScores, sampled_metrics, score_samples

__all__ = ["TIME_KEY", "UnscorableReferenceWarning", "SampledEvaluator", "eval_rollout", "unscorable_message"]

TIME_KEY = "perf/time_eval_sampled_s"
#: how many excluded problems the warning names
SHOWN = 5


class UnscorableReferenceWarning(UserWarning):
    """Held-out references the answer check cannot read: excluded from the sampled metrics and counted."""


def eval_rollout(cfg: Any) -> Any:
    """The ``rollout`` section the evaluation's engine is built from: the run's engine (``rollout.engine``: the
    built-in one or vLLM) with the rollout's precision, sampler and ``max_new_tokens``; ``eval.temperature`` / ``eval.top_p`` / ``eval.top_k`` where set, else
    the rollout's; no router noise or perturbation; ``trainer.eval_batch_size`` sequences per generate call."""
    ro, ev = cfg.rollout, cfg.eval
    return dataclasses.replace(
        ro, router_noise=0.0, router_perturb=0.0, batch_size=int(cfg.trainer.eval_batch_size),
        temperature=ro.temperature if ev.temperature is None else float(ev.temperature),
        top_p=ro.top_p if ev.top_p is None else float(ev.top_p),
        top_k=ro.top_k if ev.top_k is None else int(ev.top_k))


def unscorable_message(scores: SampledScores, answers: Sequence[str], check_name: str) -> str:
    """The one-line warning about the problems whose reference the check cannot read: how many, and the first
    :data:`SHOWN` problem ids (their index in the held-out split) with the first reference."""
    ids = scores.unscorable
    shown = ", ".join(str(i) for i in ids[:SHOWN]) + (", ..." if len(ids) > SHOWN else "")
    return (f"{len(ids)} of {len(answers)} held-out references cannot be read by the {check_name} answer check: "
            f"problems {shown} are excluded from eval/avg@n, eval/pass@k and eval/maj@k and counted in "
            f"eval/unscorable_refs (the first reference is {answers[ids[0]]!r})")


class SampledEvaluator:
    """``n`` samples per held-out problem from its own engine (a copy of the policy, module docstring), scored into
    the sampled metrics; warns once (:class:`UnscorableReferenceWarning`) when references cannot be scored."""

    def __init__(self, engine: RolloutEngine, *, samples: int, seed: int, ks: Optional[Sequence[int]] = None):
        self.ks = check_ks(samples, ks)
        self.engine, self.samples, self.seed = engine, int(samples), int(seed)
        self.warned = False

    @classmethod
    def build(cls, policy: torch.nn.Module, tok: Any, cfg: Any, *, device: Any = None,
              ks: Optional[Sequence[int]] = None) -> "SampledEvaluator":
        """The evaluator of config ``cfg`` (``eval.samples`` >= 1, ``eval.seed``) over a copy of ``policy`` on
        ``device``, built by the engine registry from :func:`eval_rollout`."""
        ks = check_ks(int(cfg.eval.samples), ks)         # refused before the policy is copied
        engine = make_engine(policy, tok, eval_rollout(cfg), device=device, seed=cfg.seed)
        return cls(engine, samples=cfg.eval.samples, seed=cfg.eval.seed, ks=ks)

    def completions(self, prompts: Sequence[str], answers: Sequence[str], step: Optional[int] = None) -> list[str]:
        """``n`` decoded samples per prompt, prompt ``i``'s at ``[i * n, (i + 1) * n)``, drawn with the seed alone
        (``torch.manual_seed(eval.seed)`` in the engine) under a forked random state, which is put back after.
        Non-finite sampling probabilities raise :class:`NonFiniteError` of stage ``evaluation`` (at ``step``)."""
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            try:
                batch = self.engine.generate(list(prompts), list(answers), group_size=self.samples, seed=self.seed)
            except NonFiniteError as exc:
                raise NonFiniteError("evaluation", f"{exc.what} of sampled evaluation", step=step) from exc
        return list(batch.completions)

    def evaluate(self, task: Any, *, state_dict: Optional[dict] = None, step: Optional[int] = None,
                 prefix: str = "eval/") -> dict[str, float]:
        """The sampled metrics of ``task``'s held-out split (``eval_dataset``: ``prompt``, ``answer``), after loading
        ``state_dict`` (the policy's current weights) into the engine when given; ``perf/time_eval_sampled_s``: the
        seconds of all of it."""
        t0 = time.perf_counter()
        if state_dict is not None:
            self.engine.sync(state_dict, int(step or 0))
        held_out = task.rows("eval")
        prompts, answers = held_out["prompt"], held_out["answer"]
        if not prompts:
            raise ValueError("sampled evaluation got an empty held-out split")
        check = answer_check(task)
        scores = score_samples(check, self.completions(prompts, answers, step), answers, self.samples)
        if scores.unscorable and not self.warned:
            self.warned = True
            warnings.warn(unscorable_message(scores, answers, check.name), UnscorableReferenceWarning, stacklevel=2)
        out = sampled_metrics(scores, prefix=prefix, ks=self.ks, seed=self.seed)
        out[TIME_KEY] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        """Stop what the engine started (the built-in engine starts nothing)."""
        self.engine.close()
