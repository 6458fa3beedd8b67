"""The run: its folder and lock, checkpoints (storage, contents, full states of sharded models), signals, loggers,
metric names, export, and the run-level errors.  Nothing here imports the trainer or the rollout engines.
"""
