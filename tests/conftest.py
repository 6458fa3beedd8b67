"""Shared test settings: small thread counts (CI has 2 cores), wandb never goes online."""
import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
