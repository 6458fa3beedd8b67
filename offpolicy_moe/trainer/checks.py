"""Every check a run makes before compute, in one place: ``train --dry-run`` and a real start call the same
:func:`check_config`, once, and the trainer takes what it built (the task) instead of building it again."""
from __future__ import annotations

from typing import Any

from offpolicy_moe.config.preflight import CheckedConfig, preflight_checked
from offpolicy_moe.sources.modes import check_mode, source_class
from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.models.moe_shape import declares_moe
from offpolicy_moe.rollout.engine import EngineNeeds, check_engine_config, check_engine_name
from offpolicy_moe.sources.buffer import check_buffer_feasible

__all__ = ["CheckedConfig", "check_config", "check_engine_settings"]


def check_engine_settings(cfg: Any, model_config: Any) -> None:
    """Every setting the run's engine refuses, before any engine, worker or actor starts, in every
    ``buffer.mode``: the engine's own checks with what the run asks of it (:class:`EngineNeeds`), then what the
    batch source asks of it (its ``check_engine``: a stream's slot sampler on the built-in engine).  One-line
    ``ValueError``."""
    check_engine_config(cfg.rollout, model_config, EngineNeeds.of_run(cfg, declares_moe(model_config)))
    source_class(cfg).check_engine(cfg, model_config)


def check_config(cfg: Any) -> CheckedConfig:
    """Validation and the file-reading preflight (:func:`~offpolicy_moe.config.preflight.preflight`), a bounded
    buffer that can train ``trainer.steps`` steps, and a registered rollout engine that can serve this model and
    run (:func:`check_engine_settings`, here in the trainer's process, before any rollout worker starts).  Raises
    :class:`~offpolicy_moe.config.validate.ConfigError` (one line per problem, naming the key); returns the
    warnings and the task it built."""
    checked = preflight_checked(cfg, more=(check_mode,))
    check_buffer_feasible(cfg)
    try:
        check_engine_name(cfg.rollout.engine)
        if checked.model_config is not None:
            check_engine_settings(cfg, checked.model_config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return checked
