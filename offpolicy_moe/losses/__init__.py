"""Policy-gradient losses for RL on stale, off-policy data (imports torch only).

Everything is a pure function on tensors ``[B, T]`` (response-aligned, with a response mask):

* :func:`group_advantages`: GRPO / Dr. GRPO group-relative advantages;
* :func:`aggregate`, :func:`global_counts`: the four aggregation modes with global counts;
* objectives :func:`grpo_loss`, :func:`gspo_loss`, :func:`m2po_loss`, :func:`unclipped_loss`, all
  ``(logp, old_logp, advantages, mask, *, agg, weights, num_tokens, num_seqs, norm_length,
  **options) -> (loss, metrics)``;
* :func:`m2po_mask`, :func:`m2po_adaptive_cap`: exact global M2PO selection (micro-batches, ranks);
* :func:`correction_weights` (TIS / MIS / IcePop), :func:`mismatch_metrics`;
* :func:`cispo_loss` (clipped, stop-gradient importance weight; every token keeps a gradient);
* :func:`dppo_tv_loss`, :func:`dppo_kl_loss` (divergence trust-region mask), :func:`gmpo_loss`
  (geometric mean), :func:`sapo_loss` (soft gate), :func:`vespo_loss` (sequence gamma kernel);
* :mod:`.reference`: the plain-autograd body of every objective, checked against the fast path;
* :func:`kl_penalty`; the registry :func:`register_policy_loss` / :func:`get_loss_spec` /
  :func:`resolve_loss_options` (each loss registers itself, with its options and capabilities).

Metrics are dicts of detached float32 0-d tensors (no host sync); :func:`metrics_to_floats`
converts a dict with one sync.
"""
from ._validate import AGG_MODES, LOG_RATIO_BOUND, ratio_bound, value_checks
from .advantages import group_advantages
from .aggregation import aggregate, global_counts
from .correction import correction_weights, mismatch_metrics
from .kl import KL_KINDS, kl_penalty
from .m2po import m2po_adaptive_cap, m2po_loss, m2po_mask
from .objectives import grpo_loss, gspo_loss, metrics_to_floats, unclipped_loss
from .registry import (
    LossSpec,
    get_loss_spec,
    get_policy_loss,
    list_policy_losses,
    loss_options_problem,
    policy_loss_options,
    register_policy_loss,
    resolve_loss_options,
    unregister_policy_loss,
)
from .cispo import cispo_loss
from .dppo import dppo_kl_loss, dppo_tv_loss
from .gmpo import gmpo_loss
from .sapo import sapo_loss
from .vespo import vespo_loss

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "LOG_RATIO_BOUND",
    "LossSpec",
    "aggregate",
    "cispo_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "gmpo_loss",
    "sapo_loss",
    "vespo_loss",
    "get_loss_spec",
    "ratio_bound",
    "resolve_loss_options",
    "correction_weights",
    "get_policy_loss",
    "global_counts",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "kl_penalty",
    "list_policy_losses",
    "loss_options_problem",
    "m2po_adaptive_cap",
    "m2po_loss",
    "m2po_mask",
    "metrics_to_floats",
    "mismatch_metrics",
    "policy_loss_options",
    "register_policy_loss",
    "unclipped_loss",
    "unregister_policy_loss",
    "value_checks",
]
