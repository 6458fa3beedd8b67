"""experiments/bench/bench_tta.py ``--metric`` with a sampled metric (eval/avg@n, eval/pass@k, eval/maj@k): every arm,
TRL's too, samples the held-out problems (``eval.samples`` = ``--eval-samples``), the target is set and reached in
that metric, and the last line keeps its form; bad combinations are one line before any run."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "bench"))

import bench_tta  # noqa: E402
from tta.analysis import parse_arms  # noqa: E402
from tta.clock import Watched  # noqa: E402

from offpolicy_moe.config.load import load_config  # noqa: E402
from offpolicy_moe.run.loggers import JsonlLogger  # noqa: E402
from offpolicy_moe.tasks.answer_check import ExactCheck  # noqa: E402
from offpolicy_moe.tasks.sampled_scores import sampled_metrics, score_samples  # noqa: E402

ARGV = ["--arms", "trl,sync,async-k1-grpo", "--headline", "async-k1-grpo"]
REFS = ["3", "5", "8", "13", "21"]
# eval steps -> (greedy eval/accuracy, correct samples of 4 per problem): avg@4 = correct / 20
EVALS = {0: (0.3, (2, 0, 0, 0, 0)), 2: (0.6, (4, 0, 0, 0, 0)), 4: (0.6, (4, 4, 0, 0, 0))}
# the loop clock (perf/elapsed_s) at steps 1..4 and the evaluations' seconds
ELAPSED = {1: 5.0, 2: 6.5, 3: 7.5, 4: 9.0}
EVAL_S = {0: 1.0, 2: 0.5, 4: 0.5}


def _rows(path: Path, factor: float = 1.0, sampled: bool = True) -> list[dict]:
    """Metric rows as the trainer writes them (JsonlLogger), the evaluations' sampled metrics from the real scorer
    over 4 samples of the 5 problems of :data:`REFS` (the first c of each right, the rest ``0``); clock times
    scaled by ``factor``."""
    log = JsonlLogger(path.parent, path.name)
    for step in range(5):
        row = {"perf/elapsed_s": ELAPSED[step] * factor, "perf/time_step_s": 1.0} if step else {}
        if step in EVALS:
            acc, correct = EVALS[step]
            row.update({"eval/accuracy": acc, "perf/time_eval_s": EVAL_S[step] * factor})
            if sampled:
                completions = [c for ref, k in zip(REFS, correct) for c in [ref] * k + ["0"] * (4 - k)]
                row.update(sampled_metrics(score_samples(ExactCheck(), completions, REFS, 4)))
        log.log(step, row)
    log.close()
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_sampled_metric_gives_every_arm_its_samples_and_none_to_the_warm_start(monkeypatch, tmp_path):
    args = bench_tta.parse_args([*ARGV, "--metric", "eval/avg@4"])
    assert args.eval_samples == 4
    overrides = bench_tta.job_overrides(args, 3, "warm")
    assert overrides[-1] == "eval.samples=4" and load_config(None, overrides).eval.samples == 4
    calls = []
    monkeypatch.setattr(bench_tta, "_call", lambda cmd, what: calls.append(cmd) or 1.0)
    bench_tta.warm_start(args, 3, tmp_path)
    assert calls and not [w for cmd in calls for w in cmd if w.startswith("eval.samples")]
    assert bench_tta.parse_args([*ARGV, "--metric", "eval/pass@4", "--eval-samples", "16"]).eval_samples == 16
    plain = bench_tta.parse_args(ARGV)
    assert (plain.metric, plain.eval_samples) == ("eval/accuracy", None)
    assert not [o for o in bench_tta.job_overrides(plain, 3, "warm") if o.startswith("eval.")]


def _fake_watch(calls: list, sampled: bool = True):
    """``watch`` that records the command and its eval key and writes the rows of :func:`_rows`."""
    def watch(cmd, metrics, *, env, log, eval_key):
        calls.append((cmd, eval_key))
        rows = _rows(metrics, sampled=sampled)
        seen = {r["step"]: 2.0 + r.get("perf/elapsed_s", 0.0) for r in rows}
        return Watched(wall_s=12.0, cpu_total_s=12.0, seen_s=seen, cpu_s={s: 1.0 for s in EVALS})
    return watch


def test_every_arm_runs_with_the_samples_and_its_curve_is_the_sampled_metric(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(bench_tta, "watch", _fake_watch(calls))
    args = bench_tta.parse_args([*ARGV, "--metric", "eval/avg@4", "--steps", "4", "--eval-every", "2"])
    for arm in parse_arms("trl,sync"):
        r = bench_tta.run_arm(args, arm, 0, "warm", tmp_path)
        assert r["curve"]["steps"] == [0, 2, 4]
        assert r["curve"]["accuracy"] == [0.1, 0.2, 0.4]           # avg@4 = correct samples / 20, not accuracy
    (trl_cmd, trl_key), (ours_cmd, ours_key) = calls
    assert trl_key == ours_key == "eval/avg@4"
    assert "eval.samples=4" in trl_cmd[trl_cmd.index("--"):]         # the TRL child's config samples too
    assert "eval.samples=4" in ours_cmd


def test_a_run_that_did_not_log_the_metric_is_one_line_naming_what_it_logged(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_tta, "watch", _fake_watch([], sampled=False))
    args = bench_tta.parse_args([*ARGV, "--metric", "eval/maj@4", "--eval-samples", "4", "--steps", "4",
                                 "--eval-every", "2"])
    with pytest.raises(RuntimeError) as e:
        bench_tta.run_arm(args, parse_arms("sync")[0], 0, "warm", tmp_path)
    assert str(e.value) == ("arm sync seed 0 logged no eval/maj@4 (the runs log eval/accuracy; 5 metrics in all)")


def _record(metric: str, factors: dict[str, float], tmp_path: Path) -> dict:
    """A runs.json record: one seed per arm, its rows :func:`_rows` on a clock scaled by the arm's factor, launched
    2 s before its loop; the curves of ``metric``."""
    from tta.analysis import Curve, curve
    from tta.clock import eval_seconds, process_curve

    runs = []
    for arm, f in factors.items():
        rows = _rows(tmp_path / f"{arm}.jsonl", f)
        c = curve(rows, metric)
        seen = {r["step"]: 2.0 + r.get("perf/elapsed_s", 0.0) for r in rows}
        pc = process_curve(c.steps, eval_seconds(rows), seen, {s: 1.0 for s in EVALS}, seen[4] + 1, 20.0)
        runs.append({"arm": arm, "seed": 0, "curve": Curve(**{**c.__dict__, **pc}).__dict__, "startup_s": 2.0,
                     "s_per_step": 0.1, "load_after": [1.0, 1.0, 1.0], "threads": 1})
    return {"date": "d", "command": "c", "arms": list(factors), "metric": metric, "wall_s": 1.0,
            "load_start": [1, 1, 1], "load_end": [1, 1, 1], "warm_start_s": {"0": 1.0}, "runs": runs}


def test_the_target_rule_and_the_time_to_it_use_the_sampled_metric(tmp_path, capsys):
    """sync's final avg@4 is 0.4: target 0.37, first met at step 4 (greedy accuracy would meet its own target, 0.57,
    at step 2); from process start the step-4 row is seen at 2 + 9f s, its 0.5f s evaluation not charged."""
    factors = {"trl": 2.0, "sync": 1.0, "async-k1-grpo": 0.5}
    bench_tta.report(_record("eval/avg@4", factors, tmp_path), None, tmp_path / "o", headline="async-k1-grpo")
    out = json.loads((tmp_path / "o" / "runs.json").read_text())
    assert out["target"] == pytest.approx(0.4 - 0.03)
    tta = {a: 2.0 + 8.5 * f for a, f in factors.items()}
    s = out["summary"]
    assert {a: s[a]["median_tta_process_s"] for a in factors} == pytest.approx(tta)
    assert s["async-k1-grpo"]["vs_trl_process"]["estimate"] == pytest.approx(tta["trl"] / tta["async-k1-grpo"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (f"time to accuracy (from process start): async-k1-grpo {tta['trl'] / tta['async-k1-grpo']:.2f}x "
                    f"TRL, {tta['sync'] / tta['async-k1-grpo']:.2f}x ours sync")
    table = (tmp_path / "o" / "table.md").read_text()
    assert "accuracy `eval/avg@4`" in table and table.strip().splitlines()[-1] == last
    greedy = _record("eval/accuracy", factors, tmp_path)
    bench_tta.report(greedy, None, tmp_path / "g", headline="async-k1-grpo")
    assert json.loads((tmp_path / "g" / "runs.json").read_text())["summary"]["sync"]["median_tta_process_s"] == \
        pytest.approx(2.0 + 6.0)                                      # step 2: stamp 8.5, its 0.5 s eval


@pytest.mark.parametrize("extra, says", [
    (["--metric", "eval/pass@4"], "--metric eval/pass@4 needs --eval-samples N: the samples per held-out problem it "
                                  "is estimated from (N >= 4)"),
    (["--metric", "eval/maj@3", "--eval-samples", "16"], "--metric eval/maj@3 is not logged with --eval-samples 16: "
                                                         "it needs --eval-samples = 3"),
    (["--metric", "eval/avg@4", "--eval-samples", "8"], "--metric eval/avg@4 is not logged with --eval-samples 8: it "
                                                        "needs --eval-samples = 4"),
    (["--metric", "eval/pass@8", "--eval-samples", "4"], "--metric eval/pass@8 is not logged with --eval-samples 4: "
                                                         "it needs --eval-samples >= 8"),
    (["--eval-samples", "8"], "--eval-samples is for a sampled --metric (eval/avg@N, eval/pass@K, eval/maj@K), not "
                              "eval/accuracy"),
    (["--metric", "eval/avg@4", "--set", "eval.samples=8"], "--set eval.samples=...: give the samples with "
                                                           "--eval-samples (TRL's arm samples them too)"),
])
def test_bad_sampled_metric_options_are_one_line(extra, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench_tta.parse_args([*ARGV, *extra])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].split(": error: ", 1)[1] == says


def test_reanalyse_refuses_a_metric_the_record_has_no_curves_of(tmp_path, capsys):
    src = tmp_path / "runs.json"
    src.write_text(json.dumps(_record("eval/accuracy", {"sync": 1.0}, tmp_path)))
    with pytest.raises(SystemExit):
        bench_tta.parse_args(["--reanalyse", str(src), "--metric", "eval/avg@4"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r".*: error: --metric eval/avg@4: .*runs\.json holds the curves of eval/accuracy "
                        r"only; a new run measures another metric", err)
    assert bench_tta.parse_args(["--reanalyse", str(src), "--metric", "eval/accuracy"]).metric == "eval/accuracy"


def test_the_trl_arm_samples_its_current_weights_as_our_trainer_does():
    """The TRL arm's evaluation with ``eval.samples`` gives our trainer's sampled metrics for the same weights: the
    evaluators are built, then the policy's weights change (as training changes them), and both evaluate after."""
    from tta import trl_arm

    from offpolicy_moe.models import load_policy
    from offpolicy_moe.tasks import make_task
    from offpolicy_moe.trainer.evaluation import evaluate_policy
    from offpolicy_moe.trainer.sampled_eval import SampledEvaluator

    cfg = load_config(None, ["task.eval_size=8", "eval.samples=4", "rollout.max_new_tokens=3", "rollout.dtype=float32",
                             "trainer.sft_warmup_steps=0"])
    task = make_task(cfg.task)
    model, tok = load_policy(cfg.model, seed=0, task=task)
    model = model.float()
    ours_eval, trl_eval = (SampledEvaluator.build(model, tok, cfg) for _ in range(2))
    before = trl_eval.evaluate(task)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.5)
    ours = evaluate_policy(model, tok, task, cfg, 3, sampled=ours_eval)
    trl = trl_arm.evaluate(model, tok, task, cfg.rollout.max_new_tokens, cfg.trainer.eval_batch_size, trl_eval, 3)
    keys = [k for k in ours if k.startswith("eval/") and "@" in k]
    assert "eval/avg@4" in keys and "eval/pass@4" in keys and "eval/maj@4" in keys
    assert {k: trl[k] for k in keys} == {k: ours[k] for k in keys}
    assert trl["eval/accuracy"] == ours["eval/accuracy"]
    # the perturbed weights sample differently from the ones the engine was built with
    assert any(before[k] != trl[k] for k in keys) or before["eval/no_answer"] != trl["eval/no_answer"]


def test_trl_options_are_grpo_config_fields_read_as_yaml():
    """``--trl-option KEY=VALUE``: GRPOConfig fields with YAML values; a word without ``=`` or a field GRPOConfig
    does not have is one line."""
    assert bench_tta.trl_options([]) == {}
    assert bench_tta.trl_options(["torch_compile=true", "use_transformers_continuous_batching=false"]) == {
        "torch_compile": True, "use_transformers_continuous_batching": False}
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        bench_tta.trl_options(["torch_compile"])
    with pytest.raises(ValueError, match="GRPOConfig has no field 'nope'"):
        bench_tta.trl_options(["nope=1"])
