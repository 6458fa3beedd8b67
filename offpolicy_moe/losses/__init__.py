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

The names are imported from their modules on first use: :mod:`.vocabulary`, :mod:`.option_checks` and
:mod:`.catalogue` (what a config may name and set) import no torch.
"""
from offpolicy_moe.lazy import lazy_exports

_EXPORTS = {
    "vocabulary": ("AGG_MODES", "KL_KINDS"),
    "catalogue": ("LossInterface", "list_policy_losses", "loss_interface", "loss_options_problem",
                  "policy_loss_options", "resolve_loss_options"),
    "_validate": ("LOG_RATIO_BOUND", "NonFiniteInput", "ratio_bound", "value_checks"),
    "advantages": ("group_advantages",),
    "aggregation": ("aggregate", "global_counts"),
    "correction": ("correction_weights", "mismatch_metrics"),
    "kl": ("kl_penalty",),
    "m2po": ("m2po_adaptive_cap", "m2po_loss", "m2po_mask"),
    "objectives": ("grpo_loss", "gspo_loss", "metrics_to_floats", "unclipped_loss"),
    "registry": ("LossSpec", "get_loss_spec", "get_policy_loss", "register_policy_loss", "unregister_policy_loss"),
    "cispo": ("cispo_loss",),
    "dppo": ("dppo_kl_loss", "dppo_tv_loss"),
    "gmpo": ("gmpo_loss",),
    "sapo": ("sapo_loss",),
    "vespo": ("vespo_loss",),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
