"""Character-level tokenizer for the embedded arithmetic task, and fast prompt encoding.

The tokenizer is built in-process with the `tokenizers` library (a ``WordLevel`` model over single
characters, a pre-tokenizer that isolates every character, a ``Fuse`` decoder) and wrapped as a
``transformers.PreTrainedTokenizerFast`` so every Hugging Face code path (``generate``,
``save_pretrained``/``from_pretrained``, padding) works with it.  No file is downloaded.

Vocabulary (ids are stable; tests and saved checkpoints rely on them)::

    0 <pad>   1 <bos>   2 <eos>   3..12 "0".."9"   13 "+"  14 "-"  15 "*"  16 "="  17 "("  18 ")"  19 " "

Byte fallback (:func:`build_char_tokenizer` with ``byte_fallback=True``, chosen by :func:`embedded_tokenizer` for
a task whose text leaves that alphabet): the same 20 ids, then ``<0x00>`` .. ``<0xFF>`` at ids 20..275. A character
of the alphabet is its own token; any other character is the tokens of its UTF-8 bytes (SentencePiece's byte
fallback, https://github.com/google/sentencepiece), so any UTF-8 text encodes and decodes back exactly. The
arithmetic task never leaves the alphabet, so it keeps the 20-token vocabulary and its results.

``tok("12+7=")`` prepends ``<bos>`` (a template post-processor); ``add_special_tokens=False`` does not.

:func:`encode_prompts` and :func:`encode_texts` are the hot-path helpers used by the engine and SFT:
for a character-level tokenizer they map characters to ids with one numpy table lookup (no call into
the tokenizer per step); for any other tokenizer (a local checkpoint's BPE) they fall back to the
tokenizer's own batched encoding.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS)
CHARS: str = "0123456789" + "+-*=()" + " "
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
BYTE_TOKENS: tuple[str, ...] = tuple(f"<0x{b:02X}>" for b in range(256))

# Attribute under which a per-tokenizer lookup table is cached on the tokenizer object itself
# (no module-level mutable state).
_TABLE_ATTR = "_offpolicy_moe_char_table"
_PIECES_ATTR = "_offpolicy_moe_id_pieces"


def build_char_tokenizer(padding_side: str = "left", byte_fallback: bool = False):
    """Build the character-level tokenizer (specials ``<pad>``, ``<bos>``, ``<eos>`` + digits + ``+-*=()`` + space),
    with ``byte_fallback`` also the 256 byte tokens (module docstring).

    Returns a ``transformers.PreTrainedTokenizerFast`` with ``pad_token``, ``bos_token`` and
    ``eos_token`` set and the given ``padding_side`` ("left" for generation, the default; "right"
    for teacher forcing).  ``decode(encode(s), skip_special_tokens=True) == s`` for every string over
    the alphabet (with ``byte_fallback``: every string).  Without it an unknown character raises ``ValueError``
    naming it (see :func:`char_table`).
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if byte_fallback:
        vocab = {**VOCAB, **{t: len(VOCAB) + b for b, t in enumerate(BYTE_TOKENS)}}
        backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
        backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    else:
        backend = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=None))
        backend.decoder = decoders.Fuse()
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, VOCAB[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    return tok


def embedded_tokenizer(alphabet=(), padding_side: str = "left"):
    """The embedded model's tokenizer for text made of the characters ``alphabet`` (a task's ``alphabet``): the
    20-token character tokenizer when they are all in it (the arithmetic task: ids and results unchanged), else the
    same with byte fallback, which encodes any UTF-8 text."""
    return build_char_tokenizer(padding_side, byte_fallback=not set(alphabet) <= set(CHARS))


def char_table(tok) -> np.ndarray | None:
    """Return a 128-entry ``char -> id`` lookup table when ``tok`` is character-level, else ``None``.

    A tokenizer counts as character-level when every non-special vocabulary entry is one ASCII
    character and tokenising the whole alphabet yields exactly one id per character.  Unknown
    characters map to -1 (callers raise).  With byte fallback (the ``<0xXX>`` entries) an ASCII character
    outside the alphabet maps to its byte's token, so the table covers all of ASCII.  The table is cached on the
    tokenizer object.
    """
    cached = getattr(tok, _TABLE_ATTR, None)
    if cached is not None:
        return cached if isinstance(cached, np.ndarray) else None
    vocab = tok.get_vocab()
    specials = set(getattr(tok, "all_special_tokens", []) or [])
    plain = {t: i for t, i in vocab.items() if t not in specials and t not in BYTE_TOKENS}
    table: np.ndarray | None = None
    if plain and all(len(t) == 1 and ord(t) < 128 for t in plain):
        candidate = np.full(128, -1, dtype=np.int64)
        if all(t in vocab for t in BYTE_TOKENS):
            candidate[:] = [vocab[BYTE_TOKENS[b]] for b in range(128)]
        for t, i in plain.items():
            candidate[ord(t)] = i
        alphabet = "".join(sorted(plain))
        try:
            ids = tok(alphabet, add_special_tokens=False)["input_ids"]
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode its own alphabet is not char-level
            ids = None
        if ids == [plain[c] for c in alphabet]:
            table = candidate
    try:
        setattr(tok, _TABLE_ATTR, table if table is not None else False)
    except AttributeError:  # pragma: no cover - exotic tokenizer objects with __slots__
        pass
    return table


def _char_ids(table: np.ndarray, text: str) -> np.ndarray:
    try:
        raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    except UnicodeEncodeError as exc:
        raise ValueError(f"text {text!r} has a non-ASCII character the char tokenizer cannot encode") from exc
    ids = table[raw]
    if (ids < 0).any():
        bad = sorted({text[j] for j in np.nonzero(ids < 0)[0]})
        raise ValueError(f"text {text!r} has characters outside the tokenizer alphabet: {bad}")
    return ids


def encode_texts(tok, texts: Sequence[str], *, add_bos: bool = False) -> list[list[int]]:
    """Token ids of each text (no padding), optionally prefixed with ``bos``.

    Character-level tokenizers use the lookup table; others call ``tok(texts, add_special_tokens=False)``.
    """
    if isinstance(texts, str):
        raise TypeError("encode_texts expects a sequence of strings, got a single str")
    table = char_table(tok)
    prefix = [tok.bos_token_id] if (add_bos and tok.bos_token_id is not None) else []
    if table is not None and not (tok.get_vocab().get(BYTE_TOKENS[255]) is not None and
                                  not all(t.isascii() for t in texts)):
        return [prefix + _char_ids(table, t).tolist() for t in texts]
    if table is not None:       # byte fallback and a non-ASCII text: the tokenizer itself
        return [prefix + list(e) for e in tok(list(texts), add_special_tokens=False)["input_ids"]]
    if not texts:
        return []
    enc = tok(list(texts), add_special_tokens=False)["input_ids"]
    return [prefix + list(e) for e in enc]


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack variable-length id lists into ``(input_ids, attention_mask)`` ``[B, T]`` with left padding."""
    if len(seqs) == 0:
        raise ValueError("left_pad needs at least one sequence")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        if len(s):
            ids[row, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
            mask[row, width - len(s):] = 1
    return ids, mask


def encode_prompts(tok, prompts: Sequence[str], *, add_bos: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode prompts for generation: ``bos + prompt``, left-padded with ``pad_token_id``.

    Returns ``(input_ids, attention_mask)``, both ``LongTensor[B, T]``, ``T`` = longest prompt (+1 for
    bos).  For a tokenizer without a bos token (some real checkpoints) nothing is prepended.
    """
    if tok.pad_token_id is None:
        raise ValueError("tokenizer has no pad_token_id; set tok.pad_token (e.g. to the eos token) first")
    return left_pad(encode_texts(tok, prompts, add_bos=add_bos), tok.pad_token_id)


def decode_completions(tok, completion_ids: torch.Tensor | Sequence[Sequence[int]]) -> list[str]:
    """Decode generated ids (prompt removed) into text, cut at the first ``eos``.

    Row ``b`` becomes ``decode(ids[b, :first_eos])`` with special tokens kept: ``generate`` only pads
    rows after their eos, so anything before the first eos (a ``<pad>`` included) was emitted by the
    model and stays visible (``"1<pad>9"``), so it cannot earn a reward.  ``"1", "9", <eos>, <pad>``
    reads ``"19"``.
    """
    rows = completion_ids.tolist() if isinstance(completion_ids, torch.Tensor) else [list(r) for r in completion_ids]
    eos = tok.eos_token_id
    pieces = id_pieces(tok)
    out = []
    for r in rows:
        if eos is not None and eos in r:
            r = r[: r.index(eos)]
        if pieces is not None and all(0 <= i < len(pieces) for i in r):
            out.append("".join(pieces[i] for i in r))
        else:
            out.append(tok.decode(r, skip_special_tokens=False))
    return out


def id_pieces(tok) -> list[str] | None:
    """``pieces[i] = tok.decode([i])`` for a character-level tokenizer whose decoding is plain concatenation
    (``decode(ids) == "".join(decode([i]) for i in ids)``, checked on the whole vocabulary once), else ``None``.
    :func:`decode_completions` then joins pieces instead of calling the tokenizer per row.  Cached on ``tok``."""
    cached = getattr(tok, _PIECES_ATTR, None)
    if cached is not None:
        return cached or None
    pieces: list[str] = []
    if char_table(tok) is not None:
        n = len(tok)
        pieces = [tok.decode([i], skip_special_tokens=False) for i in range(n)]
        probe = list(range(n)) + list(range(n - 1, -1, -1))
        if tok.decode(probe, skip_special_tokens=False) != "".join(pieces[i] for i in probe):
            pieces = []
    try:
        setattr(tok, _PIECES_ATTR, pieces)
    except AttributeError:  # pragma: no cover - exotic tokenizer objects with __slots__
        pass
    return pieces or None
