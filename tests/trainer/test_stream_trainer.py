"""buffer.mode=stream end to end: a real streaming worker process beside the trainer (docs/async.md, "Streaming")."""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import torch

from offpolicy_moe.config.load import load_config, to_yaml
from offpolicy_moe.run.checkpoint import STATE_FILE
from offpolicy_moe.sources.stream import StreamBatchSource
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.trainer.trainer import Trainer
from tests.kill import kill_first_worker_after, train_until_checkpoint
from tests.tiny import tiny_config

STREAM = ("buffer.mode=stream", "buffer.staleness=1", "rollout.stream_slots=6", "rollout.prompts_per_step=2",
          "rollout.group_size=2", "trainer.threads=1")


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl") if line.strip()]


def _train(cfg, **hooks):
    trainer = Trainer(cfg, callbacks=[FunctionCallback(**hooks)])
    return trainer.run(), trainer


def test_a_stream_trains_every_group_once_within_the_bound_and_replays_its_routes(make_cfg):
    cfg = make_cfg(*STREAM, "trainer.steps=6", "algo.routing.replay=r3", "algo.routing.metrics=true",
                   "algo.correction.mode=truncate")
    batches = []
    summary, trainer = _train(cfg, on_batch=lambda tr, b: batches.append(b))
    assert summary["status"] == "completed"
    rows = _rows(cfg.run_dir)[1:]
    assert len(rows) == 6 and len(batches) == 6
    groups = [int(g) for b in batches for g in b.group_ids.unique()]
    assert len(groups) == len(set(groups)) == 6 * 2                 # P groups a step, each once
    assert trainer.source.trained_groups == groups
    for step, (b, r) in enumerate(zip(batches, rows)):
        assert r["offpolicy/staleness_max"] <= 1
        versions = b.token_versions[b.response_mask.bool()]
        assert int(versions.min()) >= step - 1 and int(versions.max()) <= step
        assert r["routing/replay_fallback"] == 0.0                   # every fed position has the engine's route
        assert r["stream/trained_len_mean"] == pytest.approx(float(b.response_mask.sum(1).float().mean()))
        assert sum(r[f"offpolicy/lag_tokens_{j}"] for j in range(2)) == float(b.response_mask.sum())
        assert r["stream/dropped_late"] == 0.0 and r["stream/outstanding"] <= 2 * 2
        # the worker's seconds: its named parts never exceed the wall they were measured in
        parts = sum(r[f"async/worker_{k}_s"] for k in ("generate", "wait", "pack", "send"))
        assert parts <= r["async/worker_wall_s"] * (1 + 1e-9) + 1e-9
        assert r["async/worker_blocked_share"] == pytest.approx(r["async/worker_send_s"]
                                                                / max(r["async/worker_wall_s"], 1e-9))
        # every group's G rows answer one prompt: the group's own, as the synchronous loop would pose it
        for g in b.group_ids.unique():
            rows_g = b.input_ids[b.group_ids == g]
            assert bool((rows_g[:, :b.prompt_len] == rows_g[:1, :b.prompt_len]).all())
    assert sum(r["async/worker_wall_s"] for r in rows) > 0.0
    assert rows[-1]["stream/ks_trained_vs_generated"] >= 0.0


def test_a_killed_stream_worker_is_restarted_and_its_groups_issued_again(make_cfg, capfd):
    cfg = make_cfg(*STREAM, "trainer.steps=4")
    killed = []
    summary, trainer = _train(cfg, on_step_end=kill_first_worker_after(1, killed))
    assert summary["status"] == "completed" and killed
    assert "restarting it" in capfd.readouterr().err
    groups = trainer.source.trained_groups
    assert len(groups) == len(set(groups)) == 4 * 2
    assert all(r["offpolicy/staleness_max"] <= 1 for r in _rows(cfg.run_dir)[1:])


def test_the_naive_rule_is_selectable_and_counts_what_it_drops(make_cfg):
    cfg = make_cfg(*STREAM, "trainer.steps=3", "buffer.admission=first_finished")
    summary, trainer = _train(cfg)
    assert summary["status"] == "completed"
    rows = _rows(cfg.run_dir)[1:]
    assert all(r["offpolicy/staleness_max"] <= 1 for r in rows)
    assert rows[-1]["stream/dropped_late"] == float(trainer.source.dropped)


@pytest.mark.parametrize("override, words", [
    ("algo.routing.replay=r2", "does not support algo.routing.replay=r2"),
    ("algo.routing.replay=pr2", "does not support algo.routing.replay=pr2"),
    ("rollout.top_p=0.9", "samples the full distribution"),
    ("rollout.sampler=hf", "rollout.sampler=native"),
    ("rollout.publish_every=3", "lower rollout.publish_every"),
])
def test_what_a_stream_cannot_run_is_refused_in_one_line(override, words):
    cfg = load_config(None, [*STREAM, override])
    problems = StreamBatchSource.problems(cfg)
    assert problems and words in problems[0] and "\n" not in problems[0]


