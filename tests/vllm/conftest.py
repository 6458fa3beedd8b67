"""The tests against a real vLLM engine (marker ``vllm``; ``pip install -e ".[vllm]"``, docs/engines.md).

The default suite leaves them out (pyproject's ``addopts``).  ``python -m pytest -q -m vllm`` runs them; without
vLLM they are skipped, unless ``OFFPOLICY_MOE_REQUIRE_VLLM=1`` (as ``.ci/run`` sets it), under which a missing
vLLM is an error, not a skip."""
from __future__ import annotations

import os

import psutil
import pytest
import torch

if os.environ.get("OFFPOLICY_MOE_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401 - an ImportError here fails the run
else:
    pytest.importorskip("vllm")

from offpolicy_moe.config import load_config  # noqa: E402
from offpolicy_moe.logprobs import conditioning_positions  # noqa: E402
from offpolicy_moe.models.loading import build_model  # noqa: E402
from offpolicy_moe.rollout.engine import make_engine  # noqa: E402
from offpolicy_moe.routing import RoutingController, replay_guardrails, routing_metrics  # noqa: E402
from offpolicy_moe.tasks import build_char_tokenizer  # noqa: E402

# the embedded model: under rollout.engine=vllm it takes the head size vLLM's CPU attention serves by itself
VLLM_MODEL: tuple[str, ...] = ()


# the short job the engine tests sample: four prompts of the default task, 8 new tokens at temperature 0.7
PROMPTS = ["3+8+5=", "12+7=", "4+4=", "9+1+2="]
ANSWERS = ["16", "19", "8", "12"]
TEMPERATURE = 0.7


def short_job_engine(policy: torch.nn.Module, tok, dtype: str):
    """A vLLM engine of ``policy`` in ``dtype`` for the short job, recording routes (its own engine process)."""
    cfg = vllm_config(f"rollout.dtype={dtype}", "rollout.max_new_tokens=8", f"rollout.temperature={TEMPERATURE}")
    return make_engine(policy, tok, cfg.rollout, record_routes=True, seed=0)


def vllm_config(*overrides: str):
    """The default config with the vLLM engine, head size 32 and ``overrides``."""
    return load_config(overrides=[*VLLM_MODEL, "rollout.engine=vllm", *overrides])


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def policies(tok):
    """Two policies of the vLLM variant with different weights (seeds 0 and 1)."""
    cfg = vllm_config()
    return build_model(cfg.model, tok, seed=0), build_model(cfg.model, tok, seed=1)


def engine_processes(pid: int | None = None) -> list[psutil.Process]:
    """The vLLM engine-core processes below process ``pid`` (default: this one)."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in p.name() or any("EngineCore" in c for c in p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def assert_routes_replay_exactly(model: torch.nn.Module, batch) -> None:
    """The engine's routes of ``batch`` are the trainer's own choice on ``model`` (fp32 both), replaying them
    changes no logit, and every position that reaches a scored log-prob is replayed (no fallback)."""
    am = batch.attention_mask
    pos = (am.cumsum(1) - 1).clamp(min=0)
    ctl = RoutingController(model)
    with torch.no_grad():
        with ctl.record() as rec:
            plain = model(batch.input_ids, attention_mask=am, position_ids=pos).logits
        with ctl.replay(batch.routes), ctl.record("own") as own:
            replayed = model(batch.input_ids, attention_mask=am, position_ids=pos).logits
    assert routing_metrics(batch.routes, rec.trace(), am)["routing/topk_agreement"] == 1.0
    assert torch.equal(plain, replayed)
    guard = replay_guardrails(batch.routes, own.trace(), conditioning_positions(am))
    assert guard["routing/replay_fallback"] == 0.0 and guard["routing/replay_decisions"] > 0


def trainer_logp(model: torch.nn.Module, batch, temperature: float) -> torch.Tensor:
    """``[B, T]`` the trainer's log-probs of the batch's response tokens at ``temperature`` (fp32 forward)."""
    am = batch.attention_mask
    pos = (am.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(batch.input_ids, attention_mask=am, position_ids=pos).logits.float() / temperature
    P = batch.prompt_len
    return torch.log_softmax(logits[:, P - 1:-1], -1).gather(-1, batch.input_ids[:, P:, None]).squeeze(-1)
