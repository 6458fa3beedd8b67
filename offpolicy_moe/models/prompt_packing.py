"""Group packing: one forward over a GRPO group's shared prompt and all of its responses.

Under causal attention the prompt positions never see a response, so the prompt's hidden states are the same for
every sample.  A packed row holds the prompt ONCE followed by the fed response tokens of each sample of the group
(``[prompt | r_1 | r_2 | ... | r_G]``); a block attention mask lets every response token see the prompt and the
earlier tokens of its own response only, with the position ids of the plain ``[prompt, response]`` row.  The
log-probs and their gradients are then the plain forward's up to float rounding, from
``U * (P + G_max * (T - 1))`` tokens instead of ``B * (P + T)`` and in ONE forward and backward.

Route traces are re-laid out the same way (:meth:`GroupPacking.pack_trace`); a group whose samples carry different
prompt routes is not packed.  The mask is a dense ``[U, 1, L, L]`` additive tensor, so packing is for short
responses (``max_mask_elements``), and the attention implementation must take a 4-D mask (``sdpa``, ``eager``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from offpolicy_moe.models.layout import position_ids_from_mask, prompt_groups
from offpolicy_moe.models.token_logprobs import token_logprobs

__all__ = ["GroupPacking", "plan_group_packing", "takes_4d_mask", "DEFAULT_MAX_MASK_ELEMENTS"]

DEFAULT_MAX_MASK_ELEMENTS = 1 << 22      # 4M mask entries (16 MiB in fp32)
_4D_MASK_ATTENTION = ("sdpa", "eager")


def takes_4d_mask(model: torch.nn.Module) -> bool:
    """True when the model's attention applies one ready 4-D additive mask as given in every layer: an ``sdpa`` or
    ``eager`` implementation, full causal attention only.  Sliding-window or chunked attention layers build their
    own windowed masks from the positions of the plain layout, which a packed row does not keep, so such models
    are not packed (the KV-cache way still shares their prompts)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "_attn_implementation", None) not in _4D_MASK_ATTENTION:
        return False
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return False
    if getattr(cfg, "attention_chunk_size", None):
        return False
    if hasattr(cfg, "use_sliding_window"):
        return not bool(cfg.use_sliding_window)
    return getattr(cfg, "sliding_window", None) is None


