"""Streamed rollouts (``buffer.mode=stream``): continuous batching on the built-in engine (``slots.py``) and on vLLM
(``vllm_stream.py``), the streaming worker process that drives either (``stream_worker.py``), and the group batches
it sends back (``group_batch.py``).

It sits above the rollout engines, which it drives, and below the batch sources, which issue its groups.
"""
