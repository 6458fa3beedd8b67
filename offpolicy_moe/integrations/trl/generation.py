"""What TRL's ``model.generate`` call leaves for the trainer: routes, behaviour log-probs, the prompt width.

TRL's transformers path (``use_vllm=False``) left-pads the prompts, calls ``model.generate`` once per generation
batch and keeps only the completion token lists; later it re-pads the prompts on the left (the same width) and the
completions on the right, cut after the first EOS.  So the trainer's ``[prompt | completion]`` tensor of width
``P + T'`` is the first ``P + T'`` columns of ``generate``'s ``sequences`` wherever its attention mask is 1, and a
route trace recorded in ``generate`` (:meth:`RoutingController.record`) lines up with it column for column.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from offpolicy_moe.routing import RouteTrace, TraceValidationError

__all__ = ["GenerationRecord", "behaviour_logprobs", "capture_generate"]


def behaviour_logprobs(scores: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[B, T]`` (float32) of the sampled ``tokens[B, T]`` under ``generate``'s processed scores
    (``output_scores=True``, after every warper): the behaviour policy ``mu`` of the TIS / MIS / IcePop weights
    (Yao et al. 2025)."""
    if len(scores) != tokens.shape[1]:
        raise ValueError(f"{len(scores)} score steps for {tokens.shape[1]} generated tokens")
    cols = [torch.log_softmax(s.float(), -1).gather(1, tokens[:, t:t + 1].to(s.device)) for t, s in enumerate(scores)]
    return torch.cat(cols, 1) if cols else torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device)


@dataclass
class GenerationRecord:
    """One ``generate`` call: ``sequences[B, P + T]``, the prompt width ``P``, behaviour log-probs ``[B, T]``, and
    the routes recorded on ``sequences`` (None when not recorded)."""

    sequences: torch.Tensor
    prompt_width: int
    behav_logp: torch.Tensor
    trace: Optional[RouteTrace] = None

    def check_layout(self, input_ids: torch.Tensor, logits_to_keep: int) -> int:
        """The width ``P + T'`` of TRL's ``[prompt | completion]`` tensor, after checking it has this call's rows,
        prompt width and at most its completion width (a one-line error otherwise)."""
        b, width = input_ids.shape
        p = width - int(logits_to_keep)
        if b != self.sequences.shape[0] or p != self.prompt_width or width > self.sequences.shape[1]:
            raise TraceValidationError(
                f"TRL's batch [B, P + T] = [{b}, {p} + {logits_to_keep}] is not laid out like the generate call "
                f"[{self.sequences.shape[0]}, {self.prompt_width} + {self.sequences.shape[1] - self.prompt_width}]")
        return width

    def trace_for(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> RouteTrace:
        """The recorded routes laid out like TRL's ``input_ids`` ``[B, P + T']``: the first ``P + T'`` columns,
        recorded only where ``attention_mask`` is 1, tied to ``generate``'s tokens (a replay then checks that every
        recorded column holds the same token in TRL's tensor)."""
        if self.trace is None:
            raise ValueError("no routes were recorded in this generate call")
        width = self.check_layout(input_ids, logits_to_keep)
        t = self.trace
        ids = t.long_ids()[:, :width]
        trace = RouteTrace.from_ids(ids, t.num_experts, t.top_k, t.layer_ids,
                                    recorded=attention_mask.bool().to(ids.device))
        return trace.with_tokens(self.sequences[:, :width])

    def behav_for(self, completion_mask: torch.Tensor) -> torch.Tensor:
        """Behaviour log-probs of TRL's completion columns ``[B, T']`` (0 where ``completion_mask`` is 0)."""
        width = completion_mask.shape[1]
        lp = self.behav_logp[:, :width].to(completion_mask.device)
        return torch.where(completion_mask.bool(), lp, torch.zeros((), dtype=lp.dtype, device=lp.device))


@contextlib.contextmanager
def capture_generate(model: nn.Module, sink: list) -> Iterator[None]:
    """While open, ``model.generate`` also appends ``(sequences, prompt_width, behaviour_logprobs)`` to ``sink`` and
    returns ``sequences`` as the caller asked; the wrapper is an instance attribute, removed on exit."""
    had = "generate" in model.__dict__
    orig = model.generate

    def generate(*args, **kwargs):
        gc = kwargs.get("generation_config")
        want_dict = bool(kwargs.get("return_dict_in_generate", getattr(gc, "return_dict_in_generate", False)))
        if gc is not None:        # one source of generation settings: a copy of the caller's config
            gc = copy.deepcopy(gc)
            gc.output_scores = gc.return_dict_in_generate = True
            kwargs["generation_config"] = gc
        else:
            kwargs["output_scores"] = kwargs["return_dict_in_generate"] = True
        out = orig(*args, **kwargs)
        seq = out.sequences
        width = seq.shape[1] - len(out.scores)
        sink.append((seq, width, behaviour_logprobs(out.scores, seq[:, width:])))
        return out if want_dict else seq

    model.generate = generate
    try:
        yield
    finally:
        if had:
            model.generate = orig
        else:
            del model.generate
