"""Register every offpolicy_moe objective in verl's policy-loss registry (docs/losses.md, "verl").

Usage (in the verl process, before the actor builds its loss)::

    from offpolicy_moe.integrations import verl as opm_verl
    opm_verl.register()   # adds offpolicy_moe/<name> for every registered loss (cispo, grpo, gspo, m2po, ...)

then select one with ``actor_rollout_ref.actor.policy_loss.loss_mode=offpolicy_moe/m2po``.  The registered
functions take verl's calling convention ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode="token-mean", config=None, rollout_is_weights=None) -> (loss, metrics)`` and never name a loss: the
registry says which options a loss has, read from ``config.policy_loss.<name>`` first, then verl's clip keys of the
same meaning.  verl is imported lazily and is not a dependency of offpolicy_moe.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..losses import LossSpec, get_loss_spec, list_policy_losses, metrics_to_floats, resolve_loss_options

_MISSING = object()

VERL_KEYS: dict[str, tuple[str, ...]] = {
    "clip_low": ("clip_ratio_low", "clip_ratio"),
    "clip_high": ("clip_ratio_high", "clip_ratio"),
    "dual_clip": ("clip_ratio_c",),
    # DPPO: verl reads its TV / KL thresholds from the clip keys and truncates the ratio at clip_ratio_c
    "delta_low": ("clip_ratio_low", "clip_ratio"),
    "delta_high": ("clip_ratio_high", "clip_ratio"),
    "ratio_cap": ("clip_ratio_c",),
    # SAPO: the gate temperatures sit at the actor's top level under the same names
    "tau_pos": ("tau_pos",),
    "tau_neg": ("tau_neg",),
}
"""Our option name -> verl's actor keys of the same meaning (first non-None wins).

verl 0.9 feeds these keys to every loss that has the option: GMPO's log-space ``clip_low``/``clip_high``
come from ``clip_ratio_low``/``_high`` (verl's ``geo_mean`` does the same; default 0.2 there, 0.4 in the
paper and in this library), DPPO's thresholds from the same keys and its ratio cap from ``clip_ratio_c``
(3.0 in verl's ActorConfig).  VESPO has no verl keys (verl ships it as a recipe): its options live under
``policy_loss.vespo``."""


def _lookup(config: Any, key: str) -> Any:
    if config is None:
        return _MISSING
    if isinstance(config, Mapping):
        return config.get(key, _MISSING)
    try:
        return getattr(config, key)
    except (AttributeError, KeyError):
        return _MISSING


def _scopes(config: Any) -> list:
    sub = _lookup(config, "policy_loss")
    return ([sub] if sub is not _MISSING and sub is not None else []) + [config]


def config_value(config: Any, *keys: str, default: Any = None) -> Any:
    """First non-None value among ``config.policy_loss.<key>`` and ``config.<key>`` for ``keys``."""
    for scope in _scopes(config):
        for key in keys:
            v = _lookup(scope, key)
            if v is not _MISSING and v is not None:
                return v
    return default


def _as_dict(section: Any) -> dict:
    if isinstance(section, Mapping):
        return dict(section)
    if hasattr(section, "items"):
        return dict(section.items())
    return dict(vars(section))


def loss_options(spec: LossSpec, config: Any) -> dict:
    """The options of loss ``spec`` from a verl actor config (see the module docstring), validated."""
    opts: dict = {}
    for option in spec.options:
        keys = VERL_KEYS.get(option, ())
        v = config_value(config, *keys) if keys else None
        if v is not None:
            opts[option] = v
    for scope in reversed(_scopes(config)):
        section = _lookup(scope, spec.name)
        if section is not _MISSING and section is not None:
            opts.update(_as_dict(section))
    return resolve_loss_options(spec.name, opts)


def _runtime(spec: LossSpec, options: dict, cross_rank: bool) -> dict:
    if not cross_rank:
        return {}
    if spec.distributed and spec.wants_global_pass(options) and dist.is_available() and dist.is_initialized():
        return {"process_group": dist.group.WORLD}
    return {}


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


def make_verl_loss(name: str, *, cross_rank: bool = False) -> Callable:
    """Wrap our objective ``name`` with verl's policy-loss calling convention (options per call from ``config``)."""
    spec = get_loss_spec(name)
    fn = spec.fn

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
        opts = loss_options(spec, config)
        loss, metrics = fn(
            log_prob, old_log_prob, advantages, response_mask,
            agg=loss_agg_mode, weights=rollout_is_weights, **counts, **opts, **_runtime(spec, opts, cross_rank),
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


def register(prefix: str = "offpolicy_moe", names: Optional[tuple] = None, *, cross_rank: bool = False) -> list[str]:
    """Register our objectives (default: every loss in the registry) into verl under ``<prefix>/<name>``; returns
    the registered names.  Idempotent: a name already registered is left as it is."""
    core = _core_algos()
    names = tuple(list_policy_losses()) if names is None else tuple(names)
    registry = getattr(core, "POLICY_LOSS_REGISTRY", None)
    done = []
    for name in names:
        full = f"{prefix}/{name}"
        if registry is None or full not in registry:
            core.register_policy_loss(full)(make_verl_loss(name, cross_rank=cross_rank))
        done.append(full)
    return done


__all__ = ["register", "make_verl_loss", "config_value", "loss_options", "VERL_KEYS"]
