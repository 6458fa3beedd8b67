"""TRL plug-in: TRL's ``GRPOTrainer`` with this library's losses, TIS / MIS / IcePop weights and R3 replay.

``from offpolicy_moe.integrations.trl import OffPolicyGRPOConfig, OffPolicyGRPOTrainer`` (needs the ``trl`` extra:
``pip install -e ".[trl]"``; supported TRL versions: :data:`SUPPORTED_TRL`).  The manual page is docs/trl.md.
"""
from .config import REPLACED_TRL_KEYS, SUPPORTED_TRL, OffPolicyGRPOConfig, check_trl_version
from .generation import GenerationRecord, behaviour_logprobs, capture_generate
from .trainer import OffPolicyGRPOTrainer

__all__ = ["OffPolicyGRPOConfig", "OffPolicyGRPOTrainer", "SUPPORTED_TRL", "REPLACED_TRL_KEYS", "check_trl_version",
           "GenerationRecord", "behaviour_logprobs", "capture_generate"]
