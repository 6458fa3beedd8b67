"""The parts of the GPU work a CPU engine can run (issue 42): a bfloat16 engine gets its weights in bfloat16 and serves
them, and the route recorder's fallback (the experts chosen from the router logits, what a GPU kernel that selects
inside itself gets) records the very routes the CPU kernel's own selection gives."""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.rollout import vllm_engine, vllm_worker
from tests.vllm.conftest import ANSWERS, PROMPTS, TEMPERATURE, short_job_engine, trainer_logp

pytestmark = pytest.mark.vllm

@pytest.fixture(scope="module")
def engine(policies, tok):
    """A bfloat16 vLLM engine of policy 0 recording routes (its own engine process)."""
    eng = short_job_engine(policies[0], tok, "bfloat16")
    yield eng
    eng.close()


def _generate(engine, seed=7):
    return engine.generate(PROMPTS, ANSWERS, group_size=4, seed=seed)


def test_weights_cross_in_the_engines_dtype_and_are_served(engine, policies, monkeypatch):
    written = []
    save = vllm_engine.save_file

    def spy(tensors, path):
        written.append({k: v.dtype for k, v in tensors.items()})
        return save(tensors, path)

    monkeypatch.setattr(vllm_engine, "save_file", spy)
    engine.sync(policies[1].state_dict(), 1)
    assert written and set(written[-1].values()) == {torch.bfloat16}     # not the trainer's float32
    batch = _generate(engine)
    mask = batch.response_mask.bool()
    synced = (trainer_logp(policies[1], batch, TEMPERATURE) - batch.behav_logp)[mask].abs().mean()
    first = (trainer_logp(policies[0], batch, TEMPERATURE) - batch.behav_logp)[mask].abs().mean()
    assert synced < 0.05 and first > 4 * synced, (float(synced), float(first))   # bf16 noise vs other weights


def test_the_fallback_records_the_routes_the_kernel_selected(engine):
    """The same requests with their seeds, once with the kernel's own ids, once choosing from the router logits
    (the watcher's ids ignored): the same tokens and the same routes."""
    llm = engine.llm
    before = llm.collective_rpc(vllm_worker.kernel_selected_forwards)[0]
    kernel = _generate(engine, seed=5)
    after = llm.collective_rpc(vllm_worker.kernel_selected_forwards)[0]
    assert after > before                                            # these routes are the kernel's
    llm.collective_rpc(vllm_worker.use_kernel_selection, args=(False,))
    try:
        fallback = _generate(engine, seed=5)
        assert llm.collective_rpc(vllm_worker.kernel_selected_forwards)[0] == after     # none from the kernel
    finally:
        llm.collective_rpc(vllm_worker.use_kernel_selection, args=(True,))
    assert torch.equal(kernel.input_ids, fallback.input_ids)
    assert kernel.routes.equal(fallback.routes)
    assert int(kernel.routes.recorded_mask().sum()) > 0
