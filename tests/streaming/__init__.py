"""Tests of offpolicy_moe.rollout."""
