"""RouteTrace.from_vllm / from_sglang on payloads built exactly as each engine's own source builds them.

The routes are real: a tiny DeepSeek-V3 (3 hidden layers, the first dense, 8 experts, top-2) or Qwen3-MoE with 300
experts generates, and ``RoutingController.record`` gives each fed token's expert ids per MoE layer (what the
engine's router capture sees as ``topk_ids``). Each fixture then lays them out as the engine does:

* vLLM >= 0.22 (``_vllm_npy``): ``RoutedExpertsManager`` (``vllm/v1/worker/.../routed_experts``; see
  ``docs/features/routed_experts.md``, "Output Format") keeps a zero-filled slot buffer
  ``(slots, num_hidden_layers, num_experts_per_tok)`` of dtype ``np.uint8`` when ``num_experts <= 256`` else
  ``np.uint16``; only MoE layers are written, so dense layers stay 0; a request gets the rows of its tokens
  ``[routed_experts_prompt_start, num_tokens - 1)``; the HTTP layer sends ``base64(np.save(...))``, which
  ``tests/entrypoints/openai/test_return_routed_experts.py::assert_valid_routed_experts`` reads with
  ``np.load(io.BytesIO(base64.b64decode(...)))``.
* vLLM 0.21 (``_vllm_021``): ``prompt_routed_experts [P, L_moe, K]`` int16 with -1 on prefix-cached rows, plus each
  completion's ``routed_experts`` as nested JSON lists over ``T - 1`` rows (``docs/training/routed_experts_replay.md``
  of 0.21); ``routed_experts=None`` after a preemption.
* vLLM 0.14-0.20 (``_vllm_old``): ``CompletionOutput.routed_experts``, an int32 ndarray ``[S - 1, num_hidden_layers,
  K]`` (``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``, zero-filled buffers).
* SGLang (``_sglang``): ``python/sglang/srt/layers/moe/routed_experts_capturer.py``, ``RoutedExpertsHostCache``
  is ``torch.zeros((tokens, hf num_hidden_layers, num_experts_per_tok), dtype=torch.int32)`` written per MoE layer
  (dense layers stay 0); ``get_routed_experts`` returns rows ``[routed_experts_start_len, seqlen - 1)``;
  ``detokenizer_manager._b64_encode_per_request`` sends ``b64encode(tensor.numpy().tobytes())``; with
  ``skip_tokenizer_init`` the tensor itself (verl ``async_sglang_server.py``). Consumers reshape it to
  ``(len(tokens) - 1, num_layers, top_k)`` (slime ``sglang_rollout.py``).
"""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from offpolicy_moe.routing import RouteTrace, RoutingController, TraceValidationError, cat_traces

from routing_models import make_model

N_HIDDEN = 3


