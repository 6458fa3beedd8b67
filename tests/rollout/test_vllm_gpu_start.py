"""What the vLLM engine asks of vLLM on a GPU, checked on a CPU through the arguments it builds: ``vllm.LLM`` is
replaced by a stand-in that records its keyword arguments and the environment it was started in, and answers
generations with outputs built as vLLM's own output processor builds them (``CompletionOutput`` with
``routed_experts``, ``RequestOutput``); the platform is vLLM's real one (a CPU) or a stand-in GPU.

None of this has run on a GPU (docs/engines.md says so): these tests pin what is asked and how the answer is read."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from offpolicy_moe.config import load_config
from offpolicy_moe.models.loading import build_model
from offpolicy_moe.rollout import devices, vllm_start, vllm_worker
from offpolicy_moe.rollout.vllm_engine import (KEEP_FLOAT32, VLLMEngineError, VLLMRolloutEngine, _engine_precision,
                                               native_trace)
from offpolicy_moe.tasks import build_char_tokenizer

vllm = pytest.importorskip("vllm")
from vllm.logprobs import Logprob  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402

PROMPTS = ["3+8+5=", "12+7="]
ANSWERS = ["16", "19"]


class GPU:
    """vLLM's platform as a CUDA machine reports it (what the engine asks of it)."""

    def is_cpu(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return True


def completion(prompt: list[int], tokens: list[int], layers: int, k: int, experts: int, rng) -> CompletionOutput:
    """One finished completion as vLLM's output processor builds it: ``routed_experts`` concatenated over the
    steps, ``[prompt + response - 1, num_hidden_layers, K]``, uint8 for up to 256 experts."""
    rows = len(prompt) + len(tokens) - 1
    routes = np.stack([np.stack([rng.permutation(experts)[:k] for _ in range(layers)]) for _ in range(rows)])
    return CompletionOutput(index=0, text="", token_ids=list(tokens), cumulative_logprob=None,
                            logprobs=[{t: Logprob(logprob=-0.25, rank=1)} for t in tokens],
                            routed_experts=routes.astype(np.uint8), finish_reason="stop", stop_reason=None)


class FakeLLM:
    """Stands in for ``vllm.LLM``: records what it was started with and answers as vLLM answers."""

    made: list["FakeLLM"] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.env = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "VLLM_ENABLE_V1_MULTIPROCESSING")}
        self.rpcs: list[str] = []
        self.answers: dict[str, CompletionOutput] = {}
        self.generated = 0
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: None))
        FakeLLM.made.append(self)

    def collective_rpc(self, fn, args=()):
        self.rpcs.append(fn.__name__)
        return [{vllm_worker.moe_layer_ids: [0, 1], vllm_worker.install_route_recorder: [0, 1],
                 vllm_worker.take_routes: {}}[fn]]

    def generate(self, prompts, params, use_tqdm=False):
        self.generated += 1
        rng = np.random.default_rng(0)
        outs = []
        for i, p in enumerate(prompts):
            ids = list(p["prompt_token_ids"])
            comp = completion(ids, [5, 6, 7][: 2 + i % 2], layers=2, k=2, experts=8, rng=rng)
            self.answers[str(i)] = comp
            outs.append(RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=ids, prompt_logprobs=None,
                                      outputs=[comp], finished=True))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeLLM.made = []
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return FakeLLM


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(vllm_start, "platform", lambda: GPU())
    monkeypatch.setattr(devices, "visible_gpus", lambda: 4)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def engine(tok, *overrides, record=True, device=None):
    cfg = load_config(overrides=["model.head_dim=32", "rollout.engine=vllm", "rollout.max_new_tokens=3", *overrides])
    policy = build_model(cfg.model, tok, seed=0)
    return VLLMRolloutEngine.from_config(policy, tok, cfg.rollout, record_routes=record, device=device, seed=0)


def test_on_a_gpu_the_engine_asks_for_native_routes_and_reads_them_from_the_outputs(fake_vllm, on_gpu, tok):
    eng = engine(tok, device=torch.device("cuda", 1))
    llm = fake_vllm.made[-1]
    assert llm.kwargs["enable_return_routed_experts"] is True
    assert llm.kwargs["gpu_memory_utilization"] == 0.5
    assert llm.kwargs["max_model_len"] == 256 and llm.kwargs["enforce_eager"] is True
    assert llm.env["CUDA_VISIBLE_DEVICES"] == "1"                     # the rank's own device
    assert "CUDA_VISIBLE_DEVICES" not in os.environ                    # only for the start
    assert llm.rpcs == ["moe_layer_ids"]                               # no hooks installed
    batch = eng.generate(PROMPTS, ANSWERS, group_size=1, seed=0)
    assert "take_routes" not in llm.rpcs
    ids = batch.routes.long_ids()                                      # [B, P + T, L, K], -1 not recorded
    P = batch.prompt_len
    for b, rid in enumerate(["0", "1"]):
        comp = llm.answers[rid]
        prompt_len = int(batch.attention_mask[b, :P].sum())
        want = torch.from_numpy(comp.routed_experts.astype(np.int64))            # [S - 1, L, K]
        got = torch.cat([ids[b, P - prompt_len:P], ids[b, P:P + len(comp.token_ids)]])
        assert torch.equal(got[:-1], want)                             # prompt and response rows, as returned
        assert bool((got[-1] == -1).all())                             # the last token is never fed
    eng.close()


