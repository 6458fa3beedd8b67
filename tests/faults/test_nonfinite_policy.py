"""Issue 31: the non-finite policy itself (offpolicy_moe/run/nonfinite.py) and real divergences, without any
injected fault: a huge learning rate (the issue's reproduction) and a diverging SFT warm start."""
import json

import pytest
import torch

from offpolicy_moe import cli
from offpolicy_moe.losses import mismatch_metrics
from offpolicy_moe.run.checkpoint import latest_checkpoint, load_checkpoint
from offpolicy_moe.losses import NonFiniteInput
from offpolicy_moe.run.nonfinite import NanCounter, NonFiniteError, nonfinite_as
from tests.tiny import TINY


def test_the_refusals_it_routes_are_recognised_by_type_not_by_message():
    # the loss library's input check raises its own type; only that type (and NonFiniteError) is converted
    nan = torch.tensor([[float("nan"), 0.0]])
    with pytest.raises(NonFiniteInput) as loss_refusal:
        mismatch_metrics(nan, torch.zeros(1, 2), torch.ones(1, 2))
    assert isinstance(loss_refusal.value, ValueError)          # callers catching ValueError still do
    with pytest.raises(NonFiniteError) as converted:
        with nonfinite_as("metrics", "log-probs"):
            mismatch_metrics(nan, torch.zeros(1, 2), torch.ones(1, 2))
    assert (converted.value.stage, converted.value.step) == ("metrics", None)
    assert str(converted.value).startswith("non-finite log-probs (train_logp contains NaN or Inf")
    # a ValueError with the same words is not a non-finite refusal: it passes unchanged
    with pytest.raises(ValueError, match="contains NaN or Inf") as other:
        with nonfinite_as("loss", "loss"):
            raise ValueError("logp contains NaN or Inf")
    assert not isinstance(other.value, NonFiniteError)
    with pytest.raises(NonFiniteError, match="stage loss"):      # a NonFiniteError keeps its own stage
        with nonfinite_as("metrics", "x"):
            raise NonFiniteError("loss", "loss")


def test_the_sampler_raises_a_nonfinite_error_only_for_nonfinite_probabilities():
    from offpolicy_moe.rollout.engine import draw
    with pytest.raises(NonFiniteError, match=r"stage generation"):
        draw(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(NonFiniteError):
        draw(torch.tensor([[float("inf"), 1.0]]))
    assert draw(torch.tensor([[float("-inf"), 0.0]])).tolist() == [1]      # a truncated token is not an error
    with pytest.raises(RuntimeError) as other:                              # a wrong shape is not a NaN
        draw(torch.zeros(2, 3, 4, 5))
    assert not isinstance(other.value, NonFiniteError)


def test_message_names_stage_step_and_iteration_on_one_line():
    err = NonFiniteError("loss", "loss", iteration=4).located(5).with_note("stopping")
    assert str(err) == "non-finite loss at step 5 (iteration 4, stage loss); stopping"
    assert "\n" not in str(err)
    with pytest.raises(ValueError, match="unknown stage 'update'"):
        NonFiniteError("update", "x")


def test_stop_raises_at_once():
    c = NanCounter("stop", 10)
    with pytest.raises(NonFiniteError, match=r"stage gradients\); the run diverged \(trainer.on_nan=stop\)"):
        c.record(NonFiniteError("gradients", "gradient norm", step=3))
    assert c.skipped == 0


def test_skip_counts_by_stage_and_stops_after_max_in_a_row():
    c = NanCounter("skip", 3)
    c.record(NonFiniteError("loss", "loss", step=1))
    c.step_done()                       # a step with a skip does not break the run of skips
    c.record(NonFiniteError("generation", "x", step=2))
    c.step_done()
    c.step_done()                       # a clean step does
    assert c.in_row == 0
    c.record(NonFiniteError("loss", "loss", step=4))
    c.record(NonFiniteError("loss", "loss", step=4))
    with pytest.raises(NonFiniteError, match=r"3 non-finite skips in a row \(trainer.max_nan_skips=3\)"):
        c.record(NonFiniteError("optimizer", "parameters", step=5))
    m = c.metrics()
    assert m["actor/nan_skipped"] == 5 == sum(v for k, v in m.items() if k.startswith("nan/"))
    assert (m["nan/loss"], m["nan/generation"], m["nan/optimizer"]) == (3, 1, 1)
    d = NanCounter("skip", 3)
    d.load_state_dict(c.state_dict())
    assert d.metrics() == m and d.in_row == c.in_row


def _train(tmp_path, *overrides, capsys):
    code = cli.main(["train", *TINY, "trainer.threads=1", "trainer.checkpoint_every=1", *overrides,
                     "--run-dir", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    return code, err, json.loads((tmp_path / "run" / "summary.json").read_text())


def test_huge_lr_stops_as_diverged_naming_the_stage(tmp_path, capsys):
    # a real divergence on the tiny job: the lr=1e15 update leaves finite but huge weights whose next forward is
    # NaN, first met by the engine's sampler; before, a RuntimeError traceback from torch.multinomial
    code, err, s = _train(tmp_path, "optim.lr=1e15", "trainer.on_nan=stop", capsys=capsys)
    lines = [x for x in err.splitlines() if ": error:" in x]
    assert (code, s["status"], s["steps"], len(lines)) == (1, "diverged", 1, 1) and "Traceback" not in err
    assert "at step 2 (iteration 1, stage generation)" in lines[0]
    assert lines[0].endswith("checkpointed in " + str(tmp_path / "run" / "checkpoints" / "step_1"))


def test_huge_lr_under_skip_ends_diverged_after_max_skips_in_a_row(tmp_path, capsys):
    # the broken weights give NaN at every generation: skipping cannot get past them
    code, err, s = _train(tmp_path, "optim.lr=1e15", "trainer.max_nan_skips=2", capsys=capsys)
    assert (code, s["status"], s["steps"]) == (1, "diverged", 1) and "Traceback" not in err
    assert "2 non-finite skips in a row (trainer.max_nan_skips=2)" in err
    assert s["final"]["actor/nan_skipped"] == 0.0      # the last logged step (1) was clean
    # the checkpoint is the boundary of step 2: the skips of that rolled-back attempt are not in it
    ck = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    assert ck.state["step"] == 1 and ck.state["nan"] == {"skipped": 0, "in_row": 0, "by_stage": ck.state["nan"]["by_stage"]}
    assert ck.state["source"]["iteration"] == 1 and not any(ck.state["nan"]["by_stage"].values())


def test_diverging_sft_warm_start_is_one_line(tmp_path, capsys):
    # before: a FloatingPointError traceback
    code, err, s = _train(tmp_path, "trainer.sft_warmup_steps=4", "trainer.sft_batch_size=8", "trainer.sft_lr=1e30",
                          capsys=capsys)
    assert (code, s["status"]) == (1, "diverged") and "Traceback" not in err
    assert "(stage sft)" in err and "no checkpoint was written" in err