@pytest.fixture(scope="module")
def run():
    """A real generation: (model, ctl, sequence tokens [S], MoE routes [S, L_moe, K] int64 with the last row -1)."""
    model = make_model("deepseek_v3")
    ctl = RoutingController(model)
    assert ctl.layer_ids == (1, 2) and model.config.num_hidden_layers == N_HIDDEN
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ctl.record() as rec:
        seq = model.generate(input_ids=ids, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    trace = rec.trace()
    return model, ctl, seq[0], trace.long_ids()[0], ids.shape[1]


def _all_layers(moe: torch.Tensor, layer_ids, num_hidden_layers: int, dtype) -> np.ndarray:
    """The engine's per-token buffer: zeros ``(rows, num_hidden_layers, K)``, MoE layers written."""
    buf = np.zeros((moe.shape[0], num_hidden_layers, moe.shape[-1]), dtype=dtype)
    buf[:, list(layer_ids)] = moe.numpy().astype(dtype)
    return buf


def _vllm_npy(moe, layer_ids, num_experts, start=0, http=True):
    """vLLM >= 0.22: rows [start, S - 1) of the slot buffer, uint8/uint16, sent as base64 of an .npy file."""
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    rows = _all_layers(moe[start:-1], layer_ids, N_HIDDEN, dtype)
    if not http:
        return rows
    f = io.BytesIO()
    np.save(f, rows)
    return base64.b64encode(f.getvalue()).decode()


def _vllm_021(moe, prompt_len, cached=()):
    """vLLM 0.21: int16 prompt rows (-1 where prefix-cached) and the completion's T - 1 rows as JSON lists."""
    pr = moe[:prompt_len].numpy().astype(np.int16)
    pr[list(cached)] = -1
    return pr, moe[prompt_len:-1].numpy().astype(np.int16).tolist()


def _sglang(moe, layer_ids, start=0, encode=True):
    """SGLang: int32 host rows [start, S - 1) over all hidden layers, base64 of the raw bytes."""
    host = torch.zeros((moe.shape[0] - 1 - start, N_HIDDEN, moe.shape[-1]), dtype=torch.int32)
    host[:, list(layer_ids)] = moe[start:-1].to(torch.int32)
    if not encode:
        return host
    return base64.b64encode(host.numpy().tobytes()).decode()


def _replays_like(model, ctl, seq, want: RouteTrace, got: RouteTrace):
    """The decoded trace equals the recorded one and replays to the same logits."""
    assert torch.equal(got.long_ids(), want.long_ids())
    assert torch.equal(got.tokens.long(), seq[None].long())
    with torch.no_grad(), ctl.replay(want):
        ref = model(input_ids=seq[None]).logits
    with torch.no_grad(), ctl.replay(got):
        out = model(input_ids=seq[None]).logits
    assert torch.equal(out, ref)


def _want(ctl, moe, seq, start=0):
    ids = moe.clone()
    ids[:start] = -1
    return RouteTrace.from_ids(ids[None], ctl.num_experts, ctl.top_k, ctl.layer_ids).with_tokens(seq[None])


def test_vllm_022_base64_npy_all_hidden_layers(run):
    model, ctl, seq, moe, p = run
    payload = _vllm_npy(moe, ctl.layer_ids, ctl.num_experts)
    assert isinstance(payload, str) and base64.b64decode(payload).startswith(b"\x93NUMPY")
    t = RouteTrace.from_vllm(seq[:p], seq[p:], payload, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids,
                             num_hidden_layers=N_HIDDEN)
    _replays_like(model, ctl, seq, _want(ctl, moe, seq), t)
    assert t.recorded_mask()[0].tolist() == [True] * (len(seq) - 1) + [False]
    # the Python API's ndarray (verl reads outputs[0].routed_experts), bytes, and a torch tensor give the same
    for form in (_vllm_npy(moe, ctl.layer_ids, ctl.num_experts, http=False), payload.encode(),
                 torch.from_numpy(_vllm_npy(moe, ctl.layer_ids, ctl.num_experts, http=False).astype(np.int32))):
        t2 = RouteTrace.from_vllm(seq[:p], seq[p:], form, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids,
                                  num_hidden_layers=N_HIDDEN)
        assert t2.equal(t) and torch.equal(t2.tokens, t.tokens)


def test_vllm_022_prompt_start_multi_turn(run):
    """``routed_experts_prompt_start``: rows [start, S - 1); earlier rows from the previous turn or not recorded."""
    model, ctl, seq, moe, p = run
    start = 4
    payload = _vllm_npy(moe, ctl.layer_ids, ctl.num_experts, start=start)
    alone = RouteTrace.from_vllm(seq[:p], seq[p:], payload, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids,
                                 num_hidden_layers=N_HIDDEN, start=start)
    assert torch.equal(alone.long_ids(), _want(ctl, moe, seq, start).long_ids())
    assert alone.recorded_mask()[0, :start].tolist() == [False] * start
    # turn 1 covered the first start + 1 tokens (its last row not fed); turn 2 asks only for the new rows
    turn1 = RouteTrace.from_vllm(seq[:3], seq[3:start + 1], _vllm_npy(moe[:start + 1], ctl.layer_ids,
                                 ctl.num_experts), num_experts=ctl.num_experts, layer_ids=ctl.layer_ids,
                                 num_hidden_layers=N_HIDDEN)
    joined = RouteTrace.from_vllm(seq[:p], seq[p:], payload, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids,
                                  num_hidden_layers=N_HIDDEN, start=start, previous=turn1)
    _replays_like(model, ctl, seq, _want(ctl, moe, seq), joined)
    foreign = turn1.with_tokens(turn1.tokens + 1)
    with pytest.raises(TraceValidationError, match="previous trace was recorded on other tokens"):
        RouteTrace.from_vllm(seq[:p], seq[p:], payload, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids,
                             num_hidden_layers=N_HIDDEN, start=start, previous=foreign)
    with pytest.raises(ValueError, match="has 6 positions but the sequence .* from start=3"):
        RouteTrace.from_vllm(seq[:p], seq[p:], payload, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids,
                             num_hidden_layers=N_HIDDEN, start=3)


def test_vllm_uint16_above_256_experts():
    """A 300-expert model: vLLM sends uint16 ids; numpy and torch uint16 decode alike."""
    model = make_model("qwen3_moe", num_experts=300)
    ctl = RoutingController(model)
    ids = torch.randint(3, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), ctl.record() as rec:
        model(input_ids=ids)
    moe = rec.trace().long_ids()[0]
    moe = torch.cat([moe, torch.full_like(moe[:1], -1)])  # the engine's sequence: one sampled token more
    seq = torch.cat([ids[0], torch.tensor([7])])
    arr = np.zeros((5, 2, 2), dtype=np.uint16)
    arr[:] = moe[:-1].numpy()
    assert int(arr.max()) > 255
    f = io.BytesIO()
    np.save(f, arr)
    for form in (base64.b64encode(f.getvalue()).decode(), arr, torch.from_numpy(arr.copy()).to(torch.uint16)):
        t = RouteTrace.from_vllm(seq[:3], seq[3:], form, num_experts=300, layer_ids=ctl.layer_ids)
        assert torch.equal(t.long_ids()[0, :-1], moe[:-1]) and t.ids.dtype == torch.int16


def test_vllm_021_split_layout_json_lists(run):
    model, ctl, seq, moe, p = run
    pr, comp = _vllm_021(moe, p)
    assert isinstance(comp, list) and isinstance(comp[0][0][0], int)
    t = RouteTrace.from_vllm(seq[:p], seq[p:], comp, pr, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids)
    _replays_like(model, ctl, seq, _want(ctl, moe, seq), t)
    with pytest.raises(ValueError, match="completion's part alone .* prompt_routed_experts is None"):
        RouteTrace.from_vllm(seq[:p], seq[p:], comp, None, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids)
    pr, comp = _vllm_021(moe, p, cached=(0, 1))  # prefix-cached prompt rows
    t = RouteTrace.from_vllm(seq[:p], seq[p:], comp, pr.tolist(), num_experts=ctl.num_experts,
                             layer_ids=ctl.layer_ids)
    assert t.recorded_mask()[0, :3].tolist() == [False, False, True]


def test_vllm_none_routes_one_line_error(run):
    _, ctl, seq, moe, p = run
    pr, _ = _vllm_021(moe, p)
    with pytest.raises(ValueError, match="routed_experts is None: the engine returned no routes") as info:
        RouteTrace.from_vllm(seq[:p], seq[p:], None, pr, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="the engine returned no routes"):
        RouteTrace.from_sglang(seq, None, num_experts=8, top_k=2, layer_ids=ctl.layer_ids)


def test_vllm_old_int32_all_layers(run):
    model, ctl, seq, moe, p = run
    arr = _all_layers(moe[:-1], ctl.layer_ids, N_HIDDEN, np.int32)
    t = RouteTrace.from_vllm(seq[:p], seq[p:], arr, num_experts=ctl.num_experts, layer_ids=ctl.layer_ids,
                             num_hidden_layers=N_HIDDEN)
    _replays_like(model, ctl, seq, _want(ctl, moe, seq), t)


def test_layer_count_errors_name_num_hidden_layers(run):
    _, ctl, seq, moe, p = run
    payload = _vllm_npy(moe, ctl.layer_ids, ctl.num_experts)
    with pytest.raises(ValueError, match="has 3 layers; expected 2 MoE layers.*num_hidden_layers=config"):
        RouteTrace.from_vllm(seq[:p], seq[p:], payload, num_experts=8, layer_ids=ctl.layer_ids)
    with pytest.raises(ValueError, match="has 3 layers; expected 2 MoE layers or num_hidden_layers=4"):
        RouteTrace.from_vllm(seq[:p], seq[p:], payload, num_experts=8, layer_ids=ctl.layer_ids, num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"num_hidden_layers"):
        RouteTrace.from_sglang(seq, _sglang(moe, ctl.layer_ids), num_experts=8, top_k=2, layer_ids=ctl.layer_ids)
    # layer_ids that do not describe the engine's model: the dropped layer holds real ids, not the engine's zeros
    with pytest.raises(ValueError, match="layer 1 is not an MoE layer of the model"):
        RouteTrace.from_vllm(seq[:p], seq[p:], payload, num_experts=8, layer_ids=(0, 2), num_hidden_layers=N_HIDDEN)


def test_bad_payloads_refused(run):
    _, ctl, seq, moe, p = run
    kw = dict(num_experts=8, layer_ids=ctl.layer_ids, num_hidden_layers=N_HIDDEN)
    with pytest.raises(ValueError, match="not valid base64"):
        RouteTrace.from_vllm(seq[:p], seq[p:], "not base64!", **kw)
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="cannot be read without pickle"):
        RouteTrace.from_vllm(seq[:p], seq[p:], base64.b64encode(obj.getvalue()), **kw)
    with pytest.raises(TypeError, match="integer"):
        RouteTrace.from_vllm(seq[:p], seq[p:], _vllm_npy(moe, ctl.layer_ids, 8, http=False).astype(float), **kw)
    with pytest.raises(ValueError, match="must be \\[positions, layers, top_k\\]"):
        RouteTrace.from_vllm(seq[:p], seq[p:], base64.b64encode(np.zeros(12, "<i4").tobytes()), **kw)


