"""The bounded buffer's feasibility check (``train --dry-run``) agrees with a plain re-statement of the rule."""
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.config import ConfigError, load_config
from offpolicy_moe.sources.buffer import check_buffer_feasible, iteration_budget, steps_within_budget


def reference_steps(k: int, max_delay: int, seed: int, steps: int) -> int:
    """Plain loop: each iteration generates one batch (version = steps trained) arriving after U{0..max_delay};
    batches lagging the trainer by more than k are dropped; the oldest arrived batch is trained on."""
    rng, pending, trained = random.Random(seed), [], 0
    for it in range(steps + k + 10 * steps):
        pending.append((it + rng.randint(0, max_delay), it, trained))     # (arrival, generated_at, version)
        pending = [p for p in pending if trained - p[2] <= k]
        ready = [p for p in pending if p[0] <= it]
        if ready:
            pending.remove(min(ready, key=lambda p: p[1]))
            trained += 1
            if trained == steps:
                break
    return trained


@settings(max_examples=60, deadline=None)
@given(k=st.integers(0, 3), max_delay=st.integers(0, 400), seed=st.integers(0, 2**16), steps=st.integers(1, 30))
def test_simulation_matches_the_plain_rule(k, max_delay, seed, steps):
    mine, ref = steps_within_budget(k, True, max_delay, seed, steps), reference_steps(k, max_delay, seed, steps)
    assert (mine == steps) == (ref == steps)
    assert mine == ref if ref == steps else mine <= ref   # it stops once the rest is out of reach


@settings(max_examples=30, deadline=None)
@given(k=st.integers(0, 4), seed=st.integers(0, 2**16), steps=st.integers(1, 40), data=st.data())
def test_delays_within_staleness_never_starve(k, seed, steps, data):
    max_delay = data.draw(st.integers(0, k))
    assert steps_within_budget(k, True, max_delay, seed, steps) == steps
    assert steps_within_budget(k, False, None, seed, steps) == steps


def test_budget():
    assert iteration_budget(5, 2, False) == 7 and iteration_budget(5, 2, True) == 57


def test_starving_config_is_refused_naming_max_delay():
    cfg = load_config(overrides=["buffer.mode=bounded", "buffer.max_delay=100000", "trainer.steps=5"])
    with pytest.raises(ConfigError, match=r"^buffer\.max_delay=100000: .* trains at most \d of trainer\.steps=5"):
        check_buffer_feasible(cfg)
    check_buffer_feasible(load_config(overrides=["buffer.mode=bounded", "buffer.staleness=1", "buffer.max_delay=3",
                                                 "trainer.steps=5"]))
