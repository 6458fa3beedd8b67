"""buffer.mode=async: SIGKILL of each process kind, then --resume; a worker death that stops the run; two trainer
processes with their workers.  Slow (several real runs with worker processes): ``pytest -m slow``."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from offpolicy_moe.config.load import to_yaml
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.trainer.trainer import Trainer
from tests.kill import train_until_checkpoint
from tests.tiny import tiny_config

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ASYNC = ("buffer.mode=async", "buffer.staleness=1", "trainer.steps=5", "trainer.checkpoint_every=1",
         "trainer.threads=1", "trainer.keep_checkpoints=0", "algo.correction.mode=truncate",
         "rollout.update_in_flight=true", "algo.routing.replay=r3")


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(Path(run_dir) / "metrics.jsonl") if line.strip()]


def _check_nothing_lost(run_dir, steps: int, k: int) -> None:
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(steps + 1))                      # no step lost or repeated
    assert [r["offpolicy/generated_at"] for r in rows[1:]] == [float(i) for i in range(steps)]   # nor a prompt
    assert all(r["offpolicy/staleness_max"] <= k for r in rows[1:])


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO))


def _yaml(tmp_path, run_dir, *overrides) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(tiny_config(run_dir, *ASYNC, *overrides)))
    return path


def test_sigkill_of_the_trainer_then_resume_loses_and_repeats_nothing(tmp_path):
    run_dir = tmp_path / "run"
    # held at step 3 once step 2's checkpoint is written (tests/kill.py): the run cannot end before the kill
    proc, cmd, env = train_until_checkpoint(_yaml(tmp_path, run_dir), run_dir, 2, timeout=240, env=_env())
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "no worker processes"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists()
    _, alive = psutil.wait_procs(children, timeout=30)          # orphaned workers notice and exit
    assert not alive, f"workers still running after the trainer died: {alive}"
    res = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    _check_nothing_lost(run_dir, 5, 1)


def test_sigkill_of_a_worker_under_stop_checkpoints_names_it_and_resumes(make_cfg):
    cfg = make_cfg(*ASYNC, "rollout.on_worker_death=stop")
    killed = []

    def kill(trainer, step, m):
        if step == 2 and not killed:
            killed.append(trainer.source.worker_pids()[0])
            os.kill(killed[0], signal.SIGKILL)

    summary = Trainer(cfg, callbacks=[FunctionCallback(on_step_end=kill)]).run()
    assert summary["status"] == "stopped", summary
    assert f"rollout worker 0 (pid {killed[0]}) died" in summary["error"]
    assert "killed by SIGKILL" in summary["error"] and "rollout.on_worker_death=stop" in summary["error"]
    assert (Path(cfg.run_dir) / "checkpoints" / f"step_{summary['steps']}").exists()
    summary = Trainer(cfg, resume=True).run()
    assert summary["status"] == "completed"
    _check_nothing_lost(cfg.run_dir, 5, 1)


def test_drop_policy_counts_drops_and_stays_within_the_bound(make_cfg):
    cfg = make_cfg("buffer.mode=async", "buffer.staleness=0", "buffer.on_stale=drop", "buffer.max_ahead=2",
                   "trainer.steps=4")
    summary = Trainer(cfg).run()
    assert summary["status"] == "completed"
    rows = _rows(cfg.run_dir)[1:]
    assert [r["offpolicy/generated_at"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert all(r["offpolicy/staleness_max"] == 0.0 for r in rows)
    assert rows[-1]["offpolicy/dropped"] > 0


def test_two_trainer_processes_with_their_workers(tmp_path):
    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "offpolicy_moe", "train",
           str(_yaml(tmp_path, run_dir, "trainer.steps=3"))]
    res = subprocess.run(cmd, env=dict(_env(), ACCELERATE_USE_CPU="true"), capture_output=True, text=True,
                         timeout=500)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    _check_nothing_lost(run_dir, 3, 1)
