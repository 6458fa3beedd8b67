"""Finished sequences leave the engine's decode batch (``rollout.compact_finished``): same samples, same behaviour
log-probs (to rounding), same recorded routes on every attended position, fewer rows fed."""
from __future__ import annotations

import pytest
import torch

from tests.tiny import rollout_engine


def _engine(compact: bool, record: bool, dtype: str = "float32"):
    from offpolicy_moe.config.schema import ModelConfig, TaskConfig
    from offpolicy_moe.rollout.engine import HFRolloutEngine
    from offpolicy_moe.models import load_policy
    from offpolicy_moe.tasks import make_task

    task = make_task(TaskConfig())
    model, tok = load_policy(ModelConfig(num_layers=2, hidden_size=32, num_experts=4, top_k=2), seed=5, task=task)
    with torch.no_grad():    # an untrained model rarely stops: make EOS likely so that rows finish at many steps
        model.lm_head.weight[tok.eos_token_id] += 0.6 * model.lm_head.weight[3:13].mean(0)
    eng = rollout_engine(model, tok, dtype=dtype, max_new_tokens=10, temperature=1.5, record_routes=record,
                          compact_finished=compact)
    rows = task.sample_prompts(0, 6)
    return eng, [r["prompt"] for r in rows], [r["answer"] for r in rows]


def _fed_rows(model):
    seen = []
    h = model.register_forward_pre_hook(lambda m, a, kw: seen.append(int(kw["input_ids"].shape[0])),
                                        with_kwargs=True)
    return seen, h


@pytest.mark.parametrize("record", [False, True])
def test_compaction_keeps_samples_logprobs_and_routes(record):
    torch.set_num_threads(1)
    out, fed = {}, {}
    for compact in (False, True):
        eng, prompts, answers = _engine(compact, record)
        seen, h = _fed_rows(eng.model)
        try:
            out[compact] = eng.generate(prompts, answers, group_size=4, seed=3)
        finally:
            h.remove()
        fed[compact] = seen
    a, b = out[False], out[True]
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.response_mask, b.response_mask)
    assert a.completions == b.completions
    torch.testing.assert_close(b.behav_logp, a.behav_logp, rtol=0, atol=1e-5)
    # rows really finished at different steps and left the batch: prefill on 6 prompts, then shrinking decodes
    assert fed[False][0] == fed[True][0] == 6
    assert all(n == 24 for n in fed[False][1:])
    assert min(fed[True][1:]) < 24 and fed[True][1:] == sorted(fed[True][1:], reverse=True)
    assert sum(fed[True]) < sum(fed[False])
    if record:
        ra, rb = a.routes, b.routes
        assert ra.ids.shape == rb.ids.shape
        # fed in both: every attended position but a row's last token (its EOS when it left the batch early:
        # nothing is computed from it, so it is not fed once the row is dropped; the final sampled token is never fed)
        att = a.attention_mask.bool().clone()
        last = att.long().cumsum(1).argmax(1)
        att[torch.arange(att.shape[0]), last] = False
        assert torch.equal(ra.ids[att], rb.ids[att])
        dropped = ~rb.recorded_mask() & ra.recorded_mask()
        assert bool(dropped.any()) and not bool((dropped & att).any())
        assert bool(rb.recorded_mask()[att].all())


def test_recorder_scatter_rows_refuses_a_wrong_row_count():
    from offpolicy_moe.routing import RoutingController

    eng, prompts, answers = _engine(True, True)
    ctl = RoutingController(eng.model)
    ids = torch.randint(3, 13, (4, 5))
    with torch.no_grad(), ctl.record() as rec:
        eng.model(input_ids=ids)
        rec.scatter_rows(torch.tensor([0, 2]), 4)
        with pytest.raises(ValueError, match="active rows"):
            eng.model(input_ids=ids[:3])


def test_completions_are_the_masked_response_tokens_decoded():
    """A completion is exactly the response's masked tokens (through the first eos) decoded, the eos dropped: the
    text a reward sees is what the update trains on."""
    from offpolicy_moe.tasks.tokenizer import decode_completions

    torch.set_num_threads(1)
    eng, prompts, answers = _engine(True, False)
    b = eng.generate(prompts, answers, group_size=4, seed=3)
    resp = b.input_ids[:, b.prompt_len:]
    lengths = b.response_mask.sum(1).long().tolist()
    assert len(set(lengths)) > 1                        # rows finish at different steps
    eos = eng.tokenizer.eos_token_id
    for row, n, text in zip(resp.tolist(), lengths, b.completions):
        kept = row[:n]
        assert eos not in kept[:-1]
        assert decode_completions(eng.tokenizer, [[t for t in kept if t != eos]]) == [text]
