"""What a rollout worker sends is a typed record, read by field, and the dispatcher re-issues an iteration through
its public ``requeue`` (the asynchronous source's re-issue of a non-finite batch)."""
from __future__ import annotations

import torch

from offpolicy_moe.rollout.messages import BatchDone, BatchNonFinite, WorkerFailed, WorkerReady, pack, unpack
from offpolicy_moe.sources.schedule import Dispatcher


def test_worker_messages_survive_the_pipe_as_the_same_records():
    msgs = [WorkerReady(1, 4242),
            BatchDone(0, 3, 1, {"input_ids": torch.arange(6).reshape(2, 3)}, {"wait_s": 0.5, "sync_s": 0.0,
                                                                              "generate_s": 1.0, "cpu_s": 0.9}),
            BatchNonFinite(0, 5, 0, "generation", "sampling probabilities"),
            WorkerFailed(2, -1, "Traceback ...\nValueError: boom\n")]
    for msg in msgs:
        got = unpack(pack(msg))
        assert type(got) is type(msg)
        for name in msg.__dataclass_fields__:
            a, b = getattr(msg, name), getattr(got, name)
            if isinstance(a, dict):
                assert a.keys() == b.keys()
                assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
            else:
                assert a == b


def test_requeue_hands_the_iteration_out_again_before_new_ones():
    d = Dispatcher(staleness=1, policy="wait", ahead=0, total=10, workers=1)
    [a0, a1] = d.issue(0)
    assert d.accept(0, 1, a1.attempt, 1) is True
    d.requeue([1])                              # e.g. its batch was non-finite and trainer.on_nan=skip
    d.release(0)
    again = d.issue(1)
    assert [a.iteration for a in again][0] == 1 and again[0].attempt == a1.attempt + 1
