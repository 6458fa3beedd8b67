"""Models: tiny presets built from config, offline loading of local checkpoints, compatibility checks, the one
dtype table (:mod:`.dtypes`) and the one reader of an MoE config's shape (:func:`moe_shape`)."""
from .dtypes import DTYPE_NAMES, DTYPES, resolve_dtype
from .loading import (TOKENIZER_FILES, CheckpointNotFoundError, MoEInfo, build_model, check_compatibility, is_moe,
                      load_checkpoint, load_model_config, load_policy, load_tokenizer, moe_info,
                      require_tokenizer_files, tokenizer_source)
from .moe_shape import EXPERT_COUNT_KEYS, TOP_K_KEYS, declares_moe, moe_shape
from .presets import PRESETS, build_preset, tiny_dense_config, tiny_qwen3_moe_config

__all__ = ["CheckpointNotFoundError", "DTYPES", "DTYPE_NAMES", "EXPERT_COUNT_KEYS", "MoEInfo", "PRESETS",
           "TOKENIZER_FILES", "TOP_K_KEYS", "build_model", "build_preset", "check_compatibility", "declares_moe",
           "is_moe", "load_checkpoint", "load_model_config", "load_policy", "load_tokenizer", "moe_info", "moe_shape",
           "require_tokenizer_files", "resolve_dtype", "tiny_dense_config", "tiny_qwen3_moe_config",
           "tokenizer_source"]
