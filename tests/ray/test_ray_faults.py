"""Faults of the Ray backend on a real local multi-node cluster: a rollout node removed mid-run (continue with the
remaining actors, or stop with a checkpoint), the trainer SIGKILLed then resumed."""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import ray

from offpolicy_moe.config.load import to_yaml
from offpolicy_moe.sources.ray_transport import actor_died
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.trainer.trainer import Trainer
from tests.kill import train_until_checkpoint

pytestmark = pytest.mark.ray
RAY = ("buffer.mode=async", "rollout.backend=ray", "buffer.staleness=1", "algo.correction.mode=truncate",
       "rollout.update_in_flight=true",
       "algo.routing.replay=r3", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0")


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl") if line.strip()]


def _check_nothing_lost(run_dir, steps: int, k: int) -> None:
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(steps + 1))                      # no step lost or repeated
    assert [r["offpolicy/generated_at"] for r in rows[1:]] == [float(i) for i in range(steps)]   # nor a prompt
    assert all(r["offpolicy/staleness_max"] <= k for r in rows[1:])


def _remove_node_of_actor(cluster, trainer, index: int) -> str:
    node_id = trainer.source.transport.actor_nodes()[index]
    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
    assert node is not cluster.head_node
    cluster.remove_node(node, allow_graceful=False)
    return node_id


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_a_removed_rollout_node_continues_with_fewer_actors_or_stops_with_a_checkpoint(cluster, make_cfg, capfd,
                                                                                        policy):
    """Two actors on two rollout nodes; after step 1 the node of one of them is removed.  ``continue``: the run
    completes on the other actor, every iteration trained once within the bound; ``stop``: status stopped with a
    checkpoint naming the node, and a resume (the node back) completes with nothing lost or repeated."""
    extra = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    cfg = make_cfg(*RAY, "trainer.steps=4", "rollout.workers=2", f"rollout.ray_on_node_loss={policy}")
    removed = []

    def remove(trainer, step, m):
        if step == 1 and not removed:
            nodes = trainer.source.transport.actor_nodes()
            assert len(set(nodes)) == 2, "the two actors share a node"
            removed.append(_remove_node_of_actor(cluster, trainer, nodes.index(extra.node_id)))

    trainer = Trainer(cfg, callbacks=[FunctionCallback(on_step_end=remove)])
    summary = trainer.run()
    assert removed
    if policy == "continue":
        assert summary["status"] == "completed", summary.get("error")
        err = capfd.readouterr().err
        assert f"its node {removed[0][:12]}" in err and "going on with 1 rollout actor(s)" in err
        _check_nothing_lost(cfg.run_dir, 4, 1)
        return
    assert summary["status"] == "stopped", summary
    assert f"its node {removed[0][:12]}" in summary["error"] and "rollout.ray_on_node_loss=stop" in summary["error"]
    assert (Path(cfg.run_dir) / "checkpoints" / f"step_{summary['steps']}").exists()
    cfg.rollout.workers = 1
    summary = Trainer(cfg, resume=True).run()
    assert summary["status"] == "completed", summary.get("error")
    _check_nothing_lost(cfg.run_dir, 4, 1)


def test_an_actor_whose_call_to_another_actor_failed_has_not_died():
    """A call that raised an actor error of ANOTHER actor (the registry died with its node) is an instance of both
    ``RayTaskError`` and ``RayActorError``; it is a failed call, not the death of the calling actor or its node.
    An unreachable actor (``ActorUnavailableError``, e.g. its node was just removed) and a dead one are deaths."""
    nested = ("Traceback (most recent call last):\n  ray.get(self.registry.newest.remote())\n"
              "ray.exceptions.ActorDiedError: The actor died because its node has died. Node Id: 0123abcd")
    wrapped = ray.exceptions.RayTaskError("generate", nested, ray.exceptions.ActorDiedError()).as_instanceof_cause()
    assert isinstance(wrapped, ray.exceptions.RayActorError)           # why the order of the tests matters
    assert not actor_died(ray, wrapped)
    assert not actor_died(ray, ray.exceptions.RayTaskError("generate", "ValueError: boom", ValueError("boom")))
    assert actor_died(ray, ray.exceptions.ActorDiedError())
    assert actor_died(ray, ray.exceptions.ActorUnavailableError("RpcError: Socket closed", None))


def test_sigkill_of_the_trainer_then_resume_loses_and_repeats_nothing(cluster, make_cfg):
    """The trainer (its own process, connected to the cluster by rollout.ray_address) is SIGKILLed in step 3, once
    step 2's checkpoint exists (held there until the kill: tests/kill.py); ``--resume`` reissues the iterations that were in flight and ends with every step and every
    prompt trained exactly once."""
    cfg = make_cfg(*RAY, "trainer.steps=5", f"rollout.ray_address={cluster.address}")
    path = Path(cfg.run_dir).parent / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    # held at step 3 once step 2's checkpoint is written (tests/kill.py): the run cannot end before the kill
    proc, cmd, env = train_until_checkpoint(path, Path(cfg.run_dir), 2, timeout=240)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (Path(cfg.run_dir) / "summary.json").exists()
    res = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_nothing_lost(cfg.run_dir, 5, 1)
