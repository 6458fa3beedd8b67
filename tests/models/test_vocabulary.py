"""The models' torch-free vocabulary agrees with the code it names."""
from __future__ import annotations

from offpolicy_moe.models import PRESETS, experts_implementations
from offpolicy_moe.models.vocabulary import EXPERTS_OWN, PRESET_NAMES


def test_preset_names_are_the_built_presets():
    assert tuple(PRESETS) == PRESET_NAMES


def test_the_experts_values_known_without_transformers_are_accepted_values():
    assert experts_implementations()[:len(EXPERTS_OWN)] == EXPERTS_OWN