def test_sglang_base64_int32_all_layers(run):
    model, ctl, seq, moe, _ = run
    payload = _sglang(moe, ctl.layer_ids)
    t = RouteTrace.from_sglang(seq, payload, num_experts=ctl.num_experts, top_k=ctl.top_k, layer_ids=ctl.layer_ids,
                               num_hidden_layers=N_HIDDEN)
    _replays_like(model, ctl, seq, _want(ctl, moe, seq), t)
    # skip_tokenizer_init: the int32 tensor itself, shaped or flat
    host = _sglang(moe, ctl.layer_ids, encode=False)
    for form in (host, host.reshape(-1)):
        t2 = RouteTrace.from_sglang(seq, form, num_experts=8, top_k=2, layer_ids=ctl.layer_ids,
                                    num_hidden_layers=N_HIDDEN)
        assert t2.equal(t)


def test_sglang_start_len_and_s_rows(run):
    model, ctl, seq, moe, _ = run
    start = 3
    t = RouteTrace.from_sglang(seq, _sglang(moe, ctl.layer_ids, start=start), num_experts=8, top_k=2,
                               layer_ids=ctl.layer_ids, num_hidden_layers=N_HIDDEN, start=start)
    assert torch.equal(t.long_ids(), _want(ctl, moe, seq, start).long_ids())
    # S rows (a path that fed the final token): kept; the trace's last row is then recorded
    moe_s = torch.cat([moe[:-1], moe[-2:-1]])
    full = torch.zeros((len(seq), N_HIDDEN, 2), dtype=torch.int32)
    full[:, list(ctl.layer_ids)] = moe_s.to(torch.int32)
    t = RouteTrace.from_sglang(seq, base64.b64encode(full.numpy().tobytes()), num_experts=8, top_k=2,
                               layer_ids=ctl.layer_ids, num_hidden_layers=N_HIDDEN)
    assert bool(t.recorded_mask().all()) and torch.equal(t.long_ids()[0], moe_s)
    with pytest.raises(ValueError, match="holds 36 ids; 11 tokens from start=0 need"):
        RouteTrace.from_sglang(seq, base64.b64encode(np.zeros(36, "<i4").tobytes()), num_experts=8, top_k=2,
                               layer_ids=ctl.layer_ids, num_hidden_layers=N_HIDDEN)
    with pytest.raises(ValueError, match="not valid base64"):
        RouteTrace.from_sglang(seq, "not base64!", num_experts=8, top_k=2, layer_ids=ctl.layer_ids)


