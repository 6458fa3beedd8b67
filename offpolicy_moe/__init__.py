"""offpolicy_moe: RL for Mixture-of-Experts language models on stale, off-policy data.

Layers, bottom up: a layer imports only from the layers below it, and the three of the first layer not from one
another (the import-linter contract "offpolicy_moe layers" in pyproject.toml; docs/architecture.md has each
subpackage's job and imports).

  1. ``losses``, ``routing``, ``tasks``  objective math; router hooks and route traces; tasks and rewards
  2. ``models``        tiny presets, offline loading, the MoE shape of a model
  3. ``integrations``  adapters into other trainers (verl, TRL)
  4. ``config``        the schema, loading and validation of a run's config
  5. ``run``           a run's folder, checkpoints, loggers and metric names
  6. ``rollout``       the rollout pipeline: engines, continuous batching, the worker processes and their messages
  7. ``logprobs``      log-probs of generated batches under the policy
  8. ``sources``       where each step's batch comes from: the trainer's process, workers or a stream
  9. ``trainer``       the training loop and its update
  10. ``report``       run folders read into tables and plots
  11. ``sweep``        experiment grids, planned and run
  12. ``commands``     one module per CLI subcommand
  13. ``cli``          the ``offpolicy-moe`` entry point

``lazy`` (names imported from their modules on first use) imports nothing of the package; any layer may use it.
"""

__version__ = "0.1.0"
