"""The slot sampler's decode of the occupied rows gives, bit for bit, what the full-slot decode gave.

``tests/data/slot_sampler_reference.json`` holds the tokens, float32 log-probs (exact: a float32 read back from its
``repr``), versions, routes and return order that the sampler produced BEFORE it decoded only the occupied rows
(every slot was fed, free ones a pad token: offpolicy_moe/rollout/slots.py of commit 52887d7), on the cases of
:data:`CASES`, one thread, as the test session runs.  ``PYTHONPATH=. python tests/streaming/test_slots_exact.py``
rewrites it from the code of the day (only ever from a sampler known to be right).  The same cases also run the
sampler's own full-slot mode (``free_rows=None``), which the benchmark compares with.

Bits depend on the CPU's BLAS.  The recorded ones are compared bit for bit on the kind of machine that recorded them
(``_machine``: torch version, AVX-512, AMX), and to float32 rounding elsewhere (tokens, versions and routes still
exactly).  The occupied-row decode is compared live with the full-slot mode on every machine: bit for bit where this
machine's sgemm rounds a row alike at every row count of 4 and more (:func:`rows_round_alike`, the premise of
:data:`~offpolicy_moe.rollout.slots.FREE_ROWS`), to rounding where it does not.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from offpolicy_moe.rollout.slots import FREE_ROWS, SlotSampler, StreamSample
from tests.streaming.slot_policy import make_policy

DATA = Path(__file__).resolve().parents[1] / "data" / "slot_sampler_reference.json"
MAX_NEW = 12
ROUNDING = 1e-5           # float32 log-probs of one model on two BLAS kernels


def machine() -> dict:
    """What the recorded bits depend on: the torch build and the CPU's vector units."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return {"torch": torch.__version__, "avx512f": " avx512f" in flags, "amx": " amx_tile" in flags}


def rows_round_alike() -> bool:
    """Whether a row of a float32 ``linear`` comes out the same for every row count ``M >= 4`` at any offset, on the
    model's shapes (the premise of FREE_ROWS; ``M = 1..3`` may round otherwise, the BLAS's choice)."""
    gen = torch.Generator().manual_seed(0)
    for k, n in [(32, 32), (32, 64), (32, 4), (64, 64), (64, 20)]:
        w, x = torch.randn(n, k, generator=gen), torch.randn(130, k, generator=gen)
        full = torch.nn.functional.linear(x, w)
        for m in (4, 5, 7, 16, 33, 100):
            for at in (0, 1, 30 - m % 7):
                if not torch.equal(torch.nn.functional.linear(x[at:at + m], w), full[at:at + m]):
                    return False
    return True

# name -> (slots, groups, samples per group, record_routes, steps between weight syncs (0: none),
#          samples submitted at the start (the rest come in halves at steps 4 and 9))
CASES = {
    "one_slot": (1, 3, 2, True, 0, None),
    "three_slots_versions": (3, 4, 3, True, 3, None),
    "eight_slots_mostly_free": (8, 2, 2, True, 2, None),
    "sixteen_slots_refilled_late": (16, 6, 4, True, 4, 6),
    "five_slots_no_routes": (5, 4, 2, False, 5, None),
}


def make_samples(tok, task, groups: int, per_group: int) -> list[StreamSample]:
    """``groups`` prompts of 3, 5, 7, ... tokens, ``per_group`` samples each with distinct seeds."""
    from offpolicy_moe.tasks import encode_prompts

    rows = task.sample_prompts(0, groups)
    ids, am = encode_prompts(tok, [r["prompt"] for r in rows])
    out = []
    for g in range(groups):
        p = torch.cat([ids[g][am[g].bool()]] * 4)[:3 + 2 * g]
        out += [StreamSample((g, j), p.clone(), 1000 * g + j) for j in range(per_group)]
    return out


def _version_hook(every: int):
    """``between_tokens`` hook: every ``every`` calls, sync weights moved by a seeded perturbation (version + 1)."""
    gen = torch.Generator().manual_seed(3)
    calls = {"n": 0}

    def hook(engine):
        calls["n"] += 1
        if calls["n"] % every == 0:
            with torch.no_grad():
                new = {k: v + 0.05 * v.std().nan_to_num() * torch.randn(v.shape, generator=gen)
                       if v.is_floating_point() and v.numel() > 1 else v.clone()
                       for k, v in engine.model.state_dict().items()}
            engine.sync(new, engine.version + 1)
    return hook


