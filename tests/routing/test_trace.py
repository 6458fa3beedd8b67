"""RouteTrace: storage, validation errors, layout helpers (checked against loops), save/load."""
import io

import pytest
import torch
from hypothesis import given, settings, strategies as st

from offpolicy_moe.routing import (RouteTrace, TraceValidationError, cat_traces, pack_tokens, repad,
                                   unpack_tokens)


def rand_trace(b=3, s=6, layers=2, k=2, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.stack([torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(layers)])
                                    for _ in range(s)]) for _ in range(b)])
    return RouteTrace.from_ids(ids, e, k, layer_ids=list(range(1, layers + 1)))


def test_storage_dtype_and_sentinel():
    t = rand_trace()
    assert t.ids.dtype == torch.uint8 and t.sentinel == 255
    assert t.nbytes() == 3 * 6 * 2 * 2  # L*K bytes per token
    big = RouteTrace.from_ids(torch.tensor([[[[300, 5]]]]), 400)
    assert big.ids.dtype == torch.int16 and big.sentinel == -1
    ids = torch.tensor([[[[1, 2]], [[-1, -1]]]])
    t2 = RouteTrace.from_ids(ids, 8)
    assert t2.recorded_mask().tolist() == [[True, False]]
    assert t2.long_ids()[0, 1].tolist() == [[-1, -1]]
    with pytest.raises(TypeError, match="uint8"):
        RouteTrace(torch.zeros(1, 1, 1, 2, dtype=torch.int64), 8, 2)
    with pytest.raises(ValueError, match="K=2 but top_k=3"):
        RouteTrace(torch.zeros(1, 1, 1, 2, dtype=torch.uint8), 8, 3)


def test_validate_accepts_good_trace_and_reports_missing():
    t = rand_trace()
    ids = t.long_ids()
    ids[:, -1] = -1
    t = RouteTrace.from_ids(ids, 8)
    rep = t.validate(seq_shape=(3, 6))
    assert rep["missing_frac"] == pytest.approx(1 / 6)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[:, -1] = False
    assert t.validate(mask=mask)["missing_frac"] == 0.0


@pytest.mark.parametrize("case,match", [
    ("shape", r"\(3, 6\) does not match the sequences' shape \(3, 7\)"),
    ("range", "out of range"),
    ("dup", "duplicate expert ids"),
    ("zeros", "broken \\(all-zero\\) capture"),
    ("partial", "partially recorded"),
    ("missing", "not recorded"),
])
def test_validate_refuses_bad_traces(case, match):
    t = rand_trace()
    ids = t.ids.clone()
    kw = {}
    if case == "shape":
        kw["seq_shape"] = (3, 7)
    elif case == "range":
        ids[1, 2, 0, 1] = 8
    elif case == "dup":
        ids[0, 3, 1] = torch.tensor([4, 4], dtype=torch.uint8)
    elif case == "zeros":
        ids[:, :, 1, :] = 0
    elif case == "partial":
        ids[2, 1, 0, 0] = 255
    elif case == "missing":
        ids[:, :4] = 255
    bad = RouteTrace(ids, 8, 2, t.layer_ids)
    with pytest.raises(TraceValidationError, match=match):
        bad.validate(max_missing=0.5, **kw)
    assert issubclass(TraceValidationError, ValueError)


def test_int16_negative_ids_refused():
    ids = torch.full((1, 2, 1, 2), 3, dtype=torch.int16)
    ids[0, 0, 0] = torch.tensor([-5, 2], dtype=torch.int16)
    with pytest.raises(TraceValidationError, match="out of range"):
        RouteTrace(ids, 300, 2).validate()


def _loop_repad(x, mask, side, fill):
    out = torch.full_like(x, fill)
    s = x.shape[1]
    for b in range(x.shape[0]):
        vals = [x[b, j] for j in range(s) if mask[b, j]]
        start = 0 if side == "right" else s - len(vals)
        for j, v in enumerate(vals):
            out[b, start + j] = v
    return out


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=4), st.sampled_from(["left", "right"]), st.integers(0, 99))
def test_repad_pack_unpack_match_loops(lens, side, seed):
    s = 7
    t = rand_trace(b=len(lens), s=s, seed=seed)
    mask = torch.zeros(len(lens), s, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    for b, n in enumerate(lens):  # arbitrary (non-contiguous) valid positions
        mask[b, torch.randperm(s, generator=g)[:n]] = True
    moved, new_mask = t.repad(mask, side)
    assert torch.equal(moved.ids, _loop_repad(t.ids, mask, side, 255))
    assert torch.equal(new_mask.sum(1), mask.sum(1))
    # tokens move identically
    tok = torch.arange(len(lens) * s).view(len(lens), s)
    tok2, m2 = repad(tok, mask, side, -1)
    assert torch.equal(m2, new_mask) and torch.equal(tok2[m2], tok[mask])
    back, back_mask = moved.repad(new_mask, "left" if side == "right" else "right")
    packed, cu = t.pack(mask)
    assert torch.equal(packed.ids[0], t.ids[mask])
    assert cu.tolist() == [0] + torch.cumsum(mask.sum(1), 0).tolist()
    un, um = packed.unpack(cu, side=side, seq_len=s)
    assert torch.equal(un.ids, moved.ids) and torch.equal(um, new_mask)
    assert torch.equal(back.ids[back_mask], t.ids[mask])


def test_pack_tokens_roundtrip_and_errors():
    x = torch.arange(12).view(2, 6)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    p, cu = pack_tokens(x, mask)
    assert p.tolist() == [[0, 1, 2, 6, 7, 8, 9, 10]] and cu.tolist() == [0, 3, 8]
    u, m = unpack_tokens(p, cu, -1, side="left")
    assert u.tolist() == [[-1, -1, 0, 1, 2], [6, 7, 8, 9, 10]]
    with pytest.raises(ValueError, match="cu_seqlens"):
        unpack_tokens(p, torch.tensor([0, 3, 9]), -1)
    with pytest.raises(ValueError, match=r"\(2, 5\) does not match the trace's \[B, S\] = \(2, 6\)"):
        pack_tokens(x, mask[:, :5])


def test_slice_cat_index_select_to_and_save_load():
    a, b = rand_trace(b=2, s=5, seed=1), rand_trace(b=3, s=7, seed=2)
    assert torch.equal(a.slice(2).ids, a.ids[:, 2:]) and torch.equal(a.response(3).ids, a.ids[:, 3:])
    c = cat_traces([a, b], side="left")
    assert c.ids.shape == (5, 7, 2, 2)
    assert torch.equal(c.ids[:2, 2:], a.ids) and bool((c.ids[:2, :2] == 255).all())
    assert torch.equal(c.ids[2:], b.ids)
    idx = torch.tensor([4, 0, 0])
    sel = c.index_select(idx)
    assert torch.equal(sel.ids, torch.stack([c.ids[4], c.ids[0], c.ids[0]]))
    assert c.to("cpu").equal(c)
    buf = io.BytesIO()
    torch.save({"routes": c.state_dict()}, buf)
    buf.seek(0)
    loaded = RouteTrace.from_state_dict(torch.load(buf, weights_only=True)["routes"])
    assert loaded.equal(c) and loaded.layer_ids == (1, 2)
    with pytest.raises(ValueError, match="lacks keys"):
        RouteTrace.from_state_dict({"ids": c.ids})
    with pytest.raises(ValueError, match="num_experts, top_k, layer_ids"):
        cat_traces([a, RouteTrace.from_ids(a.long_ids(), 9)])
