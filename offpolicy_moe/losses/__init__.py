"""Policy-gradient losses for RL on stale, off-policy data (imports torch only): pure functions on response-aligned
``[B, T]`` tensors with a response mask.  The objectives share one calling convention (:mod:`.registry`);
:mod:`.reference` holds the plain-autograd body of each.  Metrics are dicts of detached float32 0-d tensors (no host
sync; :func:`metrics_to_floats` converts with one).  Names are imported from their modules on first use;
:mod:`.vocabulary`, :mod:`.option_checks` and :mod:`.catalogue` import no torch.
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
