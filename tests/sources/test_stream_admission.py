"""The streaming admission rules (sources/admission.py) on a simulated stream: the deadline rule trains every
group within the staleness bound and drops none; the naive first-finished rule drops late (long) groups."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.sources.admission import (Ticket, deadline_choice, first_finished_choice, ks_distance,
                                             may_issue)


def simulate(rule: str, *, per_step: int, k: int, steps: int, durations: list[int]) -> dict:
    """A stream on a clock of ticks: at each publish (version t) new groups are issued up to P (k + 1) outstanding;
    group g completes ``durations[g]`` ticks after it is issued and is sampled by the version published then; the
    trainer asks for a step's groups and advances the clock a tick whenever the rule says wait."""
    tickets: dict[int, Ticket] = {}
    issued_at: dict[int, int] = {}      # group -> version published when issued (= its oldest token's version)
    finish: dict[int, int] = {}
    now = arrivals = nxt = 0
    trained: list[tuple[int, int]] = []         # (step, group)
    dropped: list[int] = []

    def issue(published: int) -> None:
        nonlocal nxt
        for _ in range(may_issue(len(tickets), per_step, k)):
            tickets[nxt] = Ticket(nxt, published + k)
            issued_at[nxt] = published
            finish[nxt] = now + durations[nxt % len(durations)]
            nxt += 1

    def tick() -> None:
        nonlocal now, arrivals
        now += 1
        for g in sorted(tickets, key=lambda g: (finish[g], g)):
            t = tickets[g]
            if t.done is None and finish[g] <= now:
                tickets[g] = Ticket(g, t.deadline, arrivals, issued_at[g])
                arrivals += 1

    issue(0)
    for step in range(steps):
        while True:
            if rule == "deadline":
                choice = deadline_choice(list(tickets.values()), step, per_step)
            else:
                choice = first_finished_choice(list(tickets.values()), step, per_step, k)
                for g in choice.drop:
                    del tickets[g]
                    dropped.append(g)
                if choice.drop:
                    issue(step)
            if not choice.wait:
                break
            tick()
        assert len(choice.train) == per_step
        for g in choice.train:
            assert tickets[g].done is not None, "a group still being generated was trained"
            del tickets[g]
            trained.append((step, g))
        issue(step + 1)
    return {"trained": trained, "dropped": dropped, "issued_at": issued_at, "outstanding": dict(tickets)}


@settings(max_examples=60, deadline=None)
@given(per_step=st.integers(1, 4), k=st.integers(0, 3), seed=st.integers(0, 10_000))
def test_deadline_rule_keeps_every_token_within_the_bound_and_drops_nothing(per_step, k, seed):
    rng = random.Random(seed)
    durations = [rng.choice([1, 1, 1, 2, 3, 15]) for _ in range(50)]      # a long tail of slow groups
    out = simulate("deadline", per_step=per_step, k=k, steps=12, durations=durations)
    assert out["dropped"] == []
    lags = [step - out["issued_at"][g] for step, g in out["trained"]]
    assert max(lags) <= k
    groups = [g for _, g in out["trained"]]
    assert len(groups) == len(set(groups)) == 12 * per_step          # every step trains P groups, each once
    # nothing is lost: every group issued is trained or still outstanding
    assert set(groups) | set(out["outstanding"]) == set(out["issued_at"])


def test_first_finished_drops_the_long_groups_and_biases_the_trained_lengths():
    durations = [1, 1, 1, 12]           # every fourth group is slow (a long answer)
    naive = simulate("first_finished", per_step=2, k=1, steps=20, durations=durations)
    fair = simulate("deadline", per_step=2, k=1, steps=20, durations=durations)
    slow = {g for g in naive["issued_at"] if durations[g % 4] == 12}
    assert naive["dropped"] and set(naive["dropped"]) <= slow
    lengths = lambda out: [durations[g % 4] for _, g in out["trained"]]      # noqa: E731
    generated = [durations[g % 4] for g in naive["issued_at"] if g not in naive["outstanding"]]
    assert ks_distance(lengths(naive), generated) > 0.1
    assert fair["dropped"] == [] and 12 in lengths(fair)
    assert max(step - fair["issued_at"][g] for step, g in fair["trained"]) <= 1


def test_deadline_choice_waits_for_a_due_group_still_being_generated():
    tickets = [Ticket(0, 0), Ticket(1, 0, done=0, oldest_version=0), Ticket(2, 1, done=1, oldest_version=0)]
    choice = deadline_choice(tickets, step=0, per_step=2)
    assert choice.wait and set(choice.train) == {0, 1}
    done = [Ticket(0, 0, done=2, oldest_version=0), *tickets[1:]]
    after = deadline_choice(done, step=0, per_step=2)
    assert not after.wait and set(after.train) == {0, 1}


def test_deadline_choice_fills_from_later_deadlines_when_there_is_slack():
    tickets = [Ticket(0, 2), Ticket(1, 2, done=0, oldest_version=0), Ticket(2, 3, done=1, oldest_version=1)]
    choice = deadline_choice(tickets, step=0, per_step=2)
    assert not choice.wait and choice.train == (1, 2)      # the slow group 0 is due only at step 2


def test_deadline_choice_refuses_a_missed_deadline_or_an_infeasible_set():
    with pytest.raises(ValueError, match="due at step 0, now step 1"):
        deadline_choice([Ticket(0, 0, done=0, oldest_version=0)], step=1, per_step=1)
    with pytest.raises(ValueError, match="3 groups are due"):
        deadline_choice([Ticket(g, 0, done=g, oldest_version=0) for g in range(3)], step=0, per_step=2)


def test_first_finished_takes_arrival_order_and_drops_the_stale():
    tickets = [Ticket(0, 1, done=2, oldest_version=3), Ticket(1, 1, done=0, oldest_version=1),
               Ticket(2, 1, done=1, oldest_version=3), Ticket(3, 1)]
    choice = first_finished_choice(tickets, step=4, per_step=2, staleness=1)
    assert choice.drop == (1,) and choice.train == (2, 0) and not choice.wait


def test_may_issue():
    assert may_issue(0, 4, 1) == 8 and may_issue(7, 4, 1) == 1 and may_issue(9, 4, 1) == 0


@given(st.lists(st.integers(0, 20), max_size=30), st.lists(st.integers(0, 20), max_size=30))
def test_ks_distance_is_the_largest_gap_between_the_empirical_cdfs(a, b):
    if not a or not b:
        assert ks_distance(a, b) == 0.0
        return
    cdf = lambda xs, x: sum(v <= x for v in xs) / len(xs)        # noqa: E731
    brute = max(abs(cdf(a, x) - cdf(b, x)) for x in set(a) | set(b))
    assert ks_distance(a, b) == pytest.approx(brute)
    assert ks_distance(a, a) == 0.0