def test_on_a_cpu_the_engine_records_with_hooks_and_passes_no_gpu_settings(fake_vllm, tok):
    eng = engine(tok, device=torch.device("cpu"))
    llm = fake_vllm.made[-1]
    assert "enable_return_routed_experts" not in llm.kwargs and "gpu_memory_utilization" not in llm.kwargs
    assert llm.env["CUDA_VISIBLE_DEVICES"] is None
    assert llm.rpcs == ["install_route_recorder"] and eng.routes_from == "hooks"
    eng.close()


@pytest.mark.parametrize("devices_key, visible, want", [("[2,3]", None, "3"), ("[]", "4,5,6,7", "5"),
                                                        ("[0]", "6,7", "6")])
def test_the_trainers_engine_takes_the_device_of_its_slot(fake_vllm, on_gpu, tok, monkeypatch, devices_key, visible,
                                                          want):
    """Rank 1's engine: slot 1 of ``rollout.vllm_devices`` (or of every GPU), named as this process sees them."""
    if visible:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    eng = engine(tok, f"rollout.vllm_devices={devices_key}", device=torch.device("cuda", 1))
    assert fake_vllm.made[-1].env["CUDA_VISIBLE_DEVICES"] == want
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible
    eng.close()


@pytest.mark.parametrize("gpu, overrides, record, match", [
    (False, ["rollout.vllm_eager=false"], True, "rollout.vllm_eager=false with routes recorded"),
    (True, ["rollout.vllm_eager=false", "rollout.vllm_routes=hooks"], True, "rollout.vllm_eager=false with routes"),
    (False, ["rollout.vllm_routes=native"], True, "rollout.vllm_routes=native: .*CPU's MoE kernel"),
])
def test_hooks_are_refused_with_cuda_graphs_before_the_engine_starts(fake_vllm, monkeypatch, tok, gpu, overrides,
                                                                     record, match):
    if gpu:
        monkeypatch.setattr(vllm_start, "platform", lambda: GPU())
    with pytest.raises(VLLMEngineError, match=match) as err:
        engine(tok, *overrides, record=record)
    assert "\n" not in str(err.value)
    assert fake_vllm.made == []                                        # refused before vLLM was started


def test_without_cuda_graphs_hooks_or_with_native_routes_the_start_goes_on(fake_vllm, monkeypatch, tok):
    engine(tok, "rollout.vllm_eager=false", record=False).close()     # no routes needed: no hooks
    assert fake_vllm.made[-1].kwargs["enforce_eager"] is False
    monkeypatch.setattr(vllm_start, "platform", lambda: GPU())
    eng = engine(tok, "rollout.vllm_eager=false")                      # native routes need no hooks
    assert eng.routes_from == "native" and fake_vllm.made[-1].kwargs["enforce_eager"] is False
    eng.close()


def test_native_trace_reads_routed_experts_built_as_vllm_builds_them():
    """A completion's ``routed_experts`` covers every hidden layer (a dense layer holds zeros); the trace keeps the
    MoE layers, the prompt's and the response's rows, and leaves the never-fed last token unrecorded."""
    rng = np.random.default_rng(3)
    prompt, tokens = [11, 12, 13], [21, 22]
    comp = completion(prompt, tokens, layers=3, k=2, experts=16, rng=rng)
    comp.routed_experts[:, 0] = 0                                      # layer 0 is dense
    out = RequestOutput(request_id="7", prompt=None, prompt_token_ids=prompt, prompt_logprobs=None,
                        outputs=[comp], finished=True)
    t = native_trace(out, layer_ids=[1, 2], num_hidden_layers=3, num_experts=16)
    ids = t.long_ids()[0]
    assert tuple(ids.shape) == (5, 2, 2) and t.layer_ids == (1, 2)
    assert torch.equal(ids[:4], torch.from_numpy(comp.routed_experts[:, 1:].astype(np.int64)))
    assert bool((ids[4] == -1).all())
    assert t.tokens[0].tolist() == prompt + tokens
    comp.routed_experts = None                                         # a completion without routes: refused
    with pytest.raises(ValueError, match="returned no routes"):
        native_trace(out, layer_ids=[1, 2], num_hidden_layers=3, num_experts=16)