def run_case(policy, name: str, **sampler_kw) -> dict:
    """Run case ``name`` of :data:`CASES` on a fresh engine; ``{"g,j": {tokens, logps, versions, routes}}`` plus
    ``"_order"``, the keys in the order :meth:`SlotSampler.step` returned them."""
    from tests.tiny import rollout_engine

    model, tok, task = policy
    slots, groups, per_group, routes, every, first = CASES[name]
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW, record_routes=routes)
    if every:
        eng.call_between_tokens(_version_hook(every))
    samples = make_samples(tok, task, groups, per_group)
    first = len(samples) if first is None else first
    late = samples[first:]
    sampler = SlotSampler(eng, slots, **sampler_kw)
    sampler.submit(samples[:first])
    out, order, step = {}, [], 0
    while sampler.queued or sampler.active or late:
        if step in (4, 9) and late:
            half = late[:max(1, len(late) // 2)] if step == 4 else late
            sampler.submit(half)
            late = late[len(half):]
        for f in sampler.step():
            key = f"{f.key[0]},{f.key[1]}"
            order.append(key)
            out[key] = {"tokens": f.response_ids.tolist(), "logps": f.behav_logp.tolist(),
                        "versions": f.versions.tolist(),
                        "routes": None if f.routes is None else f.routes.tolist()}
        step += 1
        assert step < 1000
    out["_order"] = order
    return out


def run_cases(policy, **sampler_kw) -> dict:
    """Every case of :data:`CASES` (one thread, as the test session runs)."""
    return {name: run_case(policy, name, **sampler_kw) for name in CASES}


@pytest.fixture(scope="module")
def policy():
    return make_policy()


def _assert_identical(got: dict, ref: dict, name: str, exact: bool = True) -> None:
    """Same keys, same return order, and per sample the same tokens, versions, routes and float32 log-probs
    (``exact``: torch.equal, else within :data:`ROUNDING`)."""
    assert got["_order"] == ref["_order"], name
    for key, r in ref.items():
        if key == "_order":
            continue
        g = got[key]
        assert g["tokens"] == r["tokens"], (name, key)
        a, b = torch.tensor(g["logps"], dtype=torch.float32), torch.tensor(r["logps"], dtype=torch.float32)
        assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=ROUNDING, rtol=0), (name, key)
        assert g["versions"] == r["versions"], (name, key)
        assert g["routes"] == r["routes"], (name, key)


def _recorded() -> tuple[dict, bool]:
    data = json.loads(DATA.read_text())
    return data, data.get("_machine") == machine()


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_are_those_recorded_from_the_full_slot_decode(policy, name):
    ref, same_machine = _recorded()
    _assert_identical(run_case(policy, name), ref[name], name, exact=same_machine)


def test_the_full_slot_mode_gives_the_recorded_outputs_too(policy):
    """``free_rows=None`` feeds every free slot (what the benchmark compares with): the same bits."""
    ref, same_machine = _recorded()
    for name in ("eight_slots_mostly_free", "sixteen_slots_refilled_late"):
        _assert_identical(run_case(policy, name, free_rows=None), ref[name], name, exact=same_machine)


@pytest.mark.parametrize("name", list(CASES))
def test_the_occupied_rows_decode_what_the_full_slot_decode_does_on_this_machine(policy, name):
    """Live, on the machine running the suite: bit for bit where its sgemm rounds rows alike from 4 rows up (the
    premise of FREE_ROWS), to float32 rounding where it does not."""
    _assert_identical(run_case(policy, name), run_case(policy, name, free_rows=None), name,
                      exact=rows_round_alike())


@pytest.mark.parametrize("free_rows", [FREE_ROWS, 0, None])
def test_a_decode_feeds_the_occupied_rows_and_at_most_free_rows_others(policy, free_rows):
    """Each decode forward feeds ``n + min(slots - n, free_rows)`` rows (``n`` occupied after the step's draws),
    over the full-slot decode's columns."""
    from tests.tiny import rollout_engine

    model, tok, task = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW)
    fed = []
    hook = eng.model.register_forward_pre_hook(
        lambda m, a, kw: fed.append((kw["input_ids"].shape, kw["attention_mask"].shape[1])), with_kwargs=True)
    sampler = SlotSampler(eng, 16, free_rows=free_rows)
    sampler.submit(make_samples(tok, task, 5, 2))
    occupied = []
    try:
        while sampler.queued or sampler.active:
            before = len(fed)
            sampler.step()
            decodes = [f for f in fed[before:] if f[0][1] == 1]
            assert len(decodes) <= 1
            if decodes:
                (rows, _), cols = decodes[0]
                n = sampler.active
                extra = 16 - n if free_rows is None else min(16 - n, free_rows)
                assert rows == n + extra and cols == sampler._L
                occupied.append(n)
    finally:
        hook.remove()
    assert max(occupied) == 10 and len(set(occupied)) >= 4      # rows finished at several steps


def test_rows_left_out_of_a_decode_keep_finite_columns(policy):
    """Buffers grow zero-filled and rows beyond the fed ones are never left with uninitialised columns: every buffer
    value stays finite through refills, grows and trims, with the occupied rows alone fed."""
    from tests.tiny import rollout_engine

    model, tok, task = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=30)
    sampler = SlotSampler(eng, 6, free_rows=0)
    sampler.eos = -1                            # every row runs 30 tokens: a long stream of refills
    sampler.submit(make_samples(tok, task, 6, 4))
    while sampler.queued or sampler.active:
        sampler.step()
        for layer in sampler._cache.layers:
            assert bool(torch.isfinite(layer._kbuf).all()) and bool(torch.isfinite(layer._vbuf).all())
    assert sampler.grows >= 1 and sampler.trims >= 1


if __name__ == "__main__":       # record the reference (see the module docstring)
    torch.set_num_threads(1)
    cases = run_cases(make_policy())
    cases["_machine"] = machine()
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps(cases, separators=(",", ":")) + "\n")
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes)", file=sys.stderr)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_free_rows_is_one_line(policy, bad):
    from tests.tiny import rollout_engine

    model, tok, _ = policy
    eng = rollout_engine(model, tok, dtype="float32", max_new_tokens=MAX_NEW)
    with pytest.raises(ValueError, match=r"free_rows >= 0 or None") as err:
        SlotSampler(eng, 4, free_rows=bad)
    assert "\n" not in str(err.value)
