"""sources/fork_server.py: which runs start the local workers' fork server early, that starting it really starts a
server that imports the worker module, that ``offpolicy-moe train`` starts it before its checks and model load
(never on ``--dry-run``), and that a :class:`Trainer` built from Python starts it after its checks, before its
model load."""
from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

import pytest

from offpolicy_moe.commands import train as train_cmd
from offpolicy_moe.config.load import load_config
from offpolicy_moe.sources import fork_server

ASYNC = ["buffer.mode=async", "buffer.staleness=1", "rollout.workers=1"]


@pytest.mark.parametrize("overrides, wanted", [
    (ASYNC, True),
    ([*ASYNC, "rollout.early_start=false"], False),
    ([*ASYNC, "rollout.backend=ray"], False),
    (["buffer.mode=fixed", "buffer.staleness=1"], False),
    (["buffer.mode=bounded", "buffer.staleness=2"], False),
])
def test_only_local_async_runs_with_early_start_want_the_server_early(overrides, wanted):
    assert fork_server.wants_early_start(load_config(None, overrides)) is wanted


def test_starting_early_starts_a_server_that_imports_the_worker_module(tmp_path):
    """In a fresh interpreter: a synchronous config starts nothing; an asynchronous one starts the server, and a
    second call keeps it; a worker forked from it finds the worker module imported already (the server's
    preload)."""
    code = textwrap.dedent("""
        import sys
        from multiprocessing import forkserver
        from offpolicy_moe.config.load import load_config
        from offpolicy_moe.sources import fork_server

        def preloaded(q):
            q.put("offpolicy_moe.rollout.worker" in sys.modules)

        if __name__ == "__main__":
            assert fork_server.start_early(load_config(None, ["buffer.mode=fixed"])) is False
            assert forkserver._forkserver._forkserver_pid is None
            assert fork_server.start_early(load_config(None, ["buffer.mode=async", "rollout.workers=1"])) is True
            pid = forkserver._forkserver._forkserver_pid
            assert pid is not None
            fork_server.start_early(load_config(None, ["buffer.mode=async", "rollout.workers=1"]))
            assert forkserver._forkserver._forkserver_pid == pid
            ctx = fork_server.context()
            q = ctx.Queue()
            p = ctx.Process(target=preloaded, args=(q,))
            p.start()
            print(q.get(timeout=60))
            p.join()
    """)
    script = tmp_path / "probe.py"          # a file: the forked child unpickles its target from it
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True"]


def _args(*overrides: str, dry_run: bool = False) -> argparse.Namespace:
    return argparse.Namespace(config=None, overrides=list(overrides), resume=False, force_change=False, run_dir=None,
                              preset=[], print_config=False, dry_run=dry_run, quiet=True)


@pytest.mark.parametrize("dry_run", [False, True])
def test_train_starts_the_server_before_its_checks_and_never_on_a_dry_run(monkeypatch, tmp_path, dry_run):
    import offpolicy_moe.trainer.checks as checks

    order = []
    real_check = checks.check_config
    monkeypatch.setattr(fork_server, "start_early", lambda cfg: order.append(("start", cfg.buffer.mode)))
    monkeypatch.setattr(checks, "check_config", lambda cfg: order.append(("check", None)) or real_check(cfg))
    train_cmd.resolve(_args(*ASYNC, f"run_dir={tmp_path / 'run'}", dry_run=dry_run))
    assert order == ([("check", None)] if dry_run else [("start", "async"), ("check", None)])


def test_a_trainer_built_from_python_starts_the_server_after_its_checks_before_its_model(monkeypatch, tmp_path):
    import offpolicy_moe.trainer.build as build_mod
    import offpolicy_moe.trainer.trainer as trainer_mod
    from tests.tiny import tiny_config

    order = []
    real_load = build_mod.load_policy
    monkeypatch.setattr(fork_server, "start_early", lambda cfg: order.append(("start", cfg.buffer.mode)))
    monkeypatch.setattr(build_mod, "load_policy", lambda *a, **k: order.append(("model", None)) or real_load(*a, **k))
    trainer_mod.Trainer(tiny_config(tmp_path / "run", "buffer.mode=async", "buffer.staleness=1", "rollout.workers=1"))
    assert order == [("start", "async"), ("model", None)]
