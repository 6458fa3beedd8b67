"""Models: tiny presets built from config, offline loading of local checkpoints, compatibility checks."""
from .loading import (CheckpointNotFoundError, MoEInfo, build_model, check_compatibility, is_moe, load_checkpoint,
                      load_policy, load_tokenizer, moe_info)
from .presets import PRESETS, build_preset, resolve_dtype, tiny_dense_config, tiny_qwen3_moe_config

__all__ = ["CheckpointNotFoundError", "MoEInfo", "PRESETS", "build_model", "build_preset", "check_compatibility",
           "is_moe", "load_checkpoint", "load_policy", "load_tokenizer", "moe_info", "resolve_dtype",
           "tiny_dense_config", "tiny_qwen3_moe_config"]
