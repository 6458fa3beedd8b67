"""Engine tests: trainer, rollout engine, buffer, packing; shared helpers in :mod:`tests.engine.tiny`."""
