"""The ``forkserver`` the local rollout workers are started from, and starting it early.

A worker process is forked from a server that has imported the worker module once (torch, transformers, the
package): restarts and later workers start in a fraction of a second.  The server's own imports take as long as
the trainer's (about 8 s on the project's 2-core VM), and a worker cannot start before they end.  With
``rollout.early_start`` ``offpolicy-moe train`` starts the server as soon as the config is valid (a
:class:`~offpolicy_moe.trainer.trainer.Trainer` built from Python, after its checks), so those imports run on the
second core beside the trainer's own imports, model load and step-0 evaluation instead of after them.  Starting it
changes no computation: the same workers are forked from the same server, only sooner.
"""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver
from typing import Any

from offpolicy_moe.sources.modes import mode_of

__all__ = ["PRELOAD", "context", "start_early", "wants_early_start"]

#: what the server imports once, before it forks any worker
PRELOAD = ("offpolicy_moe.rollout.worker", "offpolicy_moe.rollout.stream_worker", "transformers.modeling_utils", "transformers.generation.utils")


def context() -> Any:
    """The ``forkserver`` multiprocessing context whose server imports :data:`PRELOAD` (it starts no threads, so
    forking it is safe)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def wants_early_start(cfg: Any) -> bool:
    """Whether ``cfg``'s run forks local rollout workers (its mode's ``forks_workers``, ``rollout.backend=local``)
    and starts them early (``rollout.early_start``)."""
    return mode_of(cfg).forks_workers and cfg.rollout.backend == "local" and bool(cfg.rollout.early_start)


def start_early(cfg: Any) -> bool:
    """Start the workers' fork server now when :func:`wants_early_start` (returns whether it asked); the server's
    imports run beside the caller, which does not wait for them.  Idempotent: a running server is kept."""
    if not wants_early_start(cfg):
        return False
    context()
    forkserver.ensure_running()
    return True
