"""The value check of a weight sync: the engine's log-probs of a fixed probe against the trainer's own
(``rollout.vllm_check_sync``), held to a bound derived from the two precisions and the model's depth, not tuned.

Each of the ``L`` decoder layers adds rounding of relative size ``u`` (the unit roundoff of the coarser precision,
``2^-24`` for float32, ``2^-8`` for bfloat16, ``2^-11`` for float16) through ``c = 8`` roundings (two norms,
attention, the router and the experts, the residual sums), and a sum of ``H`` products grows at most like
``sqrt(H)`` for random signs (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1).  A
log-prob's error is at most twice the logits' largest error, relative to ``1 + max |z|``:

    tol = 2 * c * (L + 2) * u * sqrt(H) * (1 + max |z|)

(``L + 2``: the embedding and the head).  For the embedded model (``L = 2, H = 64``) that is ``1.5e-5`` at
float32 and ``1.0`` at bfloat16 with logits of size 1: a bfloat16 engine catches a stale parameter only when it
moves a log-prob by more than its own rounding can.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["PROBE_TOKENS", "ProbeResult", "probe_tokens", "reference_logprobs", "tolerance", "compare",
           "unit_roundoff"]

PROBE_TOKENS = 16          # tokens of the probe sequence
ROUNDINGS_PER_LAYER = 8    # c of the module docstring


@dataclass(frozen=True)
class ProbeResult:
    """The largest log-prob difference over the probe, the bound it is held to, and where it was largest."""

    max_abs_diff: float
    tolerance: float
    worst_position: int

    @property
    def ok(self) -> bool:
        """True when the difference is within the bound (and finite)."""
        return math.isfinite(self.max_abs_diff) and self.max_abs_diff <= self.tolerance


def probe_tokens(vocab_size: int, length: int = PROBE_TOKENS, seed: int = 0) -> list[int]:
    """A fixed sequence of ``length`` token ids drawn uniformly from ``[0, vocab_size)`` with ``seed`` (the same on
    every machine: torch's CPU generator)."""
    if vocab_size < 1 or length < 2:
        raise ValueError(f"probe_tokens needs vocab_size >= 1 and length >= 2, got {vocab_size}, {length}")
    g = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, int(vocab_size), (int(length),), generator=g).tolist()


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2`` of a floating dtype (``2^-24`` for float32, ``2^-8`` for bfloat16)."""
    return float(torch.finfo(dtype).eps) / 2.0


def tolerance(dtypes: Sequence[torch.dtype], num_layers: int, hidden_size: int, logit_scale: float) -> float:
    """The bound of the module docstring for the coarsest of ``dtypes``."""
    u = max(unit_roundoff(d) for d in dtypes)
    return 2.0 * ROUNDINGS_PER_LAYER * (int(num_layers) + 2) * u * math.sqrt(int(hidden_size)) * (1.0 + logit_scale)


@torch.no_grad()
def reference_logprobs(policy: torch.nn.Module, state_dict: dict,
                       token_ids: Sequence[int]) -> tuple[torch.Tensor, float]:
    """The log-prob of each token of ``token_ids`` after the first under ``policy`` computed with the tensors of
    ``state_dict`` (the ones being synced), in float32 on the policy's device, and the largest |logit|."""
    device = next(policy.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    tensors = {k: v.to(device) for k, v in state_dict.items()}
    logits = torch.func.functional_call(policy, tensors, args=(ids,), strict=False).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return logp.cpu(), float(logits.abs().max())


def compare(engine_logp: Sequence[float], reference: torch.Tensor, logit_scale: float,
            dtypes: Sequence[torch.dtype], config: Any) -> ProbeResult:
    """Hold the engine's probe log-probs against the reference (see module docstring); ``config`` is the model's
    transformers config (its depth and width)."""
    text = getattr(config, "get_text_config", lambda: config)()
    got = torch.tensor([float(x) for x in engine_logp], dtype=torch.float64)
    ref = reference.to(torch.float64)
    if got.shape != ref.shape:
        raise ValueError(f"the engine scored {got.numel()} probe tokens, the trainer {ref.numel()}")
    diff = (got - ref).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf))
    worst = int(diff.argmax())
    return ProbeResult(max_abs_diff=float(diff[worst]), worst_position=worst + 1,
                       tolerance=tolerance(dtypes, int(text.num_hidden_layers), int(text.hidden_size), logit_scale))