def test_a_prompt_that_does_not_fit_max_model_len_is_refused_before_generation(fake_vllm, tok):
    eng = engine(tok, "rollout.vllm_max_model_len=8", record=False)
    assert fake_vllm.made[-1].kwargs["max_model_len"] == 8
    with pytest.raises(VLLMEngineError, match=r"rollout.vllm_max_model_len=8: a prompt of \d+ tokens") as err:
        eng.generate(["1234567+1="], ["1234568"], group_size=1, seed=0)
    assert "\n" not in str(err.value) and fake_vllm.made[-1].generated == 0
    eng.generate(["1+1="], ["2"], group_size=1, seed=0)                # 4 + 3 <= 8
    assert fake_vllm.made[-1].generated == 1
    eng.close()


def test_weights_cross_in_the_engines_dtype(fake_vllm, tok):
    """A bf16 engine gets bf16 tensors (what vLLM would cast them to on load, so the values it serves are the
    same), except the correction bias vLLM keeps in float32 to choose experts."""
    eng = engine(tok, "rollout.dtype=bfloat16", record=False)
    policy = build_model(load_config(overrides=["model.head_dim=32"]).model, tok, seed=1)
    named = eng.checkpoint_tensors(policy.state_dict())
    assert named and all(v.dtype == torch.bfloat16 for v in named.values() if v.is_floating_point())
    sd = policy.state_dict()
    assert torch.equal(named["model.norm.weight"], sd["model.norm.weight"].to(torch.bfloat16))
    eng.close()
    bias = torch.randn(8)
    assert KEEP_FLOAT32 == ("e_score_correction_bias",)
    assert _engine_precision("model.layers.3.mlp.gate.e_score_correction_bias", bias, torch.bfloat16) is bias
    assert _engine_precision("model.layers.3.mlp.gate.weight", bias, torch.bfloat16).dtype == torch.bfloat16
    assert _engine_precision("counts", torch.arange(3), torch.bfloat16).dtype == torch.int64


# --------------------------------------------------------------------------------------------- memory and length
def qwen3_30b_like(**extra):
    """The attention shape of a Qwen3-30B-A3B-2507 config (48 layers, 4 key/value heads of 128, 262k positions)."""
    return SimpleNamespace(num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                           hidden_size=2048, max_position_embeddings=262144, use_sliding_window=False, **extra)


def test_the_kv_size_per_token_is_vllms_page_size():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    cfg = qwen3_30b_like()
    page = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16).page_size_bytes
    assert vllm_start.kv_bytes_per_token(cfg, "bfloat16") * 16 == 48 * page
    mla = SimpleNamespace(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64, max_position_embeddings=163840)
    page = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16).page_size_bytes
    assert vllm_start.kv_bytes_per_token(mla, "bfloat16") * 16 == 61 * page
    assert vllm_start.kv_bytes_per_token(SimpleNamespace(layer_types=["sliding_attention"]), "bfloat16") is None


def test_max_model_len_defaults_to_what_the_cache_holds_and_refuses_more():
    cfg = qwen3_30b_like()
    per = 48 * 2 * 4 * 128 * 2                                        # bytes a token, bf16
    assert vllm_start.max_model_len(cfg, "bfloat16", 256 << 20, None, 5) == (256 << 20) // per // 256 * 256
    assert vllm_start.max_model_len(cfg, "bfloat16", 200_000 << 20, None, 5) == 262144     # positions cap it
    assert vllm_start.max_model_len(SimpleNamespace(max_position_embeddings=40960, layer_types=["x"]),
                                    "bfloat16", 256 << 20, None, 5) == vllm_start.FALLBACK_MAX_MODEL_LEN
    assert vllm_start.max_model_len(cfg, "bfloat16", 256 << 20, 2048, 5) == 2048
    for asked, kv, match in ((4096, 256 << 20, r"rollout.vllm_max_model_len=4096: the KV cache of "
                              r"rollout.vllm_kv_cache_mib=256 holds 2720 tokens .* raise rollout.vllm_kv_cache_mib "
                              r"to 384 or more"),
                             (300000, 1 << 40, "more than the model's max_position_embeddings=262144"),
                             (None, 1 << 20, r"rollout.vllm_kv_cache_mib=1: the KV cache holds 0 tokens")):
        with pytest.raises(ValueError, match=match) as err:
            vllm_start.max_model_len(cfg, "bfloat16", kv, asked, 5)
        assert "\n" not in str(err.value)


def test_a_memory_share_larger_than_what_is_free_is_refused():
    vllm_start.check_gpu_memory(0.5, free=50 << 30, total=80 << 30, device="cuda:0")
    with pytest.raises(ValueError, match=r"rollout.vllm_gpu_memory_utilization=0.9: asks for 73728 MiB of cuda:0, "
                                         r"which has 51200 MiB"):
        vllm_start.check_gpu_memory(0.9, free=50 << 30, total=80 << 30, device="cuda:0")


def test_native_routes_are_detected_without_starting_an_engine():
    ok, why = vllm_start.native_routes_supported(GPU())
    assert ok and why == ""
    ok, why = vllm_start.native_routes_supported(vllm_start.platform())          # this machine: a CPU
    assert not ok and "CPU's MoE kernel" in why
