"""Issue 31: a seed that cannot run is refused by validate before any compute (numpy refuses seeds outside [0, 2^32))."""
import numpy as np
import pytest

from offpolicy_moe.config.schema import TrainConfig
from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.sources.modes import validate_run as validate


@pytest.mark.parametrize("key", ["seed", "task.seed"])
@pytest.mark.parametrize("value", [-1, 2**32])
def test_out_of_range_seed_is_refused_naming_the_key(key, value):
    cfg = TrainConfig()
    obj = cfg.task if key == "task.seed" else cfg
    obj.seed = value
    with pytest.raises(ValueError):
        np.random.default_rng(value) if value < 0 else np.random.seed(value)   # the value really cannot run
    with pytest.raises(ConfigError, match=rf"{key}: must be in \[0, 4294967296\), got {value}"):
        validate(cfg)


@pytest.mark.parametrize("value", [0, 2**32 - 1])
def test_seed_bounds_are_accepted(value):
    cfg = TrainConfig()
    cfg.seed = value
    cfg.task.seed = value
    validate(cfg)   # raises ConfigError on any problem
