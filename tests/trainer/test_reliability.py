"""Issue 13, the training loop: gradients cleared between phases, divergence caught after the optimizer step,
graceful stop on SIGINT/SIGTERM, one live run per folder.  Tiny CPU runs (one thread, deterministic)."""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from offpolicy_moe.config.load import to_yaml
from offpolicy_moe.trainer.callbacks import FunctionCallback
from offpolicy_moe.run.run_dir_checks import RunDirError
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.trainer.launch import train
from offpolicy_moe.trainer.optim import adamw
from offpolicy_moe.run.run_lock import RunLock
from offpolicy_moe.trainer.sft import sft_warm_start
from offpolicy_moe.run.signals import RunInterrupted, graceful_stop
from offpolicy_moe.trainer.step_guard import StepGuard, max_abs
from offpolicy_moe.trainer.trainer import Trainer
from offpolicy_moe.tasks import RewardScores, make_task
from tests.kill import Hold
from tests.trainer.test_trainer import final_weights, read_metrics, strip_perf
from tests.tiny import free_port, tiny_config, tiny_policy

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO))
SFT = ("trainer.sft_warmup_steps=2", "trainer.sft_batch_size=8", "trainer.threads=1")


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------------------------
# 1. gradients never cross from the SFT warm start into the first RL update


def test_sft_warm_start_leaves_no_gradient():
    task = make_task(tiny_config("/nonexistent").task)
    model, tok = tiny_policy(task=task)
    sft_warm_start(model, tok, task, steps=2, batch_size=4)
    assert all(p.grad is None for p in model.parameters())


def test_zero_advantages_give_zero_gradient_after_sft(make_cfg, monkeypatch):
    tr = Trainer(make_cfg(*SFT, "trainer.steps=1", "algo.kl.coef=0", "algo.routing.replay=none"))
    # every reward 0 (the trainer scores through task.score, so the patch goes there)
    monkeypatch.setattr(tr.task, "score", lambda completions, answers, **context: RewardScores([0.0] * len(completions)))
    assert tr.run()["status"] == "completed"
    step1 = read_metrics(tr.cfg.run_dir)[1]
    assert step1["reward/adv_abs_mean"] == 0.0
    assert step1["actor/grad_norm"] == 0.0       # was ~0.5: the last SFT gradient


