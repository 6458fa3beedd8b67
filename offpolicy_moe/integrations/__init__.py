"""Adapters that plug offpolicy_moe's losses and routing replay into other RL frameworks (optional dependencies):
``verl`` (loss registry adapter) and ``trl`` (``OffPolicyGRPOTrainer``, TRL's GRPOTrainer with our losses and R3)."""
