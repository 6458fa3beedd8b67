"""Sampling: the rollout engines (their own copy of the policy, KV-cached decoding, route recording, behaviour
log-probs), the rollout batch they produce, and the worker processes of the asynchronous pipeline.

Nothing here imports the trainer: the trainer drives the engine through its registry and the batch record.
"""

from offpolicy_moe.rollout import vllm_engine  # noqa: E402,F401 - registers rollout.engine=vllm
