"""A stand-in for `offpolicy-moe train` that logs what the trainer logs at an evaluation, through the project's own
writers: `fake_sampled_train.py CONFIG run_dir=DIR`.

The run folder is opened with :class:`~offpolicy_moe.run.run_dir.RunDir`, its rows go through
:class:`~offpolicy_moe.run.loggers.JsonlLogger` and its ``summary.json`` through ``RunDir.write_summary`` (status and
``final`` as the trainer writes them).  Two steps; evaluations at steps 0 and 2 of two held-out problems
(references ``7`` and ``12``): greedy ``eval/accuracy`` from :data:`GREEDY`, and with ``eval.samples`` = n > 0 the
sampled metrics of :func:`~offpolicy_moe.tasks.sampled_scores.sampled_metrics` over n completions per problem, of
which the first c are the reference and the rest ``0`` (c from :data:`CORRECT` at step 2, none at step 0).
"""
import sys
from pathlib import Path

import yaml

from offpolicy_moe.run.loggers import JsonlLogger
from offpolicy_moe.run.run_dir import RunDir
from offpolicy_moe.tasks.answer_check import ExactCheck
from offpolicy_moe.tasks.sampled_scores import sampled_metrics, score_samples

REFS = ("7", "12")
#: (algo.loss.name, seed) -> correct samples of each problem at the last evaluation
CORRECT = {("grpo", 0): (1, 0), ("grpo", 1): (2, 0), ("m2po", 0): (3, 1), ("m2po", 1): (4, 2)}
#: (algo.loss.name, seed) -> greedy eval/accuracy at the last evaluation (0 at step 0)
GREEDY = {("grpo", 0): 0.5, ("grpo", 1): 0.5, ("m2po", 0): 0.5, ("m2po", 1): 1.0}


def evaluation(key: tuple, n: int, last: bool) -> dict:
    """The metrics of one evaluation: greedy accuracy, and the sampled metrics when ``n`` > 0."""
    out = {"eval/accuracy": GREEDY[key] if last else 0.0}
    if n > 0:
        correct = CORRECT[key] if last else (0, 0)
        completions = [c for ref, k in zip(REFS, correct) for c in [ref] * k + ["0"] * (n - k)]
        out.update(sampled_metrics(score_samples(ExactCheck(), completions, list(REFS), n)))
    return out


def main() -> None:
    """Train nothing: write the run folder of `fake_sampled_train.py CONFIG run_dir=DIR` (module docstring)."""
    cfg_path, run_arg = sys.argv[1], sys.argv[2]
    cfg = yaml.safe_load(Path(cfg_path).read_text())
    key = (cfg["algo"]["loss"]["name"], cfg["seed"])
    n = int((cfg.get("eval") or {}).get("samples") or 0)
    run_dir = RunDir(run_arg[len("run_dir="):], min_free_mb=0, resume=False)
    log = JsonlLogger(run_dir.path)
    last: dict = {}
    for step in range(3):
        row = {"reward/mean": 0.1 * step} if step else {}
        if step in (0, 2):
            row.update(evaluation(key, n, step == 2))
        log.log(step, row)
        last.update(row)
    log.close()
    run_dir.write_summary({"status": "completed", "steps": 2, "final": last})
    run_dir.close()


if __name__ == "__main__":
    main()
