"""Issue 31: a NaN at any stage of a step is handled by ``trainer.on_nan``, through the CLI, with no traceback.

Each case injects NaN at one stage of step 2 of a 3-step tiny run (tests/faults/harness.py, the test-only hook
offpolicy_moe/run/fault_injection.py) and checks, for ``stop``: exit code 1, status ``diverged``, one error line
naming the stage and step 2, a checkpoint of step 1 with finite weights, and ``--resume`` finishing the run; for
``skip``: exit 0, three steps, the skip counted in ``actor/nan_skipped`` and ``nan/<stage>``, finite weights.
Before this issue every stage but the update's ended in a traceback (or silently, for evaluation)."""
import json

import pytest

from tests.faults.harness import problems, run_case

SYNC_STAGES = ["generation", "old_logp", "metrics", "reference", "loss", "gradients", "optimizer", "evaluation"]


@pytest.mark.parametrize("stage", SYNC_STAGES)
def test_stop_checkpoints_the_last_finite_state_and_resumes(stage, tmp_path):
    out = run_case(stage, "stop", tmp_path / "run")
    assert problems(out) == []
    assert out.error_lines[0].startswith("offpolicy-moe train: error: non-finite ")


@pytest.mark.parametrize("stage", SYNC_STAGES)
def test_skip_drops_counts_and_goes_on(stage, tmp_path):
    out = run_case(stage, "skip", tmp_path / "run")
    assert problems(out) == []
    rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    # counted once, at the step it happened in (evaluation: the step is undone, its eval/* missing)
    assert [r["nan/" + stage] for r in rows[1:]] == [0.0, 1.0, 1.0]
    assert [r["actor/nan_skipped"] for r in rows[1:]] == [0.0, 1.0, 1.0]


def test_async_worker_reports_nan_sampling_and_keeps_serving(tmp_path):
    out = run_case("generation/async", "skip", tmp_path / "run")
    assert problems(out) == []
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["final"]["async/worker_restarts"] == 0.0      # reported, not a crash


@pytest.mark.slow
@pytest.mark.parametrize("case,policy", [("generation/async", "stop"), ("old_logp/async", "stop"),
                                         ("old_logp/async", "skip")])
def test_async_stages(case, policy, tmp_path):
    assert problems(run_case(case, policy, tmp_path / "run")) == []


@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_stream_batch_whose_old_log_probs_are_not_finite_is_generated_again_or_stops_the_run(policy, tmp_path):
    """The step's groups are not trained: under skip they are issued again (same seeds) and the step is asked for
    again; under stop the run checkpoints and stops, and --resume completes it."""
    assert problems(run_case("old_logp/stream", policy, tmp_path / "run")) == []
