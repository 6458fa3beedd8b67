"""Metrics the loop adds to a trained step's: how stale its batch was and the update's throughput
(``offpolicy/*``, ``perf/update_*``), and the mean over processes of what is logged."""
from __future__ import annotations

from typing import Any

import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.sources.base import BatchSource
from offpolicy_moe.sources.schedule import lag

__all__ = ["STEP_PARTS", "offpolicy_metrics", "mean_over_processes", "token_lag", "row_versions_max", "lag_histogram",
           "step_remainder"]


def token_lag(step: int, batch: RolloutBatch) -> tuple[float, float]:
    """Mean and max over the batch's response tokens of their lag at ``step`` (:func:`~offpolicy_moe.sources.schedule.lag`)."""
    mask = batch.response_mask.bool()
    if batch.token_versions is None or not bool(mask.any()):
        whole = float(lag(step, batch.version))
        return whole, whole
    lags = lag(step, batch.token_versions[mask]).double()
    return float(lags.mean()), float(lags.max())


def row_versions_max(batch: RolloutBatch) -> int:
    """The most distinct versions among one row's response tokens (1 without per-token versions)."""
    if batch.token_versions is None:
        return 1
    mask = batch.response_mask.bool()
    return max((int(v[m].unique().numel()) for v, m in zip(batch.token_versions, mask) if bool(m.any())), default=1)


def lag_histogram(step: int, batch: RolloutBatch, bound: int) -> dict[str, float]:
    """``offpolicy/lag_tokens_<j>`` for ``j = 0 .. bound``: the batch's response tokens with lag ``j`` at ``step``
    (the same keys every step and on every process; a lag above ``bound`` shows in ``offpolicy/staleness_max``)."""
    mask = batch.response_mask.bool()
    versions = (batch.token_versions[mask] if batch.token_versions is not None
                else torch.full((int(mask.sum()),), int(batch.version)))
    counts = torch.bincount(lag(step, versions).clamp(0, bound + 1).long(), minlength=bound + 2)
    return {f"offpolicy/lag_tokens_{j}": float(counts[j]) for j in range(bound + 1)}


def offpolicy_metrics(step: int, batch: RolloutBatch, source: BatchSource, updates_per_step: int, tokens: float,
                      t_update: float, lag_bound: int = 0) -> dict[str, float]:
    """How stale the batch trained at policy version ``step`` was (over its response tokens' versions, in steps
    and in optimizer updates, and their histogram up to ``lag_bound``), what the source dropped and holds, and the
    update's throughput (``tokens`` in ``t_update`` seconds), with the batch's own extras."""
    mean_lag, max_lag = token_lag(step, batch)
    return {**batch.extras,
            **lag_histogram(step, batch, lag_bound), "offpolicy/versions_per_row_max": float(row_versions_max(batch)),
            "offpolicy/staleness_steps": mean_lag, "offpolicy/staleness_max": max_lag,
            "offpolicy/staleness_updates": mean_lag * updates_per_step,
            "offpolicy/batch_version": float(batch.version),
            "offpolicy/generated_at": float(batch.generated_at),
            "offpolicy/dropped": float(source.dropped),
            "offpolicy/buffer_size": float(len(source)),
            "perf/update_tokens_per_s": tokens / max(t_update, 1e-9), "perf/time_update_s": t_update}


def mean_over_processes(metrics: dict[str, float], accelerator: Any) -> dict[str, float]:
    """Each metric's mean over the processes (one float64 all-reduce, keys in sorted order); ``metrics`` itself
    with one process or none to reduce."""
    if accelerator.num_processes > 1 and metrics:
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=accelerator.device)
        metrics = dict(zip(keys, accelerator.reduce(t, "mean").tolist()))
    return metrics


#: the parts of a step's wall time the loop measures, in order (their sum and ``perf/time_other_s`` make
#: ``perf/time_step_s``)
STEP_PARTS = ("perf/time_batch_s", "perf/time_update_s", "perf/time_eval_s", "perf/time_publish_s")


def step_remainder(m: dict[str, float]) -> float:
    """``perf/time_other_s``: the step's wall seconds that none of :data:`STEP_PARTS` holds (the loop's bookkeeping:
    step metrics, callbacks), ``time_step - sum(parts)``; a part the step did not have (no evaluation) counts 0.
    The source's own parts (waiting, generating, the old-log-prob pass) are inside ``perf/time_batch_s``."""
    return m["perf/time_step_s"] - sum(float(m.get(k, 0.0)) for k in STEP_PARTS)
