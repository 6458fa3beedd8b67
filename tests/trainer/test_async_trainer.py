"""buffer.mode=async end to end: real rollout worker processes beside the trainer (docs/async.md)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time

import psutil
import pytest
import torch

from offpolicy_moe.rollout import worker
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.sources.asynchronous import PipelineTimeout
from offpolicy_moe.trainer.trainer import Trainer
from tests.kill import kill_first_worker_after


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]


def _train(cfg, *, on_batch=None, on_step_end=None, resume=False) -> tuple[dict, Trainer]:
    trainer = Trainer(cfg, resume=resume, callbacks=[FunctionCallback(on_batch=on_batch, on_step_end=on_step_end)])
    return trainer.run(), trainer


def test_async_with_a_worker_that_waits_for_every_version_reproduces_the_synchronous_run(make_cfg):
    """staleness 0: the worker waits for version t before generating iteration t, so it samples exactly what the
    synchronous loop samples, and training ends at the same weights."""
    seen: dict[str, list] = {"fixed": [], "async": []}
    final = {}
    for mode in ("fixed", "async"):
        cfg = make_cfg(f"buffer.mode={mode}", "buffer.staleness=0", "trainer.steps=3")
        summary, trainer = _train(cfg, on_batch=lambda tr, b, mode=mode: seen[mode].append(
            (b.input_ids.clone(), b.behav_logp.clone(), b.version, b.generated_at)))
        assert summary["status"] == "completed"
        final[mode] = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
    assert len(seen["async"]) == len(seen["fixed"]) == 3
    for (ids_a, lp_a, v_a, it_a), (ids_s, lp_s, v_s, it_s) in zip(seen["async"], seen["fixed"]):
        assert torch.equal(ids_a, ids_s) and torch.equal(lp_a, lp_s) and (v_a, it_a) == (v_s, it_s)
    assert all(torch.equal(final["async"][k], final["fixed"][k]) for k in final["fixed"])


def test_a_killed_worker_is_named_restarted_and_nothing_is_lost(make_cfg, capfd):
    """SIGKILL of the worker after step 1, updates in flight, k=1: the trainer names the worker, restarts it,
    re-issues its iteration; every iteration is trained on exactly once and no token lags more than k."""
    cfg = make_cfg("buffer.mode=async", "buffer.staleness=1", "trainer.steps=4", "rollout.update_in_flight=true",
                   "algo.correction.mode=truncate")
    killed = []
    summary, trainer = _train(cfg, on_step_end=kill_first_worker_after(1, killed))
    assert summary["status"] == "completed"
    err = capfd.readouterr().err
    assert f"rollout worker 0 (pid {killed[0]}) died" in err and "killed by SIGKILL" in err and "restarting" in err
    rows = [m for m in _metrics(cfg.run_dir) if m["step"] > 0]
    assert [m["offpolicy/generated_at"] for m in rows] == [0.0, 1.0, 2.0, 3.0]
    assert all(m["offpolicy/staleness_max"] <= 1.0 for m in rows)
    assert rows[-1]["async/worker_restarts"] == 1.0


def test_a_worker_idle_longer_than_its_poll_keeps_serving(make_cfg):
    """k=0: while the trainer is busy (here 2.5 worker polls in a callback) the worker has no order; it must keep
    waiting, not mistake its fork-server parent for a dead trainer (the run stops at a worker death under
    ``stop``).  The callback is the batch of iteration 0's: the worker has sent it and gets no order before version 1
    is published, so it is idle for the whole callback, however long its generation took."""
    cfg = make_cfg("buffer.mode=async", "buffer.staleness=0", "trainer.steps=2", "rollout.on_worker_death=stop")
    idle_s = 2.5 * worker.ORDER_POLL_S
    waited = []

    def busy(trainer, batch):
        if not waited:
            waited.append(idle_s)
            time.sleep(idle_s)

    summary, _ = _train(cfg, on_batch=busy)
    assert waited and summary["status"] == "completed", summary.get("error")


def test_a_worker_that_stops_answering_makes_a_timeout_that_names_it(make_cfg):
    """SIGSTOP: the worker is alive but silent; the trainer gives up after rollout.worker_timeout_s, naming the
    iteration, the worker and its pid, and ends the worker on the way out.  The worker is stopped when the trainer
    gets the batch of iteration 0, before iteration 1 is issued (k=0): it cannot have sent iteration 1 already,
    however fast it is."""
    cfg = make_cfg("buffer.mode=async", "buffer.staleness=0", "trainer.steps=3", "rollout.worker_timeout_s=2")
    stopped = []

    def freeze(trainer, batch):
        if not stopped:
            stopped.append(trainer.source.worker_pids()[0])
            os.kill(stopped[0], signal.SIGSTOP)

    try:
        with pytest.raises(PipelineTimeout, match=r"waited 2 s .* for the batch of iteration 1 from rollout worker 0 "
                                                  r"\(pid \d+, alive=True\)"):
            _train(cfg, on_batch=freeze)
        assert not psutil.pid_exists(stopped[0]) or psutil.Process(stopped[0]).status() == psutil.STATUS_ZOMBIE
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("overrides", [["preset=[m2po,r3]", "rollout.update_in_flight=true"],
                                       ["algo.old_logp_source=proximal"]], ids=["m2po_r3_in_flight", "decoupled_ppo"])
def test_off_policy_losses_train_on_async_batches(make_cfg, overrides):
    """M2PO (with R3 and updates in flight) and decoupled PPO read the per-token behaviour / old log-probs of
    asynchronous batches unchanged."""
    cfg = make_cfg("buffer.mode=async", "buffer.staleness=1", "trainer.steps=3", *overrides)
    summary, _ = _train(cfg)
    assert summary["status"] == "completed", summary.get("error")
    rows = [m for m in _metrics(cfg.run_dir) if m["step"] > 0]
    assert len(rows) == 3 and all(m["offpolicy/staleness_max"] <= 1.0 for m in rows)
    assert all(math.isfinite(m["actor/loss"]) and m["actor/updates"] == m["step"] for m in rows)


def test_two_workers_stay_within_the_bound_and_in_order(make_cfg):
    cfg = make_cfg("buffer.mode=async", "buffer.staleness=2", "trainer.steps=5", "rollout.workers=2",
                   "rollout.update_in_flight=true")
    pids = []
    summary, _ = _train(cfg, on_step_end=lambda tr, step, m: pids.append(tuple(tr.source.worker_pids())))
    assert summary["status"] == "completed", summary.get("error")
    assert len(set(pids)) == 1 and len(pids[0]) == 2
    rows = [m for m in _metrics(cfg.run_dir) if m["step"] > 0]
    assert [m["offpolicy/generated_at"] for m in rows] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(m["offpolicy/staleness_max"] <= 2.0 for m in rows)


def test_workers_started_early_are_stopped_when_the_step_0_evaluation_fails(make_cfg, monkeypatch):
    """``rollout.early_start`` starts the workers at the first publish, before the step-0 evaluation: a run that
    fails there (before the loop) still stops them, and its summary says failed."""
    cfg = make_cfg("buffer.mode=async", "buffer.staleness=1", "trainer.steps=2")
    trainer = Trainer(cfg)
    seen: list[int] = []

    def broken_evaluate():
        seen.extend(trainer.source.worker_pids())
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(trainer, "evaluate", broken_evaluate)
    with pytest.raises(RuntimeError, match="evaluation broke"):
        trainer.run()
    assert seen, "the workers start at the first publish, before the step-0 evaluation"
    def running() -> list[int]:
        return [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    deadline = time.time() + 10
    while running() and time.time() < deadline:
        time.sleep(0.1)
    assert running() == [], "a worker outlived the failed run"
    with open(os.path.join(cfg.run_dir, "summary.json")) as f:
        assert json.load(f)["status"] == "failed"
