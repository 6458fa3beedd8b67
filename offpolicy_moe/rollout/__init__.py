"""Sampling: the rollout engines (their own copy of the policy, KV-cached decoding, route recording, behaviour
log-probs), the rollout batch they produce, and the worker processes of the asynchronous pipeline.

* :mod:`.engine` — ``RolloutEngine``, the Hugging Face engine, the engine registry (``register_engine``);
* :mod:`.batch` — ``RolloutBatch``, the record a generation step produces;
* :mod:`.kv_cache`, :mod:`.decode_attention` — the native sampler's cache and single-query attention;
* :mod:`.worker`, :mod:`.weights` — a rollout worker process and the policy weights it reads by version.

Nothing here imports the trainer: the trainer drives the engine through its registry and the batch record.
"""
