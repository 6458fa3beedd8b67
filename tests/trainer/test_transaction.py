"""The step as a transaction owned by the loop (trainer/transaction.py), the update that only raises, and the
checkpoint collected by part name (trainer/run_checkpoints.py), including a checkpoint in the layout written
before the parts had names."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from offpolicy_moe.run import fault_injection
from offpolicy_moe.run.checkpoint import load_checkpoint, rng_state, save_checkpoint
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.trainer.run_checkpoints import FORMAT, model_signature
from offpolicy_moe.trainer.trainer import Trainer
from offpolicy_moe.trainer.transaction import StepTransaction
from tests.tiny import tiny_config


class Counter:
    """A named part: one integer with ``state_dict`` / ``load_state_dict``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])


def _policy(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train_step(model, opt, sched) -> None:
    model(torch.randn(3, 4)).pow(2).sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _state(model, opt, sched) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                          "lrs": [g["lr"] for g in opt.param_groups]})


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_stop_rollback_restores_weights_optimizer_scheduler_parts_and_rng_exactly():
    model, opt, sched = _policy()
    _train_step(model, opt, sched)                  # optimizer state exists before the step
    part = Counter()
    txn = StepTransaction(opt, sched, {"part": part}, on_nan="stop")
    txn.begin()
    before, draw = _state(model, opt, sched), torch.rand(3)
    torch.manual_seed(123)                          # the step moves the RNG on ...
    txn.begin_update(keep_start=False, updates_per_step=2)
    for _ in range(2):
        txn.begin_optimizer_update()
        _train_step(model, opt, sched)
        txn.commit_optimizer_update()
    part.n = 7
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))   # ... and diverges
    txn.rollback()
    _assert_same(_state(model, opt, sched), before)
    assert part.n == 0
    assert torch.equal(torch.rand(3), draw)         # the RNG is the boundary's again: the same first draw


def test_skip_rolls_back_one_optimizer_update_and_the_update_for_evaluation():
    model, opt, sched = _policy()
    txn = StepTransaction(opt, sched, {}, on_nan="skip")
    txn.begin()
    txn.begin_update(keep_start=True, updates_per_step=2)
    start = _state(model, opt, sched)
    txn.begin_optimizer_update()
    _train_step(model, opt, sched)
    txn.commit_optimizer_update()
    after_first = _state(model, opt, sched)
    txn.begin_optimizer_update()
    _train_step(model, opt, sched)
    with torch.no_grad():
        next(model.parameters()).fill_(float("inf"))
    txn.rollback_optimizer_update()                 # only the second update is undone
    _assert_same(_state(model, opt, sched), after_first)
    assert txn.rollback_update()                    # a non-finite evaluation: back to the start of the update
    _assert_same(_state(model, opt, sched), start)


def test_rollback_update_without_an_applied_update_changes_nothing():
    model, opt, sched = _policy()
    txn = StepTransaction(opt, sched, {}, on_nan="skip")
    txn.begin()
    txn.begin_update(keep_start=True, updates_per_step=1)
    assert txn.rollback_update() is False


# ------------------------------------------------------------------------------------------ on a real trainer
@pytest.fixture
def trainer(request, tmp_path):
    overrides = getattr(request, "param", ())
    tr = Trainer(tiny_config(tmp_path / "run", "trainer.threads=1", *overrides))
    yield tr
    fault_injection.disarm()
    tr.source.close()
    tr.run_dir.close()


def _weights(tr) -> dict:
    return {k: v.clone() for k, v in tr.unwrapped.state_dict().items()}


@pytest.mark.parametrize("stage", ["loss", "gradients", "optimizer"])
def test_the_update_raises_and_never_applies_the_policy(trainer, stage):
    tr, pu = trainer, trainer.policy_update
    assert not hasattr(pu, "nan") and not hasattr(pu.finite, "nan")     # the counter is the loop's alone
    batch = tr.source.next(0)[0].batch
    work = pu.prepare(pu.start(batch, step=0, iteration=tr.iteration))
    fault_injection.arm(stage, 1)
    with pytest.raises(NonFiniteError, match=f"stage {stage}"):
        pu.optimizer_update(work, 0)
    assert tr.nan.skipped == 0 and pu.updates == 0      # nobody counted it: the update only raised


@pytest.mark.parametrize("stage", ["loss", "gradients", "optimizer"])
def test_the_loop_skips_a_nonfinite_optimizer_update_with_the_weights_rolled_back(trainer, stage):
    tr = trainer
    batch = tr.source.next(0)[0].batch
    before = _weights(tr)
    tr.transaction.begin()
    fault_injection.arm(stage, 1)
    m = tr.update(batch)
    tr.transaction.commit()
    _assert_same(_weights(tr), before)
    assert (m[f"nan/{stage}"], m["actor/nan_skipped"], m["actor/updates"]) == (1.0, 1.0, 0.0)
    assert all(torch.isfinite(v).all() for v in _weights(tr).values())