@dataclass(frozen=True)
class GroupPacking:
    """The packed layout of a ``[B, P+T]`` batch: ``U`` packed rows of length ``L = P + G_max * R``, ``R = T - 1``.

    ``first[u]``: a plain row holding the prompt of packed row ``u``; ``inverse[b]``: the packed row of plain row
    ``b`` (a prompt with more samples than a row takes spans several rows); ``rows``/``cols`` ``[B, R]``: where response token ``t < R`` of plain row ``b`` sits in the packed batch;
    ``allow[u, i, j]``: packed query ``i`` may attend key ``j``; ``prompt_mask``: the plain batch's ``[B, P]``
    prompt attention mask.
    """

    prompt_len: int
    fed: int
    first: torch.Tensor
    inverse: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allow: torch.Tensor
    prompt_mask: torch.Tensor

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``[U, 1, L, L]`` additive mask: 0 where allowed, the dtype's most negative value elsewhere."""
        m = torch.zeros(self.allow.shape, dtype=dtype, device=self.allow.device)
        return m.masked_fill(~self.allow, torch.finfo(dtype).min).unsqueeze(1)

    def response_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``[U, L, V]`` packed logits → ``[B, T, V]``: token 0 of row ``b`` is predicted at the prompt's last
        position of its packed row, token ``t >= 1`` at its own token ``t - 1``."""
        P = self.prompt_len
        if tuple(logits.shape[:2]) != (self.num_rows, self.length):
            raise ValueError(f"packed logits have [U, L] = {tuple(logits.shape[:2])}, the packing "
                             f"{(self.num_rows, self.length)}")
        first = logits[:, P - 1].index_select(0, self.inverse).unsqueeze(1)
        if self.fed == 0:
            return first
        return torch.cat([first, logits[self.rows, self.cols]], dim=1)

    def response_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                          kept: Optional[Any] = None) -> torch.Tensor:
        """``[B, T]`` log-probs of the response tokens ``targets [B, T]`` from the packed logits ``[U, L, V]``,
        without the ``[B, T, V]`` copy of :meth:`response_logits`: token 0 of each row from its prompt's last position,
        tokens ``t >= 1`` from one :func:`token_logprobs` call over the packed positions (each predicts at most one
        token; the others get a dummy target and no gradient).  ``kept`` (``KeptTokens [B, T]``) is laid out
        likewise."""
        P = self.prompt_len
        if tuple(logits.shape[:2]) != (self.num_rows, self.length):
            raise ValueError(f"packed logits have [U, L] = {tuple(logits.shape[:2])}, the packing "
                             f"{(self.num_rows, self.length)}")
        first = token_logprobs(logits[:, P - 1:P].index_select(0, self.inverse), targets[:, :1], temperature,
                               kept=kept.narrow(0, 1) if kept is not None else None)
        if self.fed == 0:
            return first
        packed_targets = torch.zeros(logits.shape[:2], dtype=targets.dtype, device=targets.device)
        packed_targets[self.rows, self.cols] = targets[:, 1:self.fed + 1]
        packed_kept = None
        if kept is not None:       # packed position (rows[b, t], cols[b, t]) predicts token t + 1 of row b
            src = torch.full(logits.shape[:2], -1, dtype=torch.long, device=targets.device)
            B, T = targets.shape
            src[self.rows, self.cols] = (torch.arange(B, device=targets.device).unsqueeze(1) * T
                                         + torch.arange(1, self.fed + 1, device=targets.device))
            packed_kept = kept.relayout(src)
        lp = token_logprobs(logits, packed_targets, temperature, kept=packed_kept)
        return torch.cat([first, lp[self.rows, self.cols]], dim=1)

    def pack_trace(self, trace: Any) -> Optional[Any]:
        """The route trace ``[B, P+T, L_moe, K]`` laid out like the packed batch ``[U, L, L_moe, K]`` (positions
        that hold no token of the plain batch: the sentinel), or None when two samples of one prompt carry
        different routes on a real prompt token."""
        ids = trace.ids
        P, R = self.prompt_len, self.fed
        want = (int(self.inverse.shape[0]), P + R + 1)
        if tuple(ids.shape[:2]) != want:
            raise ValueError(f"route trace has [B, S] = {tuple(ids.shape[:2])} but the packed batch was planned for "
                             f"[B, S] = {want}: lay the trace out exactly like the input_ids")
        prompt = ids[:, :P]
        ref = prompt.index_select(0, self.first).index_select(0, self.inverse)
        real = self.prompt_mask.bool()[:, :, None, None]
        if not bool(torch.where(real, prompt == ref, torch.ones_like(real)).all()):
            return None
        out = torch.full((self.num_rows, self.length) + tuple(ids.shape[2:]), trace.sentinel, dtype=ids.dtype,
                         device=ids.device)
        out[:, :P] = prompt.index_select(0, self.first)
        if R:
            out[self.rows, self.cols] = ids[:, P:P + R]
        return type(trace)(out, trace.num_experts, trace.top_k, trace.layer_ids)

    def unpack_trace(self, packed: Any) -> Any:
        """A trace recorded on the packed batch ``[U, L, L_moe, K]`` laid out like the plain batch
        ``[B, P+T, L_moe, K]``; the last position (never fed) holds the sentinel, as in the engine's traces."""
        ids = packed.ids
        if tuple(ids.shape[:2]) != (self.num_rows, self.length):
            raise ValueError(f"packed trace has [U, L] = {tuple(ids.shape[:2])}, the packing "
                             f"{(self.num_rows, self.length)}")
        P, R = self.prompt_len, self.fed
        B = int(self.inverse.shape[0])
        out = torch.full((B, P + R + 1) + tuple(ids.shape[2:]), packed.sentinel, dtype=ids.dtype, device=ids.device)
        out[:, :P] = ids[:, :P].index_select(0, self.inverse.to(ids.device))
        if R:
            out[:, P:P + R] = ids[self.rows.to(ids.device), self.cols.to(ids.device)]
        return type(packed)(out, packed.num_experts, packed.top_k, packed.layer_ids)


