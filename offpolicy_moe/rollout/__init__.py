"""Sampling and the rollout pipeline, in one room: the rollout engines (their own copy of the policy, KV-cached
decoding, route recording, behaviour log-probs) and the rollout batch they produce; continuous batching for streamed
rollouts (``slots``, ``vllm_stream``, ``group_batch``); the worker processes (``worker``, ``stream_worker``,
``ray_actor``), the messages they exchange with the trainer and how they travel (``messages``), and the weights they
read by version (``weights``).

Nothing here imports the trainer: the trainer drives the engine through its registry and the batch record.
"""

from offpolicy_moe.rollout import vllm_engine  # noqa: E402,F401 - registers rollout.engine=vllm
