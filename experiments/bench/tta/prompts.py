"""How TRL's GRPOTrainer tokenizes a text prompt, against ours (a fairness probe of bench_tta.py's trl arm)."""
from __future__ import annotations

from offpolicy_moe.tasks.tokenizer import encode_prompts


def prompt_ids_match(tok, prompts: list[str]) -> bool:
    """TRL's token ids of ``prompts`` (``processing_class(text=prompts)``, GRPOTrainer._tokenize_prompts) equal
    ours (``encode_prompts``: bos + prompt, left-padded; compared without the padding)."""
    if not prompts:
        return False
    trl_ids = tok(text=prompts)["input_ids"]
    ids, mask = encode_prompts(tok, prompts)
    ours = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return [list(x) for x in trl_ids] == ours
