"""The async pipeline's scheduling rules (offpolicy_moe.sources.schedule) on a simulated clock: the real
Dispatcher drives workers and a trainer whose durations, worker deaths and in-flight updates hypothesis draws."""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.sources.schedule import Dispatcher, is_stale, issue_limit, min_version

TOKENS = 3


def _version_at(history: list[tuple[float, int]], t: float) -> int:
    """Newest version published at or before time ``t`` (history sorted by time)."""
    return max(v for when, v in history if when <= t)


def simulate(*, k, policy, ahead, workers, total, gen, train, deaths, in_flight):
    """Run the pipeline to ``total`` trained steps; returns (consumed [(step, iteration, token versions)],
    dispatcher).  ``gen``/``train``: durations drawn in turn; ``deaths``: {event number: worker} killed then."""
    d = Dispatcher(staleness=k, policy=policy, ahead=ahead, total=total, workers=workers)
    history = [(0.0, 0)]
    queues = {w: deque() for w in range(workers)}
    busy: dict = {w: None for w in range(workers)}        # w -> (finish, assignment, start)
    ready: dict = {}
    consumed = []
    trainer = None                                         # (finish, iteration, versions)
    now, n_gen, n_train, events = 0.0, 0, 0, 0

    def issue():
        for a in d.issue(history[-1][1]):
            queues[a.worker].append(a)

    issue()
    while len(consumed) < total:
        events += 1
        assert events < 10_000, "the pipeline made no progress"
        if events in deaths:                                # a worker dies: its queue and current job are lost
            w = deaths[events] % workers
            queues[w].clear()
            busy[w] = None
            d.worker_lost(w)
            issue()
        for w in range(workers):                            # idle workers start their next order if allowed
            if busy[w] is None and queues[w] and history[-1][1] >= queues[w][0].min_version:
                a = queues[w].popleft()
                busy[w] = (now + gen[n_gen % len(gen)], a, now)
                n_gen += 1
        if trainer is None and d.cursor in ready:
            it = d.cursor
            d.release(it)
            trainer = (now + train[n_train % len(train)], it, ready.pop(it))
            n_train += 1
        times = [b[0] for b in busy.values() if b is not None] + ([trainer[0]] if trainer else [])
        assert times, "deadlock: nothing running and nothing startable"
        now = min(times)
        if trainer is not None and trainer[0] == now:
            step = len(consumed)
            consumed.append((step, trainer[1], trainer[2]))
            history.append((now, step + 1))
            trainer = None
            issue()
        for w, b in busy.items():
            if b is not None and b[0] == now:
                finish, a, start = b
                busy[w] = None
                span = finish - start
                versions = [(_version_at(history, start + span * j / TOKENS) if in_flight
                             else _version_at(history, start)) for j in range(TOKENS)]
                if d.accept(w, a.iteration, a.attempt, min(versions)):
                    ready[a.iteration] = versions
                issue()
    return consumed, d


durations = st.lists(st.floats(0.01, 5.0, allow_nan=False), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(k=st.integers(0, 3), policy=st.sampled_from(["wait", "drop"]), ahead=st.integers(0, 3),
       workers=st.integers(1, 3), total=st.integers(1, 12), gen=durations, train=durations,
       deaths=st.dictionaries(st.integers(1, 60), st.integers(0, 2), max_size=3), in_flight=st.booleans())
def test_lag_never_exceeds_k_and_every_iteration_is_trained_once_in_order(k, policy, ahead, workers, total, gen,
                                                                         train, deaths, in_flight):
    consumed, d = simulate(k=k, policy=policy, ahead=ahead, workers=workers, total=total, gen=gen, train=train,
                           deaths=deaths, in_flight=in_flight)
    assert [it for _, it, _ in consumed] == list(range(total))        # no iteration lost, none repeated
    for step, _, versions in consumed:
        assert max(step - v for v in versions) <= k                   # the bound, over every token
        assert all(v <= step for v in versions)                       # never a version from the future
        assert versions == sorted(versions)                           # versions only grow along a sequence
    if policy == "wait":
        assert d.dropped == 0


def test_drop_policy_drops_speculative_batches_and_counts_them():
    # k=0 with 2 iterations handed out ahead: iterations 1 and 2 start on version 0 and are stale at their step
    consumed, d = simulate(k=0, policy="drop", ahead=2, workers=1, total=4, gen=[0.1], train=[1.0], deaths={},
                           in_flight=False)
    assert [it for _, it, _ in consumed] == [0, 1, 2, 3]
    assert d.dropped > 0
    assert all(step - min(v) == 0 for step, _, v in consumed)


def test_wait_policy_hands_out_only_what_the_bound_allows():
    d = Dispatcher(staleness=1, policy="wait", ahead=5, total=10, workers=2)
    assert [(a.iteration, a.min_version) for a in d.issue(0)] == [(0, 0), (1, 0)]
    assert d.issue(0) == []
    assert [(a.iteration, a.min_version, a.worker) for a in d.issue(1)] == [(2, 1, 0)]


def test_stale_and_duplicate_answers_are_not_kept():
    d = Dispatcher(staleness=1, policy="drop", ahead=2, total=10, workers=1)
    [a0, a1, a2, a3] = d.issue(0)
    assert d.accept(0, 3, a3.attempt, oldest_version=0) is False         # 3 - 0 > 1: dropped, re-issued
    assert d.dropped == 1 and d.reissue == [3]
    assert d.accept(0, 0, a0.attempt, 0) is True
    d.release(0)
    assert d.accept(0, 0, a0.attempt, 0) is False                        # consumed already
    again = d.issue(2)
    assert [a.iteration for a in again][0] == 3 and again[0].attempt == 1
    assert d.accept(0, 3, 0, 2) is False                                 # the superseded attempt


def test_restore_reissues_what_was_in_flight():
    d = Dispatcher(staleness=2, policy="wait", ahead=0, total=10, workers=1)
    d.restore(cursor=4, received=[4, 6])
    assert d.cursor == 4 and d.reissue == [5] and d.next_issue == 7
    assert [a.iteration for a in d.issue(4)] == [5]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="on_stale"):
        issue_limit(0, 1, "sometimes")
    with pytest.raises(ValueError, match=">= 0"):
        issue_limit(0, -1)
    with pytest.raises(ValueError, match="at least one worker"):
        Dispatcher(staleness=0, policy="wait", ahead=0, total=1, workers=0)
    d = Dispatcher(staleness=0, policy="wait", ahead=0, total=3, workers=1)
    with pytest.raises(RuntimeError, match="iteration 1, the next one is 0"):
        d.release(1)
    assert min_version(1, 3) == 0 and is_stale(5, 2, 2) and not is_stale(4, 2, 2)


def test_a_retired_worker_gets_no_more_work():
    d = Dispatcher(staleness=4, policy="wait", ahead=2, total=10, workers=2)
    first = d.issue(0)
    assert {a.worker for a in first} == {0, 1}
    with pytest.raises(ValueError, match="worker 1 still has iteration"):
        d.retire(1)                                   # its iterations must be taken back first
    lost = d.worker_lost(1)
    d.retire(1)
    again = d.issue(0)
    assert sorted(a.iteration for a in again) == sorted(lost)     # the lost iterations go to the survivor
    assert {a.worker for a in again} == {0}
