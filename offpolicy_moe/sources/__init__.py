"""Batch sources: where the training loop gets each step's batch, and how fresh it is.

* :mod:`.base` — ``BatchSource``, the seam the trainer's one loop reads (``next``, ``publish``, state);
* :mod:`.sync` — ``SyncBatchSource``: generation in the trainer's process, through the exact delay line of
  :mod:`.buffer` (staleness ``k`` steps, or a bounded buffer);
* :mod:`.asynchronous` — ``AsyncBatchSource``: rollout workers generating ahead, scheduled by :mod:`.schedule`,
  old log-probs taken per token version (:mod:`.versions`); the workers are reached through a transport
  (:mod:`.transport`): processes on this machine (:mod:`.process_transport`) or Ray actors (:mod:`.ray_transport`).

A source imports the rollout layer and never the trainer: the trainer hands it the engine (or what builds one in
a worker) and a ``prepare`` callable that fills in the trainer-side fields of each batch.
"""
