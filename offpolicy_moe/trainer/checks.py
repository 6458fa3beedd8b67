"""Every check a run makes before compute, in one place: ``train --dry-run`` and a real start call the same
:func:`check_config`, once, and the trainer takes what it built (the task) instead of building it again."""
from __future__ import annotations

from typing import Any

from offpolicy_moe.config.preflight import CheckedConfig, preflight_checked
from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.rollout.engine import check_engine_config, check_engine_name
from offpolicy_moe.sources.buffer import check_buffer_feasible

__all__ = ["CheckedConfig", "check_config"]


def check_config(cfg: Any) -> CheckedConfig:
    """Validation and the file-reading preflight (:func:`~offpolicy_moe.config.preflight.preflight`), a bounded
    buffer that can train ``trainer.steps`` steps, and a registered rollout engine that can serve this model (its
    own checks, here in the trainer's process, before any rollout worker starts).  Raises
    :class:`~offpolicy_moe.config.validate.ConfigError` (one line per problem, naming the key); returns the
    warnings and the task it built."""
    checked = preflight_checked(cfg)
    check_buffer_feasible(cfg)
    try:
        check_engine_name(cfg.rollout.engine)
        if checked.model_config is not None:
            check_engine_config(cfg.rollout, checked.model_config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return checked