def _samples_per_row(counts: torch.Tensor, prompt_len: int, fed: int) -> int:
    """Samples packed per row: the group size ``c`` (one of the sizes present) that minimises the packed tokens
    ``sum_u ceil(n_u / c) * (P + c * R)``.  Two groups that happen to share a prompt are then packed as two rows,
    not one row twice as long (which would widen every row of the batch)."""
    best, best_cost = 1, None
    for c in sorted({int(n) for n in counts.tolist()}):
        cost = int(((counts + c - 1) // c).sum()) * (prompt_len + c * fed)
        if best_cost is None or cost < best_cost:
            best, best_cost = c, cost
    return best


def plan_group_packing(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, *,
                       max_mask_elements: int = DEFAULT_MAX_MASK_ELEMENTS,
                       samples_per_row: Optional[int] = None) -> Optional[GroupPacking]:
    """The packed layout of a batch whose rows repeat prompts, or None when packing does not pay or does not fit:
    fewer than half of the rows repeat a prompt (``2U > B``), or ``U * L * L > max_mask_elements``.

    ``samples_per_row`` fixes the response slots of a packed row instead of choosing them from the rows present
    (see :func:`~offpolicy_moe.models.response_logprobs.plan_shared_forward`'s ``group_size``)."""
    if samples_per_row is not None and samples_per_row < 1:
        raise ValueError(f"samples_per_row must be >= 1, got {samples_per_row}")

    B, S = input_ids.shape
    P, R = prompt_len, S - prompt_len - 1
    if B == 0 or not 0 < P < S:
        return None
    first_u, inverse_u = prompt_groups(input_ids, attention_mask, P)
    U = int(first_u.numel())
    if 2 * U > B:
        return None
    dev = input_ids.device
    counts = torch.bincount(inverse_u, minlength=U)
    # rank of each row among the rows of its prompt
    order = torch.argsort(inverse_u, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty(B, dtype=torch.long, device=dev)
    rank[order] = torch.arange(B, device=dev) - starts.index_select(0, inverse_u.index_select(0, order))
    G = _samples_per_row(counts, P, R) if samples_per_row is None else max(int(samples_per_row), 1)
    per_prompt = (counts + G - 1) // G                   # packed rows of each prompt
    row_start = torch.cumsum(per_prompt, 0) - per_prompt
    inverse = row_start.index_select(0, inverse_u) + rank // G
    slot = rank % G
    first = first_u.repeat_interleave(per_prompt)
    U = int(first.numel())
    L = P + G * R
    if U * L * L > max_mask_elements:
        return None
    pos = position_ids_from_mask(attention_mask)
    ids = torch.zeros((U, L), dtype=input_ids.dtype, device=dev)
    pids = torch.zeros((U, L), dtype=pos.dtype, device=dev)
    seg = torch.full((U, L), -2, dtype=torch.long, device=dev)       # -1 prompt, g: response slot g, -2: unused
    valid = torch.zeros((U, L), dtype=torch.bool, device=dev)
    ids[:, :P] = input_ids[first, :P]
    pids[:, :P] = pos[first, :P]
    seg[:, :P] = -1
    valid[:, :P] = attention_mask[first, :P].bool()
    rows = inverse.unsqueeze(1).expand(B, R)
    cols = P + slot.unsqueeze(1) * R + torch.arange(R, device=dev).unsqueeze(0)
    if R:
        ids[rows, cols] = input_ids[:, P:P + R]
        pids[rows, cols] = pos[:, P:P + R]
        seg[rows, cols] = slot.unsqueeze(1).expand(B, R)
        valid[rows, cols] = attention_mask[:, P:P + R].bool()
    idx = torch.arange(L, device=dev)
    causal = idx.view(1, L, 1) >= idx.view(1, 1, L)
    same = (seg.unsqueeze(1) == -1) | (seg.unsqueeze(2) == seg.unsqueeze(1))
    allow = (causal & same & valid.unsqueeze(1)) | torch.eye(L, dtype=torch.bool, device=dev).unsqueeze(0)
    return GroupPacking(prompt_len=P, fed=R, first=first, inverse=inverse, rows=rows, cols=cols, input_ids=ids,
                        position_ids=pids, allow=allow, prompt_mask=attention_mask[:, :P])
