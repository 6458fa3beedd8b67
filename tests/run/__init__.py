"""Tests of offpolicy_moe.run."""
