"""Chat templates: a task's prompts rendered as one user turn with the tokenizer's own template.

``task.chat_template``:

* ``auto``: when the tokenizer has a chat template (``tokenizer.chat_template``), every prompt ``p`` becomes
  ``tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)``; a
  tokenizer without one (the embedded character tokenizer) leaves prompts as they are;
* ``none``: prompts are used as written.

The rendered text is still a prompt: the engine encodes it as ``bos + prompt`` and everything it generates after it
is the response, so routes, the response mask and log-probs cover only the response, as for a plain prompt.  A
template that itself starts with the tokenizer's bos token has that token removed from the text (the encoder adds
it), so there is exactly one.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Optional

from .vocabulary import CHAT_TEMPLATE_MODES


@dataclass(frozen=True)
class ChatTemplateRecord:
    """What was applied, for the run folder: the mode, whether a template was applied, the template's sha256 and
    the first training prompt as the model sees it."""

    mode: str
    applied: bool
    template_sha256: Optional[str] = None
    example: Optional[str] = None

    def to_dict(self) -> dict:
        """A JSON-ready dict of the record."""
        return asdict(self)


def render_prompt(tok: Any, prompt: str) -> str:
    """``prompt`` as one user turn with ``tok``'s chat template and the generation prompt, leading bos removed."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    bos = getattr(tok, "bos_token", None)
    if bos and text.startswith(bos):
        text = text[len(bos):]
    return text


def apply_chat_template(task: Any, tok: Any, mode: str = "auto") -> ChatTemplateRecord:
    """Render every prompt of ``task`` (train and eval) with ``tok``'s chat template when ``mode`` asks for it and
    the tokenizer has one (module docstring); returns the :class:`ChatTemplateRecord` to save in the run folder."""
    if mode not in CHAT_TEMPLATE_MODES:
        raise ValueError(f"task.chat_template={mode!r} is not one of {CHAT_TEMPLATE_MODES}")
    template = getattr(tok, "chat_template", None)
    if mode == "none" or not template:
        return ChatTemplateRecord(mode=mode, applied=False)
    if isinstance(template, dict):      # several named templates: the default one
        template = template.get("default") or next(iter(template.values()))
    task.set_prompts([render_prompt(tok, p) for p in task.train_prompts],
                     [render_prompt(tok, p) for p in task.eval_prompts])
    return ChatTemplateRecord(mode=mode, applied=True,
                              template_sha256=hashlib.sha256(str(template).encode("utf-8")).hexdigest(),
                              example=task.train_prompts[0])
