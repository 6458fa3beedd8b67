"""Test helpers that kill a run, or one of its rollout workers, part-way through.

A run that a test kills (or signals) from outside is started *held* (:class:`Hold`): a probe of the step's test seam
(:mod:`offpolicy_moe.run.probes`) that changes no value stops the trainer at the loss of a chosen step, says so in a
file, and waits there until the test has done its deed (SIGKILL) or releases it.  The tiny run's steps take tens of
milliseconds, so a run left to go on can finish between the moment the test sees a checkpoint and its kill: the hold
makes the point where the run is killed an event, not a race with the machine's speed."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]

#: how long a held run waits for its test (which kills or releases it at once) before it gives up and fails: only a
#: test that died before doing either leaves a run held that long
HOLD_LIMIT_S = 600.0

_HELD_MAIN = "import sys\nfrom tests.kill import held_main\nsys.exit(held_main(sys.argv[1:]))\n"


class HoldProbe:
    """A probe (:class:`offpolicy_moe.run.probes.Probe`) that changes nothing and, the first time the trainer reaches
    the ``loss`` point of trained step ``step``, writes ``reached`` and waits until ``release`` exists (at most
    ``limit_s`` seconds, then raises).  It hands nothing on to the rollout workers."""

    def __init__(self, step: int, reached: Path, release: Path, limit_s: float = HOLD_LIMIT_S):
        self.step, self.reached, self.release, self.limit_s = int(step), Path(reached), Path(release), limit_s
        self.done = False

    def poisoned(self, stage, step, model):  # noqa: ARG002 - the probe's signature
        return contextlib.nullcontext(False)

    def value(self, stage, step, x):
        if stage == "loss" and int(step) == self.step and not self.done:
            self.done = True
            self._hold()
        return x

    def poison_(self, stage, step, tensor) -> bool:  # noqa: ARG002
        return False

    def handoff(self):
        return None

    def _hold(self) -> None:
        tmp = self.reached.with_name(self.reached.name + ".tmp")
        tmp.write_text(str(os.getpid()))
        os.replace(tmp, self.reached)
        deadline = time.monotonic() + self.limit_s
        while not self.release.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"held at the loss of step {self.step} for {self.limit_s:.0f} s: the test neither "
                                   "killed nor released the run")
            time.sleep(0.01)


def held_main(argv: Sequence[str]) -> int:
    """``python -c _HELD_MAIN STEP REACHED RELEASE <offpolicy_moe CLI arguments>``: the CLI with a
    :class:`HoldProbe` installed."""
    from offpolicy_moe.cli import main
    from offpolicy_moe.run import probes

    step, reached, release, *cli = argv
    probes.install(HoldProbe(int(step), Path(reached), Path(release)))
    return main(cli)


class Hold:
    """A run held at the loss of trained step ``step``; ``folder`` keeps the files through which it says it is held
    (``reached``) and is released (``release_file``)."""

    def __init__(self, folder: Path, step: int):
        self.step = int(step)
        self.reached = Path(folder) / f"held_at_step_{self.step}"
        self.release_file = Path(folder) / f"release_step_{self.step}"

    def command(self, cli_args: Sequence[str]) -> list[str]:
        """The command running ``python -m offpolicy_moe <cli_args>`` held here."""
        return [sys.executable, "-c", _HELD_MAIN, str(self.step), str(self.reached), str(self.release_file),
                *map(str, cli_args)]

    def wait(self, proc: subprocess.Popen, timeout: float, tail: int = 3000) -> None:
        """Return once ``proc`` holds here; the assertion names why when it ends first or ``timeout`` seconds pass
        (``proc`` is killed then)."""
        deadline = time.monotonic() + timeout
        try:
            while not self.reached.exists():
                assert proc.poll() is None, f"the run ended before step {self.step}: " + \
                    proc.stderr.read().decode()[-tail:]
                assert time.monotonic() < deadline, f"the run did not reach step {self.step} in {timeout:.0f} s"
                time.sleep(0.02)
        except AssertionError:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise

    def release(self) -> None:
        """Let the held run go on."""
        self.release_file.touch()


def train_env() -> dict:
    """The environment of a training child process (one thread, no wandb, this checkout importable)."""
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO))


def train_until_checkpoint(cfg_path: Path, run_dir: Path, step: int, timeout: float,
                           tail: int = 3000, env: Optional[dict] = None) -> tuple[subprocess.Popen, list[str], dict]:
    """``offpolicy_moe train cfg_path`` in a child process, returned once ``run_dir`` holds the checkpoint of
    ``step`` and the run is held at the loss of step ``step + 1`` (:class:`Hold`): it cannot end, nor write another
    checkpoint, before the caller kills it (the assertion names why when the child ends first or ``timeout``
    seconds pass); also the plain command and the environment, for the ``--resume`` that follows."""
    env = train_env() if env is None else env
    cmd = [sys.executable, "-m", "offpolicy_moe", "train", str(cfg_path)]
    hold = Hold(Path(run_dir).parent, step + 1)
    proc = subprocess.Popen(hold.command(["train", str(cfg_path)]), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    hold.wait(proc, timeout, tail)
    try:
        assert (Path(run_dir) / "checkpoints" / f"step_{step}").is_dir(), f"no checkpoint of step {step}"
        assert not (Path(run_dir) / "checkpoints" / f"step_{step + 1}").exists()
    except AssertionError:
        proc.kill()
        proc.wait()
        raise
    return proc, cmd, env


def kill_first_worker_after(step: int, killed: list[int]) -> Callable:
    """An ``on_step_end`` callback that SIGKILLs the trainer's first rollout worker at the end of ``step`` and
    appends its pid to ``killed``."""

    def kill(trainer, at: int, metrics) -> None:
        if at == step:
            pid = trainer.source.worker_pids()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return kill
