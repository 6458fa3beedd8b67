"""Every enumerated key refuses an unknown value, naming the key and the valid values."""
import pytest

from offpolicy_moe.config import ConfigError, load_config
from offpolicy_moe.sources.modes import validate_run as validate
from offpolicy_moe.config.validate import vocabularies

ENUMS = vocabularies()


@pytest.mark.parametrize("key", sorted(ENUMS))
def test_unknown_enum_value_is_refused_with_the_key(key):
    cfg = load_config(None, [f"{key}=not_a_choice"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    msg = str(err.value)
    assert key in msg and ENUMS[key][0] in msg


@pytest.mark.parametrize("key", sorted(ENUMS))
def test_every_listed_value_passes_the_enum_rule(key):
    for value in ENUMS[key]:
        cfg = load_config(None, [f"{key}={value}"])
        try:
            validate(cfg)
        except ConfigError as exc:  # another cross-field rule may fire; the enum rule must not
            assert f"{key}: unknown value" not in str(exc)
