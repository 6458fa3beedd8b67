"""Training: one loop (:mod:`.trainer`) over a batch source (:mod:`offpolicy_moe.sources`), the update and its parts
(routed forward, log-probs, packing, the old-logp pass, micro-batching, the optimiser, the step guard), the SFT warm
start, callbacks and :func:`~offpolicy_moe.trainer.launch.train`, the entry point that starts a run.
"""
