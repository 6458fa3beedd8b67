"""The one table of precisions the package accepts (``model.dtype``, ``rollout.dtype``) and its resolver."""
from __future__ import annotations

from typing import Union

import torch

from .vocabulary import DTYPE_NAMES

__all__ = ["DTYPES", "DTYPE_NAMES", "resolve_dtype"]

# The canonical names (DTYPE_NAMES, what the config validator accepts), then the short spellings the resolver also
# reads.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                                  "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_dtype(name: Union[str, torch.dtype]) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or ``fp32``/``bf16``/``fp16``, or a ``torch.dtype``) → ``torch.dtype``.

    Raises ``ValueError`` naming the accepted spellings for anything else.
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name)]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}") from None
