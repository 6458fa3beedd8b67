"""A preparation that keeps batches as they are: the sources' seam to the trainer's stage, for source tests that
run without a model (the real stage is tested in tests/sources/test_async_versions.py and by every trainer test)."""
from __future__ import annotations

from offpolicy_moe.logprobs.stage import PreparedBatch


class KeepAsIs:
    """Returns each batch unchanged; keeps the published weights by version."""

    def __init__(self):
        self.kept = {}

    def prepare(self, batch, *, current):
        return PreparedBatch(batch)

    def agree(self, prepared):
        return prepared

    def keep(self, version, weights):
        self.kept[version] = weights

    def weights(self, version):
        return self.kept[version]
