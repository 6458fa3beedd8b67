"""AsyncBatchSource driven through its transport seam by an in-memory transport: the source alone decides what a
worker's death leads to (restart and re-issue with the same seed, stop, go on without a lost node's worker) and
names the worker it waits for; and the Ray transport is loaded only with ``rollout.backend=ray``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator, Mapping

import pytest
import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.messages import BatchDone, BatchNonFinite, Order
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.sources.asynchronous import AsyncBatchSource, make_transport
from offpolicy_moe.sources.transport import MAX_RESTARTS as _MAX_RESTARTS
from offpolicy_moe.sources.process_transport import ProcessTransport
from offpolicy_moe.sources.transport import Event, PipelineTimeout, WorkerDied, WorkerLost
from tests.sources.seam import KeepAsIs
from tests.tiny import tiny_config

REPO = Path(__file__).resolve().parents[2]


def _state(iteration: int, version: int) -> dict:
    ids = torch.arange(12).view(2, 6)
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(2, 3),
                        behav_logp=torch.full((2, 3), -1.0), group_ids=torch.tensor([0, 0]), answers=["1", "1"],
                        completions=["1", "2"], prompt_len=3, version=version,
                        generated_at=iteration).state_dict()


class FakeTransport:
    """Workers in memory: an order is answered at the next receive (unless the worker is muted), a killed worker
    loses its pending answers and is reported lost."""

    noun = "worker"

    def __init__(self) -> None:
        self.version = -1
        self.live: dict[int, int] = {}              # slot -> pid
        self.spawned: list[tuple[int, int]] = []
        self.orders: list[tuple[int, Order]] = []
        self.pending: list[Event] = []
        self.muted: set[int] = set()
        self.closed = False
        self._pid = 1000

    def start(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.version = int(version)

    def spawn(self, index: int, restarts: int = 0) -> None:
        self._pid += 1
        self.live[index] = self._pid
        self.spawned.append((index, restarts))

    def send(self, index: int, order: Order) -> None:
        self.orders.append((index, order))
        if index in self.live and index not in self.muted:
            self.pending.append(BatchDone(index, order.iteration, order.attempt,
                                          _state(order.iteration, self.version),
                                          {"wait_s": 0.0, "sync_s": 0.0, "generate_s": 0.0, "cpu_s": 0.0}))

    def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        self.version = int(version)
        return 0.0

    def receive(self, timeout: float) -> Iterator[Event]:
        while self.pending:
            yield self.pending.pop(0)

    def retire(self, index: int) -> None:
        del self.live[index]

    def alive(self, index: int) -> bool:
        return index in self.live

    def describe(self, index: int, detail: str = "") -> str:
        return f"fake worker {index} (pid {self.live[index]}{', ' + detail if detail else ''})"

    def pids(self) -> list[int]:
        return [self.live[i] for i in sorted(self.live)]

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True

    def kill(self, index: int, *, node_lost: bool = False) -> None:
        """The worker dies: its answers not yet received are lost, its death is reported."""
        self.pending = [e for e in self.pending if e.index != index]
        self.pending.append(WorkerLost(index, "killed by the test", node_lost=node_lost))


def _source(tmp_path, *overrides) -> tuple[AsyncBatchSource, FakeTransport, torch.nn.Module]:
    cfg = tiny_config(tmp_path / "run", "buffer.mode=async", "buffer.staleness=0", "trainer.steps=6",
                      "rollout.worker_timeout_s=5", *overrides)
    model, fake = torch.nn.Linear(1, 1), FakeTransport()
    src = AsyncBatchSource(cfg, model=model, stage=KeepAsIs(), transport=fake)
    src.publish(model.state_dict(), 0, force=True)
    return src, fake, model


def _step(src: AsyncBatchSource, model: torch.nn.Module, step: int) -> RolloutBatch:
    batch = src.next(step)[0].batch
    src.publish(model.state_dict(), step + 1)
    return batch


def test_a_lost_worker_is_restarted_and_its_iteration_reissued_with_the_same_seed(tmp_path, capfd):
    src, fake, model = _source(tmp_path)
    assert _step(src, model, 0).generated_at == 0
    fake.kill(0)                                      # it holds iteration 1 (issued at the publish of version 1)
    prepared, metrics = src.next(1)
    batch = prepared.batch
    assert batch.generated_at == 1 and batch.version == 1
    assert fake.spawned == [(0, 0), (0, 1)] and src.restarts == 1 and metrics["async/worker_restarts"] == 1.0
    sent = [o for _, o in fake.orders if o.iteration == 1]
    assert [o.attempt for o in sent] == [0, 1] and sent[0].seed == sent[1].seed
    err = capfd.readouterr().err
    assert ("fake worker 0 (pid 1001) died while generating iteration(s) [1]: killed by the test; restarting it "
            "(rollout.on_worker_death=restart)") in err


def test_a_superseded_answer_of_a_lost_worker_is_not_trained_on(tmp_path):
    """The dead worker's batch arrives after its death was handled: attempt 0 was superseded, only attempt 1
    is kept."""
    src, fake, model = _source(tmp_path)
    _step(src, model, 0)
    late = fake.pending.pop(0)                          # iteration 1, attempt 0
    fake.kill(0)
    fake.pending.append(late)
    batch = src.next(1)[0].batch
    assert batch.generated_at == 1 and [o.attempt for _, o in fake.orders if o.iteration == 1] == [0, 1]
    assert len(src) == 0 and src.cursor == 2


def test_on_worker_death_stop_raises_worker_died_naming_the_worker(tmp_path):
    src, fake, model = _source(tmp_path, "rollout.on_worker_death=stop")
    _step(src, model, 0)
    fake.kill(0)
    with pytest.raises(WorkerDied, match=r"fake worker 0 \(pid 1001\) died while generating iteration\(s\) \[1\]: "
                                         r"killed by the test; stopping \(rollout.on_worker_death=stop\)"):
        src.next(1)
    assert fake.spawned == [(0, 0)]


def test_a_slot_is_restarted_at_most_max_restarts_times(tmp_path):
    src, fake, model = _source(tmp_path)
    _step(src, model, 0)
    for _ in range(_MAX_RESTARTS):
        fake.kill(0)
        src._receive(timeout=0)
    assert src.restarts == _MAX_RESTARTS
    fake.kill(0)
    with pytest.raises(WorkerDied, match=rf"stopping \({_MAX_RESTARTS} restarts\)"):
        src._receive(timeout=0)


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_a_lost_node_goes_on_with_the_other_workers_or_stops(tmp_path, capfd, policy):
    src, fake, model = _source(tmp_path, "rollout.workers=2", f"rollout.ray_on_node_loss={policy}")
    _step(src, model, 0)
    holder = next(i for i, o in reversed(fake.orders) if o.iteration == 1)
    fake.kill(holder, node_lost=True)
    if policy == "stop":
        with pytest.raises(WorkerDied, match=r"stopping \(rollout.ray_on_node_loss=stop\)"):
            src.next(1)
        return
    for step in range(1, 6):
        assert _step(src, model, step).generated_at == step
    assert fake.spawned == [(0, 0), (1, 0)] and src.restarts == 0
    assert all(i != holder for i, o in fake.orders if o.iteration >= 2)      # nothing more to the lost worker
    assert "going on with 1 rollout worker(s) (rollout.ray_on_node_loss=continue)" in capfd.readouterr().err
    fake.kill(1 - holder, node_lost=True)
    with pytest.raises(WorkerDied, match=r"stopping \(no rollout worker left\)"):
        src._receive(timeout=0)


def test_a_silent_worker_makes_a_timeout_naming_it(tmp_path):
    src, fake, model = _source(tmp_path, "rollout.worker_timeout_s=0.2")
    _step(src, model, 0)
    fake.pending.clear()
    fake.muted.add(0)
    with pytest.raises(PipelineTimeout, match=r"for the batch of iteration 1 from fake worker 0 \(pid 1001, "
                                              r"alive=True\)"):
        src.next(1)


def test_a_worker_non_finite_report_comes_back_as_a_value_and_is_issued_again(tmp_path):
    src, fake, model = _source(tmp_path)
    _step(src, model, 0)
    fake.pending = [BatchNonFinite(0, 1, 0, "generation", "sampling probabilities")]
    prepared, metrics = src.next(1)
    assert prepared.batch is None and metrics == {}
    assert (prepared.error.stage, prepared.error.iteration, prepared.error.step) == ("generation", 1, 2)
    batch = src.next(1)[0].batch                  # the loop applied trainer.on_nan=skip and asks again
    assert batch.generated_at == 1
    assert [o.attempt for _, o in fake.orders if o.iteration == 1] == [0, 1]
    src.raise_nonfinite = True                    # what rollout.backend=ray sets: the run stops as diverged
    src.publish(model.state_dict(), 2)
    fake.pending = [BatchNonFinite(0, 2, 0, "generation", "sampling probabilities")]
    with pytest.raises(NonFiniteError, match=r"sampling probabilities \(rollout worker 0\)"):
        src.next(2)


def test_close_goes_to_the_transport(tmp_path):
    src, fake, model = _source(tmp_path)
    _step(src, model, 0)
    src.close()
    assert fake.closed


def test_the_backend_picks_the_transport(tmp_path):
    cfg = tiny_config(tmp_path / "run", "buffer.mode=async")
    assert isinstance(make_transport(cfg), ProcessTransport)
    cfg.rollout.backend = "carrier-pigeon"
    with pytest.raises(ValueError, match="rollout.backend must be 'local' or 'ray', got 'carrier-pigeon'"):
        make_transport(cfg)


def test_ray_is_not_imported_without_the_ray_backend(tmp_path):
    """A local asynchronous source (and the trainer's builder) loads neither Ray nor the Ray transport; the Ray
    transport's module itself loads no Ray until it connects."""
    code = textwrap.dedent(f"""
        import sys, torch
        from tests.tiny import tiny_config
        import offpolicy_moe, offpolicy_moe.trainer.build
        from offpolicy_moe.sources.asynchronous import AsyncBatchSource
        from tests.sources.seam import KeepAsIs
        cfg = tiny_config({str(tmp_path / 'run')!r}, "buffer.mode=async")
        AsyncBatchSource(cfg, model=torch.nn.Linear(1, 1), stage=KeepAsIs())
        loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
        assert not loaded, loaded
        assert "offpolicy_moe.sources.ray_transport" not in sys.modules
        import offpolicy_moe.sources.ray_transport
        loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
        assert not loaded, loaded
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


@pytest.mark.parametrize("early", [True, False])
def test_early_start_starts_the_workers_at_the_first_publish_and_changes_no_order(tmp_path, early):
    """``rollout.early_start``: the workers start (and get iteration 0) when the first weights are published, so
    their start overlaps the trainer's step-0 evaluation; off, at the first batch request.  The orders are the
    same either way."""
    src, fake, model = _source(tmp_path, f"rollout.early_start={str(early).lower()}")
    if early:
        assert fake.spawned == [(0, 0)] and [(i, o.iteration) for i, o in fake.orders] == [(0, 0)]
    else:
        assert fake.spawned == [] and fake.orders == []
    for step in range(3):
        assert _step(src, model, step).generated_at == step
    assert fake.spawned == [(0, 0)]
    assert [(i, o.iteration, o.attempt, o.min_version) for i, o in fake.orders] == [
        (0, 0, 0, 0), (0, 1, 0, 1), (0, 2, 0, 2), (0, 3, 0, 3)]
