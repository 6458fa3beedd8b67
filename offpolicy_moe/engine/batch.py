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
* ``old_logp_fused``  True when ``old_logp`` is taken from the (single, on-policy) update forward instead of a
                      separate recompute pass (the weights are the same θ_v, so the values are the same)
* ``version``         the policy version (number of trained steps) of the weights that generated the batch
* ``generated_at``    the trainer iteration that generated the batch (used to check no batch is lost or reused)
* ``token_versions``  ``[B, T]`` the policy version that sampled each response token (None: all ``version``);
                      tokens of one sequence may span versions when weights are updated in flight (docs/async.md)

Rewards and advantages are NOT stored: they are computed when the batch is consumed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional

import torch

__all__ = ["RolloutBatch", "MicroBatching", "max_over_processes", "micro_batch_count", "update_cut"]

_TENSOR_FIELDS = ("input_ids", "attention_mask", "response_mask", "behav_logp", "old_logp", "group_ids",
                  "trainer_routes_ok")


def micro_batch_count(rows: int, seq_len: int, grad_accum: int, max_tokens: Optional[int]) -> int:
    """Micro-batches a mini-batch of ``rows`` sequences padded to ``seq_len`` positions is cut into: at least
    ``grad_accum`` (``trainer.grad_accum``), more when one would hold more than ``max_tokens`` padded positions
    (``trainer.micro_batch_tokens``; None: no cap): ``max(grad_accum, ceil(rows * seq_len / max_tokens))``, never more
    than ``rows``.  A function of the shape only, so a rerun or a resume cuts the same way."""
    n = int(grad_accum)
    if max_tokens is not None and rows * seq_len > max_tokens:
        n = max(n, -(-rows * seq_len // int(max_tokens)))
    return max(1, min(n, rows))


def update_cut(rows: int, seq_len: int, updates_per_step: int, grad_accum: int, max_tokens: Optional[int],
               process_max: Optional[Callable[[int], int]] = None) -> list[list[torch.Tensor]]:
    """The row indices of the update's micro-batches, per mini-batch: ``rows`` split into ``updates_per_step``
    contiguous mini-batches (``tensor_split``), each into :func:`micro_batch_count` contiguous micro-batches (empty
    parts dropped).  The policy update trains on these pieces and the no-grad passes over a whole batch (old-logp,
    reference, proximal) run on the same ones, so on-policy their log-probs are those of the update's forward bit
    for bit, and no forward holds more than ``max_tokens`` padded positions (a row longer than that alone).
    ``process_max``: each count replaced by ``process_max(count)`` (the largest over the processes), never more
    than the mini-batch's rows."""
    cut = []
    for mini in torch.arange(int(rows)).tensor_split(max(1, int(updates_per_step))):
        n = micro_batch_count(int(mini.numel()), seq_len, grad_accum, max_tokens)
        if process_max is not None:
            n = max(1, min(int(process_max(n)), int(mini.numel())))
        cut.append([m for m in mini.tensor_split(n) if m.numel() > 0])
    return cut


def max_over_processes(device: torch.device) -> Callable[[int], int]:
    """``n -> max of n over the processes of the default process group`` (one all-reduce per call, which every
    process must make)."""
    def reduce_max(n: int) -> int:
        t = torch.tensor([int(n)], dtype=torch.long, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())
    return reduce_max


@dataclass(frozen=True)
class MicroBatching:
    """How a consumed batch is cut (``trainer.updates_per_step``, ``trainer.grad_accum``,
    ``trainer.micro_batch_tokens``): :meth:`cut` gives the update's pieces per mini-batch, :meth:`pieces` the same
    pieces in one list (what a no-grad pass over the whole batch runs on).

    ``process_max`` (several processes: :func:`max_over_processes`): each mini-batch's micro-batch count is the
    largest over the processes, so every process runs the same number of forwards (a sharded model gathers its
    parameters in each: unequal counts would hang), whatever its rows and padded length."""

    updates_per_step: int = 1
    grad_accum: int = 1
    max_tokens: Optional[int] = None
    process_max: Optional[Callable[[int], int]] = field(default=None, compare=False, repr=False)

    @classmethod
    def from_trainer(cls, tr: Any, process_max: Optional[Callable[[int], int]] = None) -> "MicroBatching":
        """From the ``trainer`` config section."""
        return cls(int(tr.updates_per_step), int(tr.grad_accum), getattr(tr, "micro_batch_tokens", None),
                   process_max)

    def __post_init__(self) -> None:
        if self.updates_per_step < 1 or self.grad_accum < 1 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ValueError(f"MicroBatching needs updates_per_step >= 1, grad_accum >= 1 and max_tokens >= 1 or "
                             f"None, got {self.updates_per_step}, {self.grad_accum}, {self.max_tokens}")

    def cut(self, rows: int, seq_len: int) -> list[list[torch.Tensor]]:
        """:func:`update_cut` of ``rows`` sequences of ``seq_len`` positions (counts agreed over processes)."""
        return update_cut(rows, seq_len, self.updates_per_step, self.grad_accum, self.max_tokens, self.process_max)

    def pieces(self, rows: int, seq_len: int) -> list[torch.Tensor]:
        """Every micro-batch of :meth:`cut`, in row order."""
        return [m for mini in self.cut(rows, seq_len) for m in mini]


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
    old_logp_fused: bool = False       # on-policy, one update: old_logp = the update forward's detached logp
    token_versions: Optional[torch.Tensor] = None   # [B, T] version that sampled each token (None: all `version`)

    def __post_init__(self) -> None:
        B, S = self.input_ids.shape
        if self.attention_mask.shape != (B, S):
            raise ValueError(f"attention_mask shape {tuple(self.attention_mask.shape)} != input_ids shape {(B, S)}")
        T = S - self.prompt_len
        for name in ("response_mask", "behav_logp", "old_logp", "token_versions"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (B, T):
                raise ValueError(f"{name} shape {tuple(t.shape)} != (batch, response length) {(B, T)}")
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
                   if f.name not in ("prompt_len", "version", "generated_at", "extras", "old_logp_fused")}
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
        return {f.name: _to_state(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict) -> "RolloutBatch":
        state = dict(state)
        if "old_logp_deferred" in state:     # the field's name before the trainer split
            state["old_logp_fused"] = state.pop("old_logp_deferred")
        return cls(**{k: _from_state(v) for k, v in state.items()})
