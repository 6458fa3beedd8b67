"""Char tokenizer: round-trip, special tokens, fast encoding equals the tokenizer, left padding."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.tasks import build_char_tokenizer, char_table, decode_completions, encode_prompts, encode_texts
from offpolicy_moe.tasks.tokenizer import CHARS

TOK = build_char_tokenizer()


def test_vocab_and_specials():
    assert len(TOK) == 3 + 10 + 6 + 1
    assert (TOK.pad_token, TOK.bos_token, TOK.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id) == (0, 1, 2)
    assert TOK.convert_tokens_to_ids(list("0123456789")) == list(range(3, 13))
    assert TOK.padding_side == "left"
    assert build_char_tokenizer(padding_side="right").padding_side == "right"
    with pytest.raises(ValueError, match="padding_side"):
        build_char_tokenizer(padding_side="middle")


def test_bos_prepended_only_with_special_tokens():
    assert TOK("12+7=")["input_ids"] == [1, 4, 5, 13, 10, 16]
    assert TOK("12+7=", add_special_tokens=False)["input_ids"] == [4, 5, 13, 10, 16]
    # special tokens written in text are single tokens
    assert TOK("1<eos>", add_special_tokens=False)["input_ids"] == [4, 2]


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=CHARS, max_size=30))
def test_round_trip_and_fast_path_agree(s):
    ids = TOK(s, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(s)  # one token per character
    assert TOK.decode(ids, skip_special_tokens=True) == s
    assert encode_texts(TOK, [s]) == [ids]
    assert encode_texts(TOK, [s], add_bos=True) == [[TOK.bos_token_id] + ids]


def test_unknown_character_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\['a'\]"):
        encode_texts(TOK, ["1+a="])
    with pytest.raises(ValueError, match="non-ASCII"):
        encode_texts(TOK, ["1+é"])
    with pytest.raises(TypeError):
        encode_texts(TOK, "12")


def test_encode_prompts_left_padded():
    ids, mask = encode_prompts(TOK, ["1+2=", "12+33="])
    assert ids.tolist() == [[0, 0, 1, 4, 13, 5, 16], [1, 4, 5, 13, 6, 6, 16]]
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]
    # equals the HF tokenizer's own left padding
    ref = TOK(["1+2=", "12+33="], padding=True, return_tensors="pt")
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])


def test_char_table_detects_char_tokenizer_after_save(tmp_path):
    from transformers import AutoTokenizer

    TOK.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert char_table(again) is not None
    assert again("9*(1-2)=")["input_ids"] == TOK("9*(1-2)=")["input_ids"]


def test_decode_completions_cuts_at_eos_and_drops_pad():
    rows = torch.tensor([[4, 12, 2, 0], [2, 5, 5, 0], [6, 7, 0, 0], [5, 2, 6, 2], [4, 0, 12, 0], [4, 1, 12, 13]])
    assert decode_completions(TOK, rows) == ["19", "", "34<pad><pad>", "2", "1<pad>9<pad>", "1<bos>9+"]


# ------------------------------------------------------------------------------------------------ byte fallback
from offpolicy_moe.tasks import embedded_tokenizer  # noqa: E402
from offpolicy_moe.tasks.tokenizer import BYTE_TOKENS, VOCAB  # noqa: E402

BYTES = build_char_tokenizer(byte_fallback=True)


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=40))
def test_byte_fallback_round_trips_any_text_and_fast_path_agrees(s):
    ids = BYTES(s, add_special_tokens=False)["input_ids"]
    assert BYTES.decode(ids, skip_special_tokens=True) == s
    assert encode_texts(BYTES, [s]) == [ids]
    assert decode_completions(BYTES, [ids + [BYTES.eos_token_id, 0]]) == [s]
    assert len(ids) == sum(1 if c in CHARS else len(c.encode("utf-8")) for c in s)


def test_byte_fallback_keeps_the_alphabet_ids_and_appends_the_bytes():
    assert len(BYTES) == 20 + 256
    assert {t: BYTES.convert_tokens_to_ids(t) for t in VOCAB} == VOCAB
    assert BYTES.convert_tokens_to_ids(list(BYTE_TOKENS)) == list(range(20, 276))
    assert BYTES("12+7=")["input_ids"] == TOK("12+7=")["input_ids"] == [1, 4, 5, 13, 10, 16]
    assert BYTES("a\n#é", add_special_tokens=False)["input_ids"] == [20 + 0x61, 20 + 0x0A, 20 + 0x23, 20 + 0xC3,
                                                                     20 + 0xA9]


def test_embedded_tokenizer_keeps_the_arithmetic_vocabulary():
    """The arithmetic task stays on the 20-token vocabulary (its model and results unchanged); text with any other
    character gets the byte fallback."""
    from offpolicy_moe.config.schema import TaskConfig
    from offpolicy_moe.tasks import make_task

    assert len(embedded_tokenizer(make_task(TaskConfig()).alphabet)) == 20
    assert len(embedded_tokenizer(set("How many?\n"))) == 276
    assert len(embedded_tokenizer()) == 20


def test_byte_fallback_tokenizer_survives_save_and_load(tmp_path):
    from transformers import AutoTokenizer

    BYTES.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "Ann has 7 pens.\n#### 21 — ok"
    assert again(text)["input_ids"] == BYTES(text)["input_ids"]
    assert encode_texts(again, [text]) == encode_texts(BYTES, [text])
    assert again.decode(again(text, add_special_tokens=False)["input_ids"]) == text
