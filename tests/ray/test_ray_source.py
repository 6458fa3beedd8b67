"""buffer.mode=async rollout.backend=ray end to end on a real two-node Ray cluster (tests/ray/conftest.py)."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch

from offpolicy_moe.config.load import to_yaml
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.sources.asynchronous import PipelineTimeout
from offpolicy_moe.trainer.trainer import Trainer

pytestmark = pytest.mark.ray
RAY = ("buffer.mode=async", "rollout.backend=ray")


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl") if line.strip()]


def _train(cfg, *, on_step_end=None, on_batch=None):
    seen = []

    def record(tr, b):
        seen.append((b.input_ids.clone(), b.behav_logp.clone(), b.version, b.generated_at))
        if on_batch is not None:
            on_batch(tr, b)

    cb = FunctionCallback(on_batch=record, on_step_end=on_step_end)
    trainer = Trainer(cfg, callbacks=[cb])
    summary = trainer.run()
    return summary, seen, {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}, trainer


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """The local pipeline at staleness 0, workers waiting for every version: the reference."""
    from tests.tiny import tiny_config
    cfg = tiny_config(tmp_path_factory.mktemp("local"), "buffer.mode=async", "buffer.staleness=0",
                      "algo.routing.replay=r3")
    summary, seen, weights, _ = _train(cfg)
    assert summary["status"] == "completed"
    return seen, weights


def _check_registry_on_the_trainers_node(source) -> None:
    """The weight registry, and four more placed the same way, run on the trainer's node (the head, without
    CPUs): one on a rollout node would die with it and fail the surviving actors' orders too."""
    here = ray.get_runtime_context().get_node_id()
    assert source.transport.registry_node() == here
    for _ in range(4):
        extra = source.transport.place_registry()
        try:
            assert ray.get(extra.node.remote(), timeout=60) == here
        finally:
            ray.kill(extra)


def _same(seen_a, seen_b):
    assert len(seen_a) == len(seen_b) == 3
    for (ids_a, lp_a, v_a, it_a), (ids_b, lp_b, v_b, it_b) in zip(seen_a, seen_b):
        assert torch.equal(ids_a, ids_b) and torch.equal(lp_a, lp_b) and (v_a, it_a) == (v_b, it_b)


def test_ray_actors_at_staleness_0_reproduce_the_local_pipeline_bit_for_bit(cluster, local_run, make_cfg):
    """Same samples (tokens, behaviour log-probs, versions) and the same trained weights as the local workers."""
    cfg = make_cfg(*RAY, "buffer.staleness=0", "algo.routing.replay=r3")
    checked = []
    summary, seen, weights, trainer = _train(cfg, on_step_end=lambda tr, step, m: checked or checked.append(
        _check_registry_on_the_trainers_node(tr.source)))
    assert summary["status"] == "completed", summary.get("error")
    assert checked
    _same(seen, local_run[0])
    assert all(torch.equal(weights[k], local_run[1][k]) for k in weights)
    rows = [r for r in _rows(cfg.run_dir) if r["step"] > 0]
    assert all(r["offpolicy/staleness_max"] == 0.0 for r in rows)
    assert all(r["async/weight_sync_s"] >= 0 and r["async/trainer_wait_s"] >= 0 for r in rows)


def test_an_actor_killed_mid_run_is_named_restarted_and_its_iteration_reissued_with_its_seed(
        cluster, local_run, make_cfg, capfd):
    """SIGKILL of the actor's process after step 1 (iteration 1 is issued to it, and it has not generated it): the
    trainer names it, starts a new actor, issues iteration 1 again with its seed: the samples and weights still
    equal the local run's.  The actor is stopped (SIGSTOP) when the trainer gets the batch of iteration 0, before
    iteration 1 is issued (k=0), so that it cannot finish iteration 1 before the kill, however fast it is."""
    cfg = make_cfg(*RAY, "buffer.staleness=0", "algo.routing.replay=r3")
    frozen, killed = [], []

    def freeze(trainer, batch):
        if not frozen:
            frozen.append(trainer.source.worker_pids()[0])
            os.kill(frozen[0], signal.SIGSTOP)

    def kill(trainer, step, m):
        if step == 1 and not killed:
            killed.append(frozen[0])
            os.kill(killed[0], signal.SIGKILL)

    try:
        summary, seen, weights, trainer = _train(cfg, on_batch=freeze, on_step_end=kill)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert summary["status"] == "completed", summary.get("error")
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("offpolicy-moe: Ray rollout actor 0"))
    assert f"(pid {killed[0]} on " in line and "died while generating iteration(s) [1]: its process died" in line
    assert line.endswith("restarting it (rollout.on_worker_death=restart)") and len(line) < 300
    assert trainer.source.restarts == 1
    _same(seen, local_run[0])
    assert all(torch.equal(weights[k], local_run[1][k]) for k in weights)


def test_an_unreachable_cluster_is_a_one_line_error_naming_the_address(make_cfg):
    """Nothing listens on the address: the trainer refuses at construction, in one line, naming it."""
    from tests.tiny import free_port
    address = f"127.0.0.1:{free_port()}"
    cfg = make_cfg(*RAY, f"rollout.ray_address={address}")
    path = Path(cfg.run_dir).parent / "unreachable.yaml"
    path.write_text(to_yaml(cfg))
    res = subprocess.run([sys.executable, "-m", "offpolicy_moe", "train", str(path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert f"cannot reach the Ray cluster at {address} (rollout.ray_address)" in last


def test_an_actor_that_stops_answering_makes_a_timeout_that_names_it(cluster, make_cfg):
    """SIGSTOP of the actor's process once it runs: the trainer gives up after rollout.worker_timeout_s (set to 2 s
    for the wait, after the actor has started), naming the iteration, the actor, its pid and its node's IP.  The
    actor is stopped when the trainer gets the batch of iteration 0, before iteration 1 is issued (k=0): the batch
    it never answers is iteration 1's, however fast it is."""
    cfg = make_cfg(*RAY, "buffer.staleness=0")
    stopped = []

    def freeze(trainer, batch):
        if not stopped:
            trainer.source.timeout = 2.0
            stopped.append(trainer.source.worker_pids()[0])
            os.kill(stopped[0], signal.SIGSTOP)

    try:
        with pytest.raises(PipelineTimeout, match=r"waited 2 s \(rollout.worker_timeout_s\) for the batch of "
                                                  r"iteration 1 from Ray rollout actor 0 \(pid \d+ on "):
            _train(cfg, on_batch=freeze)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_publishing_every_2_steps_with_drop_keeps_the_bound_and_only_published_versions(cluster, make_cfg):
    """rollout.publish_every=2, buffer.on_stale=drop, k=1: every token was sampled by a published (even) version,
    no token lags more than k, and every iteration is trained exactly once, in order."""
    cfg = make_cfg(*RAY, "buffer.staleness=1", "buffer.on_stale=drop", "rollout.publish_every=2",
                   "algo.correction.mode=truncate", "trainer.steps=5")
    versions = []
    trainer = Trainer(cfg, callbacks=[FunctionCallback(on_batch=lambda tr, b: versions.append(
        set(b.token_versions[b.response_mask.bool()].tolist())))])
    summary = trainer.run()
    assert summary["status"] == "completed", summary.get("error")
    assert versions and all(v and all(x % 2 == 0 for x in v) for v in versions)
    rows = [r for r in _rows(cfg.run_dir) if r["step"] > 0]
    assert [r["offpolicy/generated_at"] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(r["offpolicy/staleness_max"] <= 1.0 for r in rows)
