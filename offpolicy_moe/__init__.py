"""offpolicy_moe: RL for Mixture-of-Experts language models on stale, off-policy data.

Floors (each imports only from the floors below):
  1. ``offpolicy_moe.losses``   pure tensor math (advantages, aggregation, objectives, corrections)
  2. ``offpolicy_moe.routing``, ``offpolicy_moe.tasks``, ``offpolicy_moe.models``
  3. ``offpolicy_moe.engine``   rollout engine, staleness buffer, Accelerate trainer
  4. ``offpolicy_moe.config``, ``offpolicy_moe.report``, ``offpolicy_moe.cli``
"""

__version__ = "0.1.0"
