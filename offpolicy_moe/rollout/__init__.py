"""Sampling: the rollout engines (their own copy of the policy, KV-cached decoding, route recording, behaviour
log-probs), the rollout batch they produce, and the worker processes of the asynchronous pipeline.

* :mod:`.engine` — ``RolloutEngine``, the Hugging Face engine, the engine registry (``register_engine``);
* :mod:`.vllm_engine`, :mod:`.vllm_worker` — ``rollout.engine=vllm`` (vLLM imported only when that engine starts)
  and what it runs inside vLLM's worker (route recorder, weight loader); :mod:`.vllm_start` — what a vLLM start asks
  for (routes, memory, length), :mod:`.expert_choice` — a vLLM MoE layer's own expert choice, :mod:`.devices` — one
  GPU per engine;
* :mod:`.batch` — ``RolloutBatch``, the record a generation step produces;
* :mod:`.kv_cache`, :mod:`.decode_attention` — the native sampler's cache and single-query attention;
* :mod:`.worker`, :mod:`.weights` — a rollout worker process and the policy weights it reads by version.

Nothing here imports the trainer: the trainer drives the engine through its registry and the batch record.
"""

from offpolicy_moe.rollout import vllm_engine  # noqa: E402,F401 - registers rollout.engine=vllm