def test_resume_from_the_step0_checkpoint_is_bit_identical(make_cfg, tmp_path):
    over = (*SFT, "trainer.steps=2", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0")
    seen = {}
    cfg = make_cfg(*over)
    train(cfg, callbacks=[FunctionCallback(on_step_end=lambda tr, s, m: seen.update({s: weights_of(tr.unwrapped)}))])
    d = tmp_path / "from_step0"                   # the run as a kill right after the step_0 checkpoint leaves it
    shutil.copytree(cfg.run_dir, d)
    for p in (d / "checkpoints").iterdir():
        if p.name != "step_0":
            shutil.rmtree(p)
    (d / "summary.json").unlink()
    got = {}
    cfg2 = make_cfg(*over, run_dir=d)
    summary = train(cfg2, resume=True,
                    callbacks=[FunctionCallback(on_step_end=lambda tr, s, m: got.update({s: weights_of(tr.unwrapped)}))])
    assert summary["status"] == "completed"
    assert same(got[1], seen[1]) and same(got[2], seen[2])
    assert strip_perf(read_metrics(d)) == strip_perf(read_metrics(cfg.run_dir))


# ---------------------------------------------------------------------------------------------------------------
# 3. divergence: parameters checked after the optimizer step


def test_step_guard_restores_weights_and_optimizer_state_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = adamw(model.parameters(), lr=1e-2)
    guard = StepGuard(opt)
    x = torch.randn(16, 4)

    def step():
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()

    step()                                        # optimizer state exists
    twin, twin_opt = copy.deepcopy(model), None
    twin_opt = adamw(twin.parameters(), lr=1e-2)
    twin_opt.load_state_dict(opt.state_dict())
    guard.snapshot()
    opt.param_groups[0]["lr"] = 1e39              # a real divergence: the next step leaves NaN/inf parameters
    step()
    assert not torch.isfinite(max_abs(list(model.parameters())))
    guard.restore()
    assert opt.param_groups[0]["lr"] == 1e-2
    assert same(model.state_dict(), twin.state_dict())
    for p, q in zip(model.parameters(), twin.parameters()):
        a, b = opt.state[p], twin_opt.state[q]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    step()                                        # and training continues exactly as without the bad step
    opt, model = twin_opt, twin
    step()
    assert same(model.state_dict(), twin.state_dict())


def test_max_abs_is_finite_iff_every_element_is():
    big = torch.full((3,), 3e38)
    assert torch.isfinite(max_abs([big, torch.zeros(2)]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not torch.isfinite(max_abs([big, torch.tensor([0.0, bad])]))


def test_divergence_is_skipped_with_weights_and_optimizer_restored(make_cfg):
    tr = Trainer(make_cfg("optim.lr=1e39", "trainer.on_nan=skip", "trainer.steps=2", "trainer.threads=1"))
    w0 = weights_of(tr.unwrapped)
    summary = tr.run()
    assert summary["status"] == "completed"
    rows = read_metrics(tr.cfg.run_dir)[1:]
    assert [r["actor/nan_skipped"] for r in rows] == [1.0, 2.0]
    assert [r["actor/updates"] for r in rows] == [0.0, 0.0]
    assert same(weights_of(tr.unwrapped), w0)     # every update diverged and was undone
    assert not tr.optimizer.state                 # the optimizer state of before the first step: none


def test_divergence_stops_with_a_checkpoint_of_the_last_good_state(make_cfg):
    cfg = make_cfg("optim.lr=1e39", "trainer.on_nan=stop", "trainer.steps=2", "trainer.threads=1")
    tr = Trainer(cfg)
    w0 = weights_of(tr.unwrapped)
    with pytest.raises(NonFiniteError, match="parameters after the optimizer step at step 1.*checkpointed"):
        tr.run()
    summary = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert summary["status"] == "diverged" and "parameters" in summary["error"]
    back = Trainer(cfg, resume=True)
    try:
        back.load(back.run_dir.latest_checkpoint())
        assert back.step == 0 and back.iteration == 0
        assert same(weights_of(back.unwrapped), w0)
        assert not back.optimizer.state
    finally:
        back.run_dir.close()


# ---------------------------------------------------------------------------------------------------------------
# 4. SIGINT / SIGTERM: checkpoint at the stop, status stopped, one line, rc 128 + signal, bit-identical resume


SIG = ("buffer.staleness=1", "trainer.steps=5", "trainer.threads=1", "trainer.checkpoint_every=0",
       "algo.routing.replay=r3", "rollout.dtype=bfloat16", "algo.correction.mode=truncate")


@pytest.fixture(scope="module")
def signal_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("sigref") / "run"
    assert train(tiny_config(d, *SIG))["status"] == "completed"
    return d


def wait_for(cond, proc, what, timeout=180):
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"exited before {what}: " + proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def metrics_steps(run_dir) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in open(Path(run_dir) / "metrics.jsonl") if line.endswith("\n")]
    except (OSError, ValueError):
        return []


@pytest.mark.parametrize("sig,rc", [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_signal_stops_with_checkpoint_then_resume_is_bit_identical(signal_reference, tmp_path, sig, rc):
    run_dir = tmp_path / "run"
    (tmp_path / "cfg.yaml").write_text(to_yaml(tiny_config(run_dir, *SIG)))
    cmd = [sys.executable, "-m", "offpolicy_moe", "train", str(tmp_path / "cfg.yaml")]
    # mid-run: the run is held in step 2 (tests/kill.py) until the signal is sent, so it cannot end first
    hold = Hold(tmp_path, 2)
    proc = subprocess.Popen(hold.command(cmd[3:]), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    hold.wait(proc, 180, tail=2000)
    assert metrics_steps(run_dir) == [0, 1]
    proc.send_signal(sig)
    hold.release()
    err = proc.communicate(timeout=120)[1].decode()
    assert proc.returncode == rc, err[-2000:]
    assert "Traceback" not in err
    line = [x for x in err.splitlines() if "stopped by" in x]
    assert len(line) == 1 and signal.Signals(sig).name in line[0] and "--resume" in line[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["status"] == "stopped" and stopped_at == 2       # at the boundary after the signal's step
    assert (run_dir / "checkpoints" / f"step_{stopped_at}").is_dir()       # checkpoint_every=0: the stop's own
    res = subprocess.run(cmd + ["--resume"], env=ENV, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    assert strip_perf(rows) == strip_perf(read_metrics(signal_reference))
    ref, got = final_weights(signal_reference, 5), final_weights(run_dir, 5)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_graceful_stop_records_the_first_signal_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with graceful_stop() as req:
        assert not req.requested
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10           # Python runs the handler soon after the signal: wait for it
        while not req.requested and time.monotonic() < deadline:
            time.sleep(0.001)
        assert req.requested and req.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):    # a second signal stops at once ...
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 10       # ... as soon as its handler runs (else: DID NOT RAISE)
            while time.monotonic() < deadline:
                time.sleep(0.001)
    assert signal.getsignal(signal.SIGTERM) is before
    exc = RunInterrupted(signal.SIGINT, 3, "ck/step_3")
    assert exc.exit_code == 130 and "SIGINT" in str(exc) and "\n" not in str(exc)


# ---------------------------------------------------------------------------------------------------------------
# 5. one live run per folder


def test_lock_is_exclusive_and_names_its_holder(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(RunDirError, match=f"in use by process {os.getpid()} on host {socket.gethostname()}"):
            RunLock(tmp_path).acquire()
    with RunLock(tmp_path) as again:               # released at the end of the first
        assert again.held


def test_two_concurrent_starts_are_refused_and_a_killed_run_releases_the_folder(tmp_path):
    run_dir = tmp_path / "run"
    # far more steps than the test lasts (it kills the run): 200 steps could finish before the second start
    cfg = tiny_config(run_dir, "trainer.steps=1000000", "trainer.threads=1")
    (tmp_path / "cfg.yaml").write_text(to_yaml(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "offpolicy_moe", "train", str(tmp_path / "cfg.yaml")], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: f'"pid": {proc.pid}' in ((run_dir / ".lock").read_text() if (run_dir / ".lock").exists()
                                                 else ""), proc, "the lock")
        for resume in (False, True):             # a second start, and a --resume while the first runs
            with pytest.raises(RunDirError, match=f"in use by process {proc.pid} on host "):
                Trainer(tiny_config(run_dir, "trainer.steps=200"), resume=resume)
        res = subprocess.run([sys.executable, "-m", "offpolicy_moe", "train", str(tmp_path / "cfg.yaml")], env=ENV,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and f"process {proc.pid}" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with RunLock(run_dir) as lock:                  # the OS released the killed run's lock
        assert lock.held


def test_step_guard_on_an_fsdp2_sharded_model(monkeypatch):
    """FSDP2 over gloo with one process (as tests/run/test_full_state.py): the guard works on local shards."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        x = torch.randn(5, 4)

        def step(inputs):
            model(inputs).pow(2).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step(x)
        guard = StepGuard(opt)
        guard.snapshot()
        before = [p.to_local().clone() for p in model.parameters()]
        moments = [opt.state[p]["exp_avg"].to_local().clone() for p in model.parameters()]
        step(x * float("inf"))                       # NaN gradients: NaN parameters after the step
        assert not torch.isfinite(guard.params_max_abs())
        guard.restore()
        assert torch.isfinite(guard.params_max_abs())
        assert all(torch.equal(p.to_local(), b) for p, b in zip(model.parameters(), before))
        assert all(torch.equal(opt.state[p]["exp_avg"].to_local(), m) for p, m in zip(model.parameters(), moments))
    finally:
        dist.destroy_process_group()
