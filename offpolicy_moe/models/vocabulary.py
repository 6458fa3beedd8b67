"""The models' names that a config may choose, without torch (the config schema and its validator import this
module, not the model code)."""
from __future__ import annotations

#: ``model.dtype`` / ``rollout.dtype``: the canonical precision names (:mod:`.dtypes` also reads short spellings)
DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
#: ``model.preset``: the tiny presets built from config (:mod:`.presets`)
PRESET_NAMES: tuple[str, ...] = ("tiny-qwen3-moe", "tiny-dense")
#: ``model.experts_implementation`` values known without asking transformers; its own kernel names
#: (``grouped_mm``, ``batched_mm``, ...) are listed by :func:`~offpolicy_moe.models.experts.experts_implementations`
EXPERTS_OWN: tuple[str, ...] = ("auto", "eager")

__all__ = ["DTYPE_NAMES", "EXPERTS_OWN", "PRESET_NAMES"]
