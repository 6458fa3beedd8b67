"""The training engine: the rollout engine (``rollout``), the trainer and its named parts (``trainer``, ``forward``,
``old_logp``, ``update``, ``run_dir``, ``checkpoint_state``, ``launch``), the staleness buffer, checkpoints and
export.  Import the submodules directly (``from offpolicy_moe.engine.launch import train``); importing this package
loads nothing else.  The layering is in ``docs/architecture.md`` and checked by ``tests/test_layers.py``."""
