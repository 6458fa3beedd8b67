"""The rollout batch: everything one generation step produced, carried through the staleness buffer.

Layout (``B`` sequences, ``P`` prompt positions — prompts are left-padded to a common length — and ``T`` response
positions, right-padded after the end-of-sequence token):

* ``input_ids``       ``[B, P+T]`` prompt + response token ids
* ``attention_mask``  ``[B, P+T]`` 1 on real tokens (prompt and response up to and including EOS)
* ``response_mask``   ``[B, T]``   1 on response tokens that count in the loss
* ``behav_logp``      ``[B, T]``   log-prob of each sampled token under the engine's SAMPLING distribution (μ)
* ``old_logp``        ``[B, T]``   the trainer's log-prob under the generating weights θ_v (None until computed)
* ``routes``          the engine's route trace (``RouteTrace``, ``[B, P+T, L_moe, K]``) or None
* ``group_ids``       ``[B]`` which prompt (group) a sequence answers; ``answers``/``completions`` as text
* ``version``         the policy version (number of trained steps) of the weights that generated the batch
* ``generated_at``    the trainer iteration that generated the batch (used to check no batch is lost or reused)
* ``token_versions``  ``[B, T]`` the policy version that sampled each response token (None: all ``version``);
                      tokens of one sequence may span versions when weights are updated in flight (docs/async.md)
* ``kept_tokens``     ``[B, T]`` :class:`~offpolicy_moe.models.kept_tokens.KeptTokens`, the kept set of each
                      sampled token when the engine truncated its distribution (None otherwise)

Rewards and advantages are NOT stored: they are computed when the batch is consumed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch

from offpolicy_moe.models.kept_tokens import KeptTokens

__all__ = ["LENGTH_QUANTILES", "RolloutBatch", "generation_shape"]

_TENSOR_FIELDS = ("input_ids", "attention_mask", "response_mask", "behav_logp", "old_logp", "group_ids",
                  "trainer_routes_ok")


def _select(obj: Any, idx: torch.Tensor) -> Any:
    """Row-select a tensor, a RouteTrace-like object (``index_select``) or a list."""
    if obj is None:
        return None
    if isinstance(obj, torch.Tensor):
        return obj.index_select(0, idx.to(obj.device))
    if isinstance(obj, list):
        return [obj[i] for i in idx.tolist()]
    if hasattr(obj, "index_select"):
        try:
            return obj.index_select(idx)
        except TypeError:
            return obj.index_select(0, idx)
    raise TypeError(f"cannot row-select an object of type {type(obj).__name__}")


def _to_state(obj: Any) -> Any:
    if obj is None or isinstance(obj, (torch.Tensor, list, tuple, int, float, str)):
        return obj
    if isinstance(obj, dict) and "__class__" not in obj:
        return dict(obj)
    if hasattr(obj, "state_dict"):
        return {"__class__": f"{type(obj).__module__}:{type(obj).__qualname__}", "state": obj.state_dict()}
    raise TypeError(f"cannot serialise an object of type {type(obj).__name__}")


def _from_state(obj: Any) -> Any:
    if isinstance(obj, dict) and "__class__" in obj:
        import importlib

        mod, name = obj["__class__"].split(":")
        cls = getattr(importlib.import_module(mod), name)
        return cls.from_state_dict(obj["state"])
    return obj


@dataclass
class RolloutBatch:
    """One step's rollouts (see module docstring for shapes)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    behav_logp: torch.Tensor
    group_ids: torch.Tensor
    answers: list
    completions: list
    prompt_len: int
    version: int
    generated_at: int = 0
    old_logp: Optional[torch.Tensor] = None
    routes: Any = None                 # engine routes (R3 / PR2 / routing metrics)
    trainer_routes: Any = None         # routes recorded by the trainer in the old-logp pass (R2)
    trainer_routes_ok: Optional[torch.Tensor] = None
    pr2_features: Any = None
    extras: dict = field(default_factory=dict)   # float metrics measured at generation time
    token_versions: Optional[torch.Tensor] = None   # [B, T] version that sampled each token (None: all `version`)
    kept_tokens: Optional[KeptTokens] = None        # [B, T] kept sets of top-k / top-p (None: no truncation)

    def __post_init__(self) -> None:
        B, S = self.input_ids.shape
        if self.attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask shape {tuple(self.attention_mask.shape)} != input_ids shape {(B, S)}")
        T = S - self.prompt_len
        for name in ("response_mask", "behav_logp", "old_logp", "token_versions"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (B, T):
                raise ValueError(f"{name} shape {tuple(t.shape)} != (batch, response length) {(B, T)}")
        if self.kept_tokens is not None and self.kept_tokens.shape != (B, T):
            raise ValueError(f"kept_tokens shape {self.kept_tokens.shape} != (batch, response length) {(B, T)}")
        if self.group_ids.shape != (B,):
            raise ValueError(f"group_ids shape {tuple(self.group_ids.shape)} != ({B},)")
        if len(self.answers) != B or len(self.completions) != B:
            raise ValueError(f"answers ({len(self.answers)}) and completions ({len(self.completions)}) must have "
                             f"{B} entries")

    # ------------------------------------------------------------------ shapes
    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.input_ids.shape[1] - self.prompt_len)

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_len:]

    def num_tokens(self) -> int:
        return int(self.response_mask.sum().item())

    # ------------------------------------------------------------------ selection
    def index_select(self, idx: torch.Tensor | list) -> "RolloutBatch":
        """Rows ``idx`` of every per-sequence field (routes and features included)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        changes = {f.name: _select(getattr(self, f.name), idx)
                   for f in fields(self)
                   if f.name not in ("prompt_len", "version", "generated_at", "extras")}
        return replace(self, **changes)

    def split(self, n: int) -> list["RolloutBatch"]:
        """``n`` contiguous, nearly equal parts (order kept; parts may be empty only if n > size)."""
        if n < 1:
            raise ValueError(f"split: n must be >= 1, got {n}")
        parts = torch.arange(self.size).tensor_split(n)
        return [self.index_select(p) for p in parts]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Plain-python/tensor dict (torch.save-able); inverse of :meth:`from_state_dict`."""
        state = {f.name: _to_state(getattr(self, f.name)) for f in fields(self) if f.name != "kept_tokens"}
        # plain tensors (no class record): a checkpoint's restricted loader reads them as they are
        state["kept_tokens"] = self.kept_tokens.state_dict() if self.kept_tokens is not None else None
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> "RolloutBatch":
        state = dict(state)
        for gone in ("old_logp_fused", "old_logp_deferred"):     # flags of states written by earlier versions
            state.pop(gone, None)
        kept = state.pop("kept_tokens", None)     # absent in states written before kept sets existed
        return cls(**{k: _from_state(v) for k, v in state.items()},
                   kept_tokens=KeptTokens.from_state_dict(kept) if kept is not None else None)


#: the response-length quantiles :func:`generation_shape` reports, in percent
LENGTH_QUANTILES = tuple(range(0, 101, 10))


def generation_shape(batch: RolloutBatch) -> dict[str, float]:
    """The shape generation had to decode, for the bound of a step's generation (``experiments/bench/tta``):
    ``rollout/prompt_len`` (the padded prompt width: the KV columns at the first decode forward) and
    ``rollout/response_len_q<p>`` for ``p`` in :data:`LENGTH_QUANTILES`, the lower ``p``-th percentile of the rows'
    response lengths (EOS included), so that the rows still decoding at each position can be read back (``q000`` the
    shortest, ``q100`` the longest)."""
    lengths = batch.response_mask.sum(-1).to(torch.float64)
    if lengths.numel() == 0:
        raise ValueError("generation_shape: the batch has no rows")
    qs = torch.quantile(lengths, torch.tensor([p / 100 for p in LENGTH_QUANTILES], dtype=torch.float64),
                        interpolation="lower")
    out = {"rollout/prompt_len": float(batch.prompt_len)}
    out.update({f"rollout/response_len_q{p:03d}": float(q) for p, q in zip(LENGTH_QUANTILES, qs.tolist())})
    return out
