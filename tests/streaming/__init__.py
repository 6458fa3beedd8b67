"""Tests of offpolicy_moe.streaming."""
