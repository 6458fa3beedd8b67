"""Adapters that plug offpolicy_moe's losses into other RL frameworks (optional dependencies)."""
