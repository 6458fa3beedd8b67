"""Models: tiny presets built from config, offline loading of local checkpoints, compatibility checks, the one
dtype table (:mod:`.dtypes`) and the one reader of an MoE config's shape (:func:`moe_shape`).

The torch-free modules (:mod:`.vocabulary`, :mod:`.moe_shape`) are imported with the package; the other names are
imported from their modules on first use.
"""
from offpolicy_moe.lazy import lazy_exports

from .moe_shape import EXPERT_COUNT_KEYS, TOP_K_KEYS, declares_moe, moe_shape
from .vocabulary import DTYPE_NAMES, PRESET_NAMES

_EXPORTS = {
    "dtypes": ("DTYPES", "resolve_dtype"),
    "experts": ("experts_implementations",),
    "loading": ("TOKENIZER_FILES", "CheckpointNotFoundError", "MoEInfo", "build_model", "check_compatibility", "is_moe",
                "load_checkpoint", "load_model_config", "load_policy", "load_tokenizer", "moe_info",
                "require_tokenizer_files", "tokenizer_source"),
    "presets": ("PRESETS", "build_preset", "tiny_dense_config", "tiny_qwen3_moe_config"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(["DTYPE_NAMES", "EXPERT_COUNT_KEYS", "PRESET_NAMES", "TOP_K_KEYS", "declares_moe", "moe_shape",
                  *(name for names in _EXPORTS.values() for name in names)])
