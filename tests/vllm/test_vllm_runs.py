"""``offpolicy-moe train ... rollout.engine=vllm`` through the command line: synchronous, asynchronous (rollout
worker processes) and Ray runs, the mismatch measured against the real engine, R3 on its routes, and the engine
process killed in the middle of a run (in this process, by a step-end callback)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from offpolicy_moe.config.load import load_config
from offpolicy_moe.rollout.vllm_engine import SHARED_THREADS, engine_processes
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.trainer.trainer import Trainer
from tests.refusals import error_lines

pytestmark = pytest.mark.vllm

# a short job on the embedded model's vLLM variant: bf16 engine, fp32 trainer (the real mismatch), R3 + TIS
JOB = ["rollout.engine=vllm", "rollout.dtype=bfloat16", "preset=[grpo,tis,r3]",
       "rollout.prompts_per_step=8", "rollout.group_size=4", "trainer.sft_warmup_steps=5", "trainer.eval_every=0",
       "task.eval_size=16", "logging.progress=false", "logging.loggers=[jsonl]", "trainer.min_free_mb=1"]


def _train(run_dir: Path, *overrides: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    return subprocess.run([sys.executable, "-m", "offpolicy_moe", "train", *JOB, *overrides, "--run-dir",
                           str(run_dir)], capture_output=True, text=True, timeout=timeout, env=env)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _train_rows(run_dir: Path) -> list[dict]:
    return [r for r in _rows(run_dir) if "mismatch/k3_kl" in r]


def test_a_synchronous_run_measures_the_real_mismatch_and_r3_replays_every_route(tmp_path):
    run = tmp_path / "sync"
    out = _train(run, "trainer.steps=4")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["mismatch/k3_kl"] > 0 for r in rows)                   # a bf16 vLLM engine is not the trainer
    assert all(r["routing/replay_fallback"] == 0.0 for r in rows)        # every scored position replayed
    assert all(r["routing/replay_decisions"] > 0 for r in rows)
    r3 = sum(r["mismatch/k3_kl_r3"] for r in rows)
    plain = sum(r["mismatch/k3_kl_no_r3"] for r in rows)
    assert r3 < plain, (r3, plain)                                      # R3 on vLLM's routes lowers the KL


def test_an_asynchronous_run_with_rollout_workers(tmp_path):
    run = tmp_path / "async"
    out = _train(run, "trainer.steps=4", "buffer.mode=async", "buffer.staleness=1")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["routing/replay_fallback"] == 0.0 for r in rows)
    assert max(r["offpolicy/staleness_steps"] for r in rows) <= 1


def test_a_ray_run(tmp_path):
    pytest.importorskip("ray")
    run = tmp_path / "ray"
    out = _train(run, "trainer.steps=3", "buffer.mode=async", "buffer.staleness=1", "rollout.backend=ray")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in _train_rows(run)] == [1, 2, 3]


def test_the_engine_killed_mid_run_is_restarted_and_every_step_trains_once(tmp_path):
    """The engine process is SIGKILLed at the end of step 2 (the trainer's own callback, so on any CPU the kill
    lands with steps 3-6 still to generate); the next generation restarts it and the run trains every step once."""
    cfg = load_config(None, JOB + ["trainer.steps=6"])
    cfg.run_dir = str(tmp_path / "killed")
    killed: list[int] = []

    def kill_engine(trainer, step: int, metrics) -> None:
        if step == 2:
            for p in engine_processes(trainer.engine.llm):
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)

    trainer = Trainer(cfg, callbacks=[FunctionCallback(on_step_end=kill_engine)])
    summary = trainer.run()
    assert killed, "no engine process at step 2"
    assert summary["status"] == "completed", summary.get("error")
    assert trainer.engine.restarts == 1
    assert [r["step"] for r in _train_rows(Path(cfg.run_dir))] == [1, 2, 3, 4, 5, 6]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in killed)


def test_a_finished_run_leaves_no_vllm_client_thread_running(tmp_path):
    """A thread of vLLM's client still inside native code when the interpreter finalizes is unwound by force, which
    aborts the process (exit code -6, "terminate called without an active exception") after a run that finished:
    the run closes its engine, and the client's threads have ended when ``run`` returns."""
    cfg = load_config(None, JOB + ["trainer.steps=1", "trainer.sft_warmup_steps=0"])
    cfg.run_dir = str(tmp_path / "closed")
    before = {t.ident for t in threading.enumerate()}
    trainer = Trainer(cfg)
    started = [t for t in threading.enumerate() if t.ident not in before and t.name not in SHARED_THREADS]
    assert started, "the vLLM engine started no client thread: nothing to check"
    assert trainer.run()["status"] == "completed"
    assert [t.name for t in started if t.is_alive()] == []
    assert trainer.engine.llm is None                                   # closed by the run


@pytest.mark.parametrize("attempt", range(3))
def test_a_finished_vllm_run_exits_0(tmp_path, attempt):
    """The command line's exit code after a finished run, asked again (the abort at exit was intermittent)."""
    out = _train(tmp_path / "run", "trainer.steps=1", "trainer.sft_warmup_steps=0", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "terminate called" not in out.stderr


@pytest.mark.parametrize("mode", [(), ("buffer.mode=async", "buffer.staleness=1"),
                                  ("buffer.mode=stream", "buffer.staleness=1"),
                                  ("buffer.mode=async", "buffer.staleness=1", "rollout.backend=ray")],
                         ids=["sync", "async", "stream", "ray"])
@pytest.mark.parametrize("override, names", [("model.head_dim=16", "head_dim >= 32"),
                                             ("rollout.top_p=0.9", "rollout.top_p")])
def test_a_config_vllm_cannot_serve_is_refused_before_any_worker_starts(tmp_path, mode, override, names):
    """In every mode the trainer's own checks refuse it in one line, in a real start: no engine, worker or actor is
    started (the run ends before its folder gets a metric, and no engine process outlives it)."""
    run = tmp_path / "refused"
    out = _train(run, override, "trainer.steps=2", *mode, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and names in lines[0], out.stderr[-2000:]
    assert not _rows(run)


def test_sampled_evaluation_on_vllm_and_the_eval_command_give_the_same_numbers(tmp_path):
    """``eval.samples`` under ``rollout.engine=vllm``: the run's evaluation samples with a vLLM engine of its own,
    and ``offpolicy-moe eval`` on the last checkpoint, building the same engine from the run's config, gives every
    ``eval/*`` number the run logged at that step."""
    run = tmp_path / "run"
    out = _train(run, "trainer.steps=2", "eval.samples=4", "trainer.checkpoint_every=1")
    assert out.returncode == 0, out.stderr[-3000:]
    logged = [r for r in _rows(run) if "eval/avg@4" in r]
    assert [r["step"] for r in logged] == [0, 2]
    record = tmp_path / "eval.json"
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR")
    done = subprocess.run([sys.executable, "-m", "offpolicy_moe", "eval", str(run), "--samples", "4", "--out",
                           str(record)], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(record.read_text())
    assert result["settings"]["engine"] == "vllm"
    metrics = result["metrics"]
    shared = [k for k in metrics if k.startswith("eval/") and k in logged[-1]]
    assert {"eval/avg@4", "eval/pass@4", "eval/maj@4", "eval/accuracy"} <= set(shared)
    assert {k: metrics[k] for k in shared} == {k: logged[-1][k] for k in shared}
