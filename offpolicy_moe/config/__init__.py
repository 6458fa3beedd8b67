"""Run configuration: typed schema with per-key ranges (``schema``, ``ranges``), loading with presets and overrides
(``load``), validation (``validate``) and the file-reading checks of a start (``preflight``).

Loading and validating import no torch; :mod:`.preflight`, which builds the task and loads the tokenizer, does and
is imported where it is used (``from offpolicy_moe.config.preflight import preflight``)."""
from offpolicy_moe.config.load import (
    PRESETS_ENV,
    available_presets,
    config_get,
    expand_presets,
    load_config,
    load_config_dict,
    preset_description,
    preset_dirs,
    preset_path,
    save_resolved,
    to_dict,
    to_yaml,
)
from offpolicy_moe.config.schema import TrainConfig
from offpolicy_moe.config.validate import ConfigError, infer_model_is_moe, validate

__all__ = [
    "ConfigError",
    "PRESETS_ENV",
    "TrainConfig",
    "available_presets",
    "config_get",
    "expand_presets",
    "infer_model_is_moe",
    "load_config",
    "load_config_dict",
    "preset_description",
    "preset_dirs",
    "preset_path",
    "save_resolved",
    "to_dict",
    "to_yaml",
    "validate",
]
