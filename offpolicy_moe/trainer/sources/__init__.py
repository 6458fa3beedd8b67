"""Batch sources: where the training loop gets each step's batch (see :mod:`.base`)."""