def test_engine_traces_join_with_cat_traces(run):
    _, ctl, seq, moe, _ = run
    a = RouteTrace.from_sglang(seq, _sglang(moe, ctl.layer_ids), num_experts=8, top_k=2, layer_ids=ctl.layer_ids,
                               num_hidden_layers=N_HIDDEN)
    b = RouteTrace.from_sglang(seq[:4], _sglang(moe[:4], ctl.layer_ids), num_experts=8, top_k=2,
                               layer_ids=ctl.layer_ids, num_hidden_layers=N_HIDDEN)
    both = cat_traces([a, b], side="right")
    assert both.ids.shape[:2] == (2, len(seq)) and both.tokens[1, 4:].tolist() == [-1] * (len(seq) - 4)


def test_hash_routed_layer_in_all_layer_payloads():
    """DeepSeek-V4: an engine's all-layer payload holds real (hash) expert ids in layer 0, which the controller does
    not replay; they are dropped when named by ``ctl.unreplayed_layer_ids`` and refused otherwise (not dense zeros)."""
    from family_models import make_family_model

    model = make_family_model("deepseek_v4")
    ctl = RoutingController(model)
    assert ctl.layer_ids == (1,) and ctl.unreplayed_layer_ids == (0,)
    n_hidden = model.config.num_hidden_layers
    ids = torch.randint(3, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), ctl.record() as rec:
        seq = model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    moe = rec.trace().long_ids()[0]
    rows = np.zeros((seq.shape[1] - 1, n_hidden, ctl.top_k), dtype=np.uint8)
    rows[:, 1] = moe[:-1, 0].numpy()
    rows[:, 0] = (seq[0, :-1, None].numpy() * np.arange(1, ctl.top_k + 1)) % ctl.num_experts + 1  # hash ids
    f = io.BytesIO()
    np.save(f, rows)
    payload = base64.b64encode(f.getvalue()).decode()
    kw = dict(num_experts=ctl.num_experts, layer_ids=ctl.layer_ids, num_hidden_layers=n_hidden)
    with pytest.raises(ValueError, match="layer 0 is not an MoE layer .* unreplayed_layer_ids"):
        RouteTrace.from_vllm(seq[0, :6], seq[0, 6:], payload, **kw)
    t = RouteTrace.from_vllm(seq[0, :6], seq[0, 6:], payload, unreplayed_layer_ids=ctl.unreplayed_layer_ids, **kw)
    assert torch.equal(t.long_ids()[0], moe)
