"""The names of the losses' modes that a config may choose, without torch (the config schema and its validator
import this module, not the kernels)."""
from __future__ import annotations

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "k3+")
CORRECTION_MODES = ("truncate", "mask", "opsm")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
M2PO_VARIANTS = ("mask", "adaptive_clip")
M2PO_SCOPES = ("global", "local")

__all__ = ["AGG_MODES", "CORRECTION_LEVELS", "CORRECTION_MODES", "KL_KINDS", "M2PO_SCOPES", "M2PO_VARIANTS"]