def test_a_stream_on_vllm_passes_the_stream_checks():
    """vLLM streams through its own scheduler (rollout/vllm_stream.py): not refused; the built-in engine's HF
    sampler still is."""
    assert StreamBatchSource.problems(load_config(None, [*STREAM, "rollout.engine=vllm"])) == []
    assert StreamBatchSource.problems(load_config(None, [*STREAM, "rollout.engine=vllm", "rollout.sampler=hf"])) == []


def test_a_stream_state_of_another_mode_is_refused(make_cfg):
    cfg = make_cfg(*STREAM)
    src = StreamBatchSource(cfg, model=torch.nn.Linear(1, 1), stage=None, pad_id=0, transport=object())
    with pytest.raises(ValueError, match="mode='stream'"):
        src.load_state_dict({"mode": "async", "k": 1})


def test_sigkill_of_a_stream_then_resume_trains_every_step_and_every_group_once(tmp_path):
    """The trainer (and with it the stream) is killed after its second checkpoint (held in step 3 until the kill:
    tests/kill.py); ``--resume`` goes on from it, issuing the groups that were in flight again under their seeds:
    every step is trained once, no group twice."""

    run_dir = tmp_path / "run"
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(to_yaml(tiny_config(run_dir, *STREAM, "trainer.steps=5", "trainer.checkpoint_every=1",
                                            "trainer.keep_checkpoints=0")))
    proc, cmd, env = train_until_checkpoint(cfg_path, run_dir, 2, timeout=240)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists()                     # really killed before the end
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"streaming workers still running after the trainer died: {alive}"
    res = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(6))                  # no step lost or repeated
    assert all(r["offpolicy/staleness_max"] <= 1 for r in rows[1:])
    state = torch.load(run_dir / "checkpoints" / "step_5" / STATE_FILE, map_location="cpu", weights_only=False)
    trained = state["source"]["trained_groups"]
    assert len(trained) == len(set(trained)) == 5 * 2                   # no group trained twice
    issued = set(range(state["source"]["next_group"]))
    assert set(trained) | set(state["source"]["tickets"]) == issued     # ... and none lost


class _Transport:
    """A transport that records what it is asked to do (no workers)."""

    noun = "worker"

    def __init__(self):
        self.sent = []

    def start(self, weights, version):
        self.started_at = version

    def spawn(self, index, restarts=0):
        pass

    def send(self, index, order):
        self.sent.append(order)

    def publish(self, weights, version):
        return 0.0


class _Stage:
    """Keeps published weights by version, as the preparation stage does (only those published since start)."""

    def __init__(self):
        self.kept = {}

    def keep(self, version, weights):
        self.kept[version] = weights

    def weights(self, version):
        return self.kept[version]


def _group(version: int, group: int):
    from offpolicy_moe.rollout.batch import RolloutBatch
    ids = torch.tensor([[1, 5, 6, 2], [1, 5, 7, 2]])
    return RolloutBatch(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(2, 2).long(),
                        behav_logp=torch.zeros(2, 2), group_ids=torch.full((2,), group), answers=["1", "1"],
                        completions=["6", "7"], prompt_len=2, version=version,
                        token_versions=torch.full((2, 2), version))


def test_a_resumed_stream_generates_again_the_complete_groups_whose_versions_it_no_longer_holds(make_cfg):
    """A checkpoint of step 2 holds complete groups sampled by versions 1 and 2; after the resume the stage holds
    version 2 only, so group 2 (version 1) is issued again under its seed (next attempt) and group 3 is kept.
    The old code kept both, and preparing group 2 failed: policy version 1 is not kept."""
    cfg = make_cfg(*STREAM)
    transport = _Transport()
    src = StreamBatchSource(cfg, model=torch.nn.Linear(1, 1), stage=_Stage(), pad_id=0, transport=transport)
    state = {"mode": "stream", "k": 1, "cursor": 2, "published": 2, "next_group": 4, "arrivals": 2, "dropped": 0,
             "restarts": 0, "attempts": {0: 0, 1: 0, 2: 0, 3: 0}, "tickets": {2: [3, 0, 1], 3: [3, 1, 2]},
             "ready": {2: _group(1, 2).state_dict(), 3: _group(2, 3).state_dict()}, "generated_lengths": [2] * 4,
             "trained_lengths": [], "trained_groups": [0, 1]}
    src.load_state_dict(state)
    src.publish({"w": torch.zeros(1)}, 2, force=True)           # the resumed trainer's first publish
    assert sorted(src.ready) == [3]
    again = [o for o in transport.sent if o.group == 2]
    assert len(again) == 1 and again[0].attempt == 1
    assert src.tickets[2].done is None and src.tickets[2].deadline == 3
    assert not any(o.group == 3 for o in transport.sent)
