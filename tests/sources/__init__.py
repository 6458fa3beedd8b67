"""Tests of offpolicy_moe.sources."""
