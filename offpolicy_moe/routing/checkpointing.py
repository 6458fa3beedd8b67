"""Gradient checkpointing under routing control: the forward context tapes each router's route (and weight shift)
in call order, the recompute context plays the tape back, so gradients are exact even after the controller's
``with`` block closed.
"""
from __future__ import annotations

import contextlib
from typing import Callable

from .state import OWN_CHOICE, RoutingState

__all__ = ["checkpoint_contexts"]


def checkpoint_contexts(state: RoutingState, active: Callable[[], bool], acquire: Callable[[], None],
                        release: Callable[[], None]):
    """``(forward_ctx, recompute_ctx)`` for one checkpointed call (see the module docstring). ``active()`` says
    whether hooks are installed; ``acquire``/``release`` install and remove them around a recompute."""
    tape: list = []
    seen = {"active": False}

    @contextlib.contextmanager
    def forward_ctx():
        seen["active"] = active()
        prev = state.tape
        state.tape = tape if seen["active"] else None
        try:
            yield
        finally:
            state.tape = prev

    @contextlib.contextmanager
    def recompute_ctx():
        if not seen["active"] or not tape:
            # hooks were off during the forward: the router's own deterministic choice; make sure nothing that is
            # open now (another replay) changes it
            prev = (state.tape_replay, state.tape_pos)
            state.tape_replay, state.tape_pos = OWN_CHOICE, 0
            try:
                yield
            finally:
                state.tape_replay, state.tape_pos = prev
            return
        prev = (state.tape_replay, state.tape_pos, state.tape)
        acquire()
        state.tape_replay, state.tape_pos, state.tape = tape, 0, None
        try:
            yield
        finally:
            state.tape_replay, state.tape_pos, state.tape = prev
            release()

    return forward_ctx(), recompute_ctx()