@pytest.mark.parametrize("trainer", [("trainer.updates_per_step=2",)], indirect=True)
def test_skip_drops_only_the_nonfinite_optimizer_update_of_a_step(trainer):
    # the first of two optimizer updates leaves NaN parameters: it alone is rolled back, the second one applies
    tr = trainer
    batch = tr.source.next(0)[0].batch
    before = _weights(tr)
    tr.transaction.begin()
    fault_injection.arm("optimizer", 1, times=1)
    m = tr.update(batch)
    tr.transaction.commit()
    after = _weights(tr)
    assert (m["nan/optimizer"], m["actor/updates"]) == (1.0, 1.0)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("trainer", [("trainer.on_nan=stop",)], indirect=True)
def test_under_stop_the_error_reaches_the_loop_which_rolls_the_step_back(trainer):
    tr = trainer
    tr.transaction.begin()
    nan_before, source_before = tr.nan.state_dict(), tr.source.state_dict()
    batch = tr.source.next(0)[0].batch
    before = _weights(tr)
    fault_injection.arm("optimizer", 1)
    with pytest.raises(NonFiniteError, match="trainer.on_nan=stop"):
        tr.update(batch)
    tr.transaction.rollback()
    _assert_same(_weights(tr), before)
    assert tr.nan.state_dict() == nan_before and tr.source.state_dict() == source_before


# ------------------------------------------------------------------------------------------ checkpoints by name
def test_checkpoint_parts_by_name_round_trip_in_the_format_2_layout(trainer, tmp_path):
    tr = trainer
    tr.nan.load_state_dict({"skipped": 3, "in_row": 1, "by_stage": {"loss": 2, "reference": 1}})
    tr.policy_update.load_state_dict({"updates": 5})
    tr.load_state_dict({"step": 2, "sft_done": True, "last_metrics": {"reward/mean": 0.25}})
    path = tr.save()
    st = load_checkpoint(path).state
    assert list(st)[:11] == ["format", "step", "updates", "nan_skipped", "nan", "sft_done", "source",
                             "metrics_offset", "last_metrics", "model_signature", "world_size"]
    assert (st["step"], st["updates"], st["nan_skipped"], st["sft_done"]) == (2, 5, 3, True)
    saved = {name: copy.deepcopy(part.state_dict()) for name, part in tr.checkpoint_parts().items()}
    # every part is changed, then handed its own state back by name
    tr.nan.load_state_dict({})
    tr.policy_update.load_state_dict({"updates": 0})
    tr.load_state_dict({"step": 0, "sft_done": False})
    tr.load(path)
    loaded = {name: part.state_dict() for name, part in tr.checkpoint_parts().items()}
    assert loaded["source"].pop("published") == 2        # a load publishes the weights of its step
    saved["source"].pop("published")
    _assert_same(loaded, saved)


def test_a_checkpoint_in_the_layout_written_before_named_parts_still_loads(trainer):
    # what the trainer wrote before (its counters spread at the top of state.pt, the earliest format-2 checkpoints
    # with only ``nan_skipped``), through the storage directly
    tr = trainer
    random.seed(5)
    old = {"format": FORMAT, "step": 2, "updates": 6, "nan_skipped": 4, "sft_done": False,
           "source": tr.source.state_dict(), "metrics_offset": 0, "last_metrics": {"reward/mean": 0.5},
           "model_signature": model_signature(tr.unwrapped), "world_size": 1}
    path = save_checkpoint(tr.run_dir.ckpt_root, 2, model=tr.unwrapped, optimizer=tr.optimizer,
                           scheduler=tr.scheduler, extra=old, rng_states=[rng_state()], keep=0)
    expected_draw = random.random()
    tr.load(path)
    assert (tr.step, tr.policy_update.updates, tr.nan.skipped, tr.sft_done) == (2, 6, 4, False)
    assert tr.last_metrics == {"reward/mean": 0.5} and random.random() == expected_draw


def test_no_part_writes_another_parts_attributes():
    # parts restore themselves (load_state_dict); tests/trainer/test_preparation_stage.py checks every module of
    # trainer/, sources/ and logprobs/ by their syntax trees
    import re
    from pathlib import Path

    import offpolicy_moe.logprobs as logprobs
    import offpolicy_moe.trainer as pkg

    root = Path(pkg.__file__).parent
    files = [root / f for f in ("trainer.py", "update.py", "run_checkpoints.py", "transaction.py")]
    files.append(Path(logprobs.__file__).parent / "finite_agreement.py")
    bad = [f"{f.name}:{i}: {line.strip()}"
           for f in files
           for i, line in enumerate(f.read_text().splitlines(), 1)
           if re.search(r"\bself\.[a-z_]+\.[a-z_]+ = ", line)]
    assert bad == []
