"""Staleness buffer: exact delay line, bounded mode against a brute-force simulation, checkpoint round trip."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.sources.buffer import StalenessBuffer


def fake_batch(version: int, generated_at: int) -> RolloutBatch:
    return RolloutBatch(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
                        response_mask=torch.ones(2, 1, dtype=torch.long), behav_logp=torch.zeros(2, 1),
                        group_ids=torch.zeros(2, dtype=torch.long), answers=["1", "1"], completions=["1", "2"],
                        prompt_len=2, version=version, generated_at=generated_at)


def drive(buf: StalenessBuffer, iterations: int):
    """The trainer's protocol: generate (version = trained steps), push, pop; train advances the version."""
    version, consumed = 0, []
    for it in range(iterations):
        buf.push(fake_batch(version, it), it)
        b, _ = buf.pop(it, version)
        if b is not None:
            consumed.append((version, b.version, b.generated_at, it))
            version += 1
    return consumed


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_fixed_mode_is_an_exact_delay_line(k):
    consumed = drive(StalenessBuffer(k), 20)
    assert len(consumed) == 20 - k
    for t, (step, version, generated_at, it) in enumerate(consumed):
        assert step == t
        assert generated_at == t and it == t + k          # generated at iteration t, consumed k iterations later
        assert version == max(0, t - k)                   # ... by policy version t - k (base model first)


def simulate_bounded(k: int, max_delay: int, seed: int, iterations: int):
    """Independent brute force: arrival = it + delay; drop lag > k; consume the oldest arrived batch."""
    rng = random.Random(seed)
    pending, version, consumed, dropped = [], 0, [], 0
    for it in range(iterations):
        pending.append({"gen": it, "version": version, "arrival": it + rng.randint(0, max_delay)})
        keep = []
        for p in pending:
            if version - p["version"] > k:
                dropped += 1
            else:
                keep.append(p)
        pending = keep
        ready = [p for p in pending if p["arrival"] <= it]
        if ready:
            p = min(ready, key=lambda p: p["gen"])
            pending.remove(p)
            consumed.append((version, p["version"], p["gen"], it))
            version += 1
    return consumed, dropped


@settings(max_examples=30, deadline=None)
@given(k=st.integers(0, 3), max_delay=st.integers(0, 6), seed=st.integers(0, 1000))
def test_bounded_mode_matches_brute_force(k, max_delay, seed):
    buf = StalenessBuffer(k, True, max_delay=max_delay, seed=seed)
    got = drive(buf, 30)
    want, dropped = simulate_bounded(k, max_delay, seed, 30)
    assert got == want
    assert buf.dropped == dropped
    for step, version, _, _ in got:
        assert step - version <= k


def test_bounded_mode_drops_and_counts():
    buf = StalenessBuffer(1, True, max_delay=6, seed=3)
    consumed = drive(buf, 40)
    assert buf.dropped > 0
    gens = [c[2] for c in consumed]
    assert len(gens) == len(set(gens))                    # nothing consumed twice
    assert len(gens) + buf.dropped + len(buf) == 40       # every batch consumed, dropped or still queued


def test_state_dict_round_trip_continues_identically():
    a = StalenessBuffer(2, True, max_delay=4, seed=1)
    drive(a, 7)
    b = StalenessBuffer(2, True, max_delay=4, seed=99)
    b.load_state_dict(a.state_dict())
    assert b.versions() == a.versions() and b.dropped == a.dropped
    for it in range(7, 15):
        for buf in (a, b):
            buf.push(fake_batch(3, it), it)
        ra, _ = a.pop(it, 4)
        rb, _ = b.pop(it, 4)
        assert (ra is None) == (rb is None)
        if ra is not None:
            assert ra.generated_at == rb.generated_at


def test_bad_arguments_and_mismatched_checkpoint():
    with pytest.raises(ValueError, match="staleness"):
        StalenessBuffer(-1)
    with pytest.raises(ValueError, match="random_delay"):
        StalenessBuffer(1, "bounded")
    with pytest.raises(ValueError, match="staleness=3"):
        StalenessBuffer(3).load_state_dict(StalenessBuffer(2).state_dict())


def test_batch_validation_and_selection():
    b = fake_batch(0, 0)
    with pytest.raises(ValueError, match="behav_logp shape"):
        RolloutBatch(**{**b.__dict__, "behav_logp": torch.zeros(2, 2)})
    sel = b.index_select(torch.tensor([1]))
    assert sel.size == 1 and sel.completions == ["2"]
    rt = RolloutBatch.from_state_dict(b.state_dict())
    assert torch.equal(rt.input_ids, b.input_ids) and rt.completions == b.completions
