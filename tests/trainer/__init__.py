"""Tests of offpolicy_moe.trainer: the loop, the update, its passes, and end-to-end runs (tiny job in :mod:`tests.tiny`)."""
