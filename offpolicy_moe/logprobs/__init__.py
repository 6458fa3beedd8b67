"""Log-probs of generated batches under the trainer's policy: the routed forward and its micro-batch pieces, and
the old log-probs, which no other package writes (the passes, the strategies, past versions' weights, and the
preparation stage that the batch sources hand their batches to)."""
from offpolicy_moe.logprobs.passes import FusedOldLogp, OldLogpPass, conditioning_positions
from offpolicy_moe.logprobs.stage import PreparationStage, PreparedBatch, engine_logp_exact
from offpolicy_moe.logprobs.strategies import (AtConsumption, BatchOldLogp, FromEngine, Fused, Loglinear,
                                                       OldLogpStrategy, Recomputed, loglinear_proximal)

__all__ = ["OldLogpPass", "FusedOldLogp", "conditioning_positions", "PreparationStage", "PreparedBatch",
           "engine_logp_exact", "OldLogpStrategy",
           "BatchOldLogp", "Recomputed", "Fused", "FromEngine", "AtConsumption", "Loglinear", "loglinear_proximal"]
