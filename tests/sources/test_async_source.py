"""AsyncBatchSource without processes: the checkpointed in-flight state and the config checks."""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.sources.asynchronous import AsyncBatchSource, check_async_config
from tests.sources.seam import KeepAsIs
from tests.tiny import tiny_config


def _batch(iteration: int, version: int) -> RolloutBatch:
    ids = torch.arange(12).view(2, 6)
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(2, 3),
                        behav_logp=torch.full((2, 3), -1.0), group_ids=torch.tensor([0, 0]), answers=["1", "1"],
                        completions=["1", "2"], prompt_len=3, version=version, generated_at=iteration,
                        old_logp=torch.full((2, 3), -1.5), token_versions=torch.tensor([[version] * 3,
                                                                                         [version, version + 1,
                                                                                          version + 1]]))


def _source(tmp_path, world=1, *overrides) -> AsyncBatchSource:
    cfg = tiny_config(tmp_path / "run", "buffer.mode=async", "buffer.staleness=2", "trainer.steps=10", *overrides)
    return AsyncBatchSource(cfg, model=torch.nn.Linear(1, 1), stage=KeepAsIs(), rank=0, world=world)


def test_the_checkpoint_keeps_received_batches_with_their_versions(tmp_path):
    src = _source(tmp_path)
    src.dispatch.restore(3, [])
    src.ready = {3: _batch(3, 1), 5: _batch(5, 3)}
    src.dispatch.dropped = 2
    state = src.state_dict()
    new = _source(tmp_path)
    new.load_state_dict(state)
    assert new.cursor == 3 and new.dropped == 2 and sorted(new.ready) == [3, 5]
    assert torch.equal(new.ready[5].token_versions, src.ready[5].token_versions)
    assert torch.equal(new.ready[3].old_logp, src.ready[3].old_logp) and new.ready[3].version == 1
    assert new.dispatch.reissue == [4] and new.dispatch.next_issue == 6          # 4 was in flight: issued again
    assert [(a.iteration, a.attempt) for a in new.dispatch.issue(4)] == [(4, 0), (6, 0)]


def test_with_several_trainer_processes_received_batches_are_generated_again(tmp_path):
    src = _source(tmp_path, world=2)
    src.dispatch.restore(3, [])
    src.ready = {3: _batch(3, 1), 4: _batch(4, 2)}
    new = _source(tmp_path, world=2)
    new.load_state_dict(src.state_dict())
    assert new.ready == {} and new.cursor == 3 and new.dispatch.next_issue == 3


def test_a_checkpoint_of_another_staleness_is_refused(tmp_path):
    state = _source(tmp_path).state_dict()
    other = AsyncBatchSource(tiny_config(tmp_path / "o", "buffer.mode=async", "buffer.staleness=1"),
                             model=torch.nn.Linear(1, 1), stage=KeepAsIs())
    with pytest.raises(ValueError, match="staleness=2 mode='async', but the config asks for staleness=1"):
        other.load_state_dict(state)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.workers=0"], "rollout.workers"),
    (["rollout.worker_timeout_s=0"], "worker_timeout_s"),
    (["algo.routing.replay=pr2"], "replay=pr2"),
    (["algo.routing.replay=r2", "rollout.update_in_flight=true"], "update_in_flight"),
    (["buffer.max_ahead=-1"], "max_ahead"),
])
def test_configs_async_cannot_run_are_refused_in_one_line(tmp_path, overrides, match):
    cfg = tiny_config(tmp_path / "run", "buffer.mode=async", *overrides)
    with pytest.raises(ValueError, match=match) as ei:
        check_async_config(cfg)
    assert "\n" not in str(ei.value)
