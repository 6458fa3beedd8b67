"""Register offpolicy_moe's objectives in verl's policy-loss registry.

Usage (in the verl process, before the actor builds its loss)::

    from offpolicy_moe.integrations import verl as opm_verl
    opm_verl.register()   # adds offpolicy_moe/grpo, offpolicy_moe/gspo, offpolicy_moe/m2po, offpolicy_moe/unclipped

then select one with ``actor_rollout_ref.actor.policy_loss.loss_mode=offpolicy_moe/m2po``.

The registered functions follow verl's calling convention
``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
rollout_is_weights=None) -> (loss, metrics: dict[str, float])`` and read from ``config`` (attribute
or mapping access; ``config.policy_loss.<key>`` is searched before ``config.<key>``):

* clip ranges: ``clip_ratio_low`` / ``clip_ratio_high`` (falling back to ``clip_ratio``, then to the
  objective's own default), ``clip_ratio_c`` as GRPO's dual clip;
* M2PO: ``m2po_tau`` (or ``m2_budget`` / ``M2_budget``), ``m2po_variant``, ``m2po_scope``
  (default ``local``: verl calls the loss per micro-batch; ``global`` selects across data-parallel
  ranks through the default process group, so every rank must call in lockstep);
* global counts: ``global_batch_info = {dp_size, batch_num_tokens, global_batch_size}`` as verl
  passes them; the loss is then multiplied by ``dp_size`` (DDP averages over ranks), and
  ``loss_scale_factor`` is the ``seq-mean-token-sum-norm`` constant.

verl is imported lazily and is not a dependency of offpolicy_moe.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from ..losses import get_policy_loss, metrics_to_floats

OBJECTIVES = ("grpo", "gspo", "m2po", "unclipped")
_MISSING = object()


def _lookup(config: Any, key: str) -> Any:
    if config is None:
        return _MISSING
    if isinstance(config, Mapping):
        return config.get(key, _MISSING)
    try:
        return getattr(config, key)
    except (AttributeError, KeyError):
        return _MISSING


def config_value(config: Any, *keys: str, default: Any = None) -> Any:
    """First non-None value among ``config.policy_loss.<key>`` and ``config.<key>`` for ``keys``."""
    scopes = []
    sub = _lookup(config, "policy_loss")
    if sub is not _MISSING and sub is not None:
        scopes.append(sub)
    scopes.append(config)
    for scope in scopes:
        for key in keys:
            v = _lookup(scope, key)
            if v is not _MISSING and v is not None:
                return v
    return default


def _options(name: str, config: Any) -> dict:
    """Objective-specific keyword options read from a verl actor config."""
    opts: dict = {}
    if name in ("grpo", "gspo"):
        base = config_value(config, "clip_ratio")
        opts["clip_low"] = config_value(config, "clip_ratio_low", default=base)
        opts["clip_high"] = config_value(config, "clip_ratio_high", default=base)
        if name == "grpo":
            opts["dual_clip"] = config_value(config, "clip_ratio_c")
    elif name == "m2po":
        opts["tau"] = float(config_value(config, "m2po_tau", "m2_budget", "M2_budget", default=0.04))
        opts["variant"] = config_value(config, "m2po_variant", default="mask")
        scope = config_value(config, "m2po_scope", default="local")
        opts["scope"] = scope
        if scope == "global":
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                opts["process_group"] = dist.group.WORLD
    return opts


def _batch_info(config: Any) -> tuple[dict, float]:
    info = config_value(config, "global_batch_info", default=None) or {}
    get = (lambda k: info.get(k)) if isinstance(info, Mapping) else (lambda k: getattr(info, k, None))
    kw: dict = {}
    scale = 1.0
    if get("batch_num_tokens") is not None:
        kw["num_tokens"] = get("batch_num_tokens")
    if get("global_batch_size") is not None:
        kw["num_seqs"] = get("global_batch_size")
    if kw and get("dp_size") is not None:
        scale = float(get("dp_size"))
    norm = config_value(config, "loss_scale_factor")
    if norm is not None:
        kw["norm_length"] = float(norm)
    return kw, scale


def make_verl_loss(name: str) -> Callable:
    """Wrap our objective ``name`` with verl's policy-loss calling convention."""
    fn = get_policy_loss(name)

    def verl_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Optional[Any] = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ):
        counts, scale = _batch_info(config)
        loss, metrics = fn(
            log_prob, old_log_prob, advantages, response_mask,
            agg=loss_agg_mode, weights=rollout_is_weights, **counts, **_options(name, config),
        )
        out = metrics_to_floats(metrics)
        # verl's own metric names, next to ours
        out.setdefault("actor/pg_clipfrac", out.get("actor/clipfrac", 0.0))
        out.setdefault("actor/pg_clipfrac_lower", out.get("actor/dual_clipfrac", 0.0))
        return loss * scale if scale != 1.0 else loss, out

    verl_policy_loss.__name__ = f"offpolicy_moe_{name}_verl"
    verl_policy_loss.__doc__ = f"offpolicy_moe {name!r} objective with verl's calling convention.\n\n" + (fn.__doc__ or "")
    return verl_policy_loss


def _core_algos():
    try:
        return importlib.import_module("verl.trainer.ppo.core_algos")
    except ImportError as err:
        raise ImportError(
            "offpolicy_moe.integrations.verl needs verl, which is not installed (it is not a "
            "dependency of offpolicy_moe). Install it with `pip install verl` (see "
            "https://verl.readthedocs.io for the CUDA/vLLM extras); offpolicy_moe's own trainer and "
            f"losses work without it. Original error: {err}"
        ) from err


def register(prefix: str = "offpolicy_moe", names: tuple = OBJECTIVES) -> list[str]:
    """Register our objectives into verl under ``<prefix>/<name>``; returns the registered names.

    Idempotent: a name already registered (by a previous call) is left as it is.
    """
    core = _core_algos()
    registry = getattr(core, "POLICY_LOSS_REGISTRY", None)
    done = []
    for name in names:
        full = f"{prefix}/{name}"
        if registry is None or full not in registry:
            core.register_policy_loss(full)(make_verl_loss(name))
        done.append(full)
    return done


__all__ = ["register", "make_verl_loss", "config_value", "OBJECTIVES"]
