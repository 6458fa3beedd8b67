"""Asynchronous training (``buffer.mode=async``): rollout worker processes generate while the trainer trains,
with policy versions on every token and bounded lag (docs/async.md).

* :mod:`.schedule` — the bound on the lag, as pure functions;
* :mod:`.weights` — policy weights by version in shared memory;
* :mod:`.worker` — the rollout worker process;
* :mod:`.source` — the trainer's side: orders, batches, deaths, checkpointed in-flight state;
* :mod:`.loop` — the asynchronous training loop over the trainer's parts.
"""
