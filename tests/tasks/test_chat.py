"""task.chat_template: prompts rendered with a local tokenizer's own template (built here, nothing downloaded)."""
from __future__ import annotations

import string

import pytest
import torch

from offpolicy_moe.config.schema import TaskConfig
from offpolicy_moe.tasks import apply_chat_template, build_char_tokenizer, encode_prompts, make_task, render_prompt

TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer(template: str = TEMPLATE):
    """A character-level tokenizer over printable ASCII with chat special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<|user|>", "<|end|>", "<|assistant|>"]
    chars = sorted(set(string.printable) - set("\t\n\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  padding_side="left", clean_up_tokenization_spaces=False)
    tok.chat_template = template
    return tok


def test_auto_renders_every_prompt_as_one_user_turn():
    task = make_task(TaskConfig(train_size=32, eval_size=4))
    train, evals = list(task.train_prompts), list(task.eval_prompts)
    record = apply_chat_template(task, chat_tokenizer(), "auto")
    assert task.train_prompts == [f"<|user|>{p}<|end|><|assistant|>" for p in train]
    assert task.eval_prompts == [f"<|user|>{p}<|end|><|assistant|>" for p in evals]
    assert list(task.eval_dataset["prompt"]) == task.eval_prompts          # the eval split follows
    assert task.train_answers and record.applied and record.example == task.train_prompts[0]
    assert record.to_dict()["template_sha256"] and record.mode == "auto"


@pytest.mark.parametrize("mode, tok", [("none", chat_tokenizer()), ("auto", build_char_tokenizer())])
def test_none_or_a_tokenizer_without_template_leaves_prompts_as_written(mode, tok):
    task = make_task(TaskConfig(train_size=32, eval_size=4))
    before = list(task.train_prompts)
    record = apply_chat_template(task, tok, mode)
    assert task.train_prompts == before and not record.applied and record.template_sha256 is None


def test_a_template_that_writes_bos_gets_exactly_one():
    tok = chat_tokenizer("{{ bos_token }}" + TEMPLATE)
    text = render_prompt(tok, "1+2=")
    assert text == "<|user|>1+2=<|end|><|assistant|>"
    ids, _ = encode_prompts(tok, [text])
    assert ids[0].tolist().count(tok.bos_token_id) == 1 and ids[0, 0] == tok.bos_token_id


def test_the_response_starts_after_the_template():
    """The engine's response (mask, behaviour log-probs, routes) begins after the rendered prompt's last token."""
    from offpolicy_moe.config.schema import RolloutConfig
    from offpolicy_moe.models.presets import build_preset
    from offpolicy_moe.rollout.engine import make_engine

    tok = chat_tokenizer()
    task = make_task(TaskConfig(train_size=32, eval_size=4))
    apply_chat_template(task, tok, "auto")
    special = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    model = build_preset("tiny-qwen3-moe", len(tok), num_layers=1, hidden_size=32, num_experts=4, top_k=2,
                         special_ids=special, seed=0).eval()
    engine = make_engine(model, tok, RolloutConfig(max_new_tokens=3, group_size=2), record_routes=True)
    prompts = task.train_prompts[:2]
    batch = engine.generate(prompts, task.train_answers[:2], group_size=2, seed=0, iteration=0)
    ids, _ = encode_prompts(tok, prompts)
    assert batch.prompt_len == ids.shape[1]
    assert torch.equal(batch.input_ids[:, :batch.prompt_len], ids.repeat_interleave(2, 0))
    assistant = tok.convert_tokens_to_ids("<|assistant|>")
    assert (batch.input_ids[:, batch.prompt_len - 1] == assistant).all()        # the template ends the prompt
    assert batch.response_mask.shape == batch.behav_logp.shape == (4, batch.input_ids.shape[1] - batch.prompt_len)
