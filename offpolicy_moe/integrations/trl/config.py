"""``OffPolicyGRPOConfig``: TRL's ``GRPOConfig`` plus this library's loss, correction and routing-replay keys
(docs/trl.md).  Every key is checked when the config is built, so a bad loss name or option, or a TRL setting the
plug-in would silently override, fails in one line before any model is touched.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import trl
from packaging.version import Version
from trl import GRPOConfig

from offpolicy_moe.losses import AGG_MODES, correction_weights, get_loss_spec, resolve_loss_options
from offpolicy_moe.losses.correction import LEVELS, MODES

__all__ = ["OffPolicyGRPOConfig", "SUPPORTED_TRL", "check_trl_version", "REPLAY_MODES", "REPLACED_TRL_KEYS"]

SUPPORTED_TRL = (Version("1.16.0"), Version("2.0.0"))
"""The TRL versions the plug-in accepts: ``1.16.0 <= trl < 2.0.0`` (tested on 1.16.0)."""

REPLAY_MODES = ("none", "r3")

REPLACED_TRL_KEYS = ("loss_type", "epsilon", "epsilon_high", "delta", "importance_sampling_level",
                     "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "off_policy_mask_threshold",
                     "use_bias_correction_kl")
"""TRL's own loss keys: the plug-in's loss replaces TRL's, so a non-default value of one of these is refused
(it would be silently ignored); the equivalent lives in ``policy_loss`` / ``policy_loss_options``."""


_INSTEAD = {"off_policy_mask_threshold": "correction_opsm_delta (or correction_mode='opsm')",
            "importance_sampling_level": "policy_loss='gspo' for sequence-level ratios"}


def check_trl_version(version: str) -> None:
    """Raise ImportError when ``version`` of TRL is outside :data:`SUPPORTED_TRL`."""
    low, high = SUPPORTED_TRL
    if not low <= Version(version) < high:
        raise ImportError(f"offpolicy_moe.integrations.trl supports trl >= {low}, < {high}; trl {version} is "
                          f"installed (pip install 'trl>={low},<{high}')")


check_trl_version(trl.__version__)


def _trl_default(name: str) -> Any:
    for f in dataclasses.fields(GRPOConfig):
        if f.name == name:
            return f.default if f.default is not dataclasses.MISSING else f.default_factory()
    raise KeyError(name)


@dataclass
class OffPolicyGRPOConfig(GRPOConfig):
    """``GRPOConfig`` with this library's policy loss, correction weights and routing replay; the keys mirror the
    project's own config (docs/config.md), each described in docs/trl.md.

    * ``policy_loss`` / ``policy_loss_options`` / ``loss_agg`` / ``loss_norm_length`` are
      ``algo.loss.{name, options, agg, norm_length}``; ``count_masked_rows``: the sequence count of the ``seq-mean-*``
      modes counts all-masked rows too, as TRL divides (the default), else rows with a valid token only (this
      library's and verl's convention);
    * ``correction_*`` are ``algo.correction.*`` (:func:`offpolicy_moe.losses.correction_weights`);
    * ``routing_replay``: ``r3`` replays the routes recorded in TRL's ``model.generate`` in the old-log-prob, reference
      and loss forwards (arXiv 2510.11370); ``router_perturb``: sigma of a fixed, seeded router-weight perturbation in
      generation only; ``mismatch_metrics``: log ``mismatch/*``, with and without replay on an MoE model.
    """

    policy_loss: str = field(default="grpo", metadata={"help": "offpolicy_moe policy loss name (registry)."})
    policy_loss_options: Optional[dict] = field(default=None, metadata={"help": "Options of the policy loss."})
    loss_agg: Optional[str] = field(default=None, metadata={"help": f"Aggregation: one of {', '.join(AGG_MODES)}."})
    loss_norm_length: Optional[int] = field(default=None, metadata={"help": "seq-mean-token-sum-norm constant."})
    count_masked_rows: bool = field(default=True, metadata={
        "help": "seq-mean-* modes count every row, all-masked ones too (TRL's numbers); False: rows with a token."})
    correction_mode: str = field(default="none", metadata={"help": "none | truncate (TIS) | mask (MIS/IcePop)."})
    correction_level: str = field(default="token", metadata={"help": "token | sequence | geometric."})
    correction_high: float = field(default=2.0, metadata={"help": "Upper bound of the correction weight."})
    correction_low: Optional[float] = field(default=None, metadata={"help": "Lower bound (None: none)."})
    correction_opsm_delta: Optional[float] = field(
        default=None, metadata={"help": "OPSM threshold on top of truncate / mask (None: off); mode 'opsm' alone."})
    routing_replay: str = field(default="none", metadata={"help": "none | r3 (rollout routing replay)."})
    router_perturb: float = field(default=0.0, metadata={"help": "Generation-only router perturbation sigma."})
    mismatch_metrics: bool = field(default=True, metadata={"help": "Log mismatch/* metrics."})

    def __post_init__(self):
        super().__post_init__()
        self.policy_loss_options = resolve_loss_options(self.policy_loss, self.policy_loss_options)
        self.check_plugin_keys()

    def check_plugin_keys(self) -> None:
        """One-line ValueError naming the first bad plug-in key or the first TRL key the plug-in would ignore."""
        get_loss_spec(self.policy_loss)
        if self.loss_agg is not None and self.loss_agg not in AGG_MODES:
            raise ValueError(f"loss_agg must be one of {', '.join(AGG_MODES)} or None, got {self.loss_agg!r}")
        if self.loss_norm_length is not None and not (isinstance(self.loss_norm_length, int)
                                                      and self.loss_norm_length > 0):
            raise ValueError(f"loss_norm_length must be a positive int or None, got {self.loss_norm_length!r}")
        if self.correction_mode not in ("none", *MODES):
            raise ValueError(f"correction_mode must be one of none, {', '.join(MODES)}, got {self.correction_mode!r}")
        if self.correction_level not in LEVELS:
            raise ValueError(f"correction_level must be one of {', '.join(LEVELS)}, got {self.correction_level!r}")
        if not (self.correction_high > 0 and math.isfinite(self.correction_high)):
            raise ValueError(f"correction_high must be finite and > 0, got {self.correction_high!r}")
        if self.correction_low is not None and not 0 <= self.correction_low <= self.correction_high:
            raise ValueError(f"correction_low must be in [0, correction_high={self.correction_high}], got "
                             f"{self.correction_low!r}")
        if self.correction_mode != "none":     # the library's own checks of the combination, on a 1-token batch
            one = torch.zeros(1, 1)
            try:
                correction_weights(one, one, torch.ones(1, 1), level=self.correction_level, mode=self.correction_mode,
                                   high=self.correction_high, low=self.correction_low, advantages=torch.zeros(1),
                                   opsm_delta=self.correction_opsm_delta)
            except (ValueError, TypeError) as err:
                raise ValueError(f"correction: {err}") from None
        elif self.correction_opsm_delta is not None:
            raise ValueError("correction_opsm_delta needs a correction_mode (truncate, mask or opsm)")
        if self.routing_replay not in REPLAY_MODES:
            raise ValueError(f"routing_replay must be one of {', '.join(REPLAY_MODES)}, got {self.routing_replay!r}")
        if not (self.router_perturb >= 0 and math.isfinite(self.router_perturb)):
            raise ValueError(f"router_perturb must be finite and >= 0, got {self.router_perturb!r}")
        for key in REPLACED_TRL_KEYS:
            if getattr(self, key) != _trl_default(key):
                instead = _INSTEAD.get(key, "policy_loss / policy_loss_options")
                raise ValueError(f"{key}={getattr(self, key)!r} is TRL's own loss setting, which the plug-in replaces "
                                 f"(policy_loss={self.policy_loss!r}): leave {key} at its default and set {instead}")
        engine = ("use_vllm" if self.use_vllm else
                  "use_transformers_continuous_batching" if self.use_transformers_continuous_batching else None)
        if engine is not None:
            if self.routing_replay == "r3":
                raise ValueError(f"routing_replay='r3' records routes in TRL's model.generate; {engine}=True "
                                 "generates elsewhere: set use_vllm=False and use_transformers_continuous_batching="
                                 "False")
            if self.router_perturb > 0:
                raise ValueError(f"router_perturb perturbs model.generate's router; {engine}=True generates "
                                 "elsewhere")
        if self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError("vllm_importance_sampling_correction=True is TRL's own correction, which the plug-in "
                             "replaces: set it to False and use correction_mode / correction_level / correction_high")
        if self.use_transformers_continuous_batching and self.correction_mode != "none":
            raise ValueError("correction_mode needs generation-time log-probs, which "
                             "use_transformers_continuous_batching does not return")
        spg, ga = self.steps_per_generation, self.gradient_accumulation_steps
        if spg is not None and spg % ga:
            raise ValueError(f"steps_per_generation={spg} must be a multiple of gradient_accumulation_steps={ga}: "
                             "the global counts and M2PO's selection span one optimizer step's micro-batches, which "
                             "must come from one generation")
