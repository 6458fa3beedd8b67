"""The preparation stage: a generated batch in, a :class:`PreparedBatch` out.

Built once in :func:`~offpolicy_moe.trainer.build.build_run` and handed to the batch source (a layer above this
one: the source calls down into the stage, never back into the trainer), the stage is the
run's old-log-prob strategy, its passes and the ring of past versions' weights.  For each version that sampled the
batch's tokens it runs the strategy's passes under that version's weights (the live model when it holds that
version, else a scratch copy loaded from the ring), so ``old_logp[b, t] = log pi_{v(b,t)}(x_t)``; the oldest
version's pass runs on every row and gives the whole measurement (routing metrics, R2 routes), a newer version's
only on the rows that hold its tokens.  A NaN or Inf becomes the returned
batch's ``error``; nothing is raised to the source and nothing is called back.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.run import probes
from offpolicy_moe.run.nonfinite import NonFiniteError, all_finite, nonfinite_as
from offpolicy_moe.logprobs.finite_agreement import agree_on_stage
from offpolicy_moe.logprobs.forward import RoutedForward
from offpolicy_moe.logprobs.strategies import AfterGeneration, OldLogpStrategy
from offpolicy_moe.logprobs.versions import PastWeights, VersionRing, versions_of

__all__ = ["PreparationStage", "PreparedBatch", "engine_logp_exact", "one_version_rows"]


def engine_logp_exact(cfg: Any, *, is_moe: bool, measure_routing: bool) -> bool:
    """Whether the rollout engine's behaviour log-probs are what the trainer's old-log-prob pass would compute, up
    to float rounding, for a row sampled under one version, so that the pass can be skipped for it: the built-in
    engine (``rollout.engine=hf``) and the trainer both in float32; the engine's router unperturbed
    (``rollout.router_noise = router_perturb = 0``) and, on an MoE model, its routes replayed by the pass
    (``algo.routing.replay=r3``); the full distribution (``rollout.top_k=0``, ``top_p=1``: the behaviour
    log-probs are not of a truncated one); and nothing measured in the pass (``trainer.mismatch_metrics`` and
    routing metrics off).  Whether the run's strategy takes its old log-probs in a pass at all (the trainer's own,
    ``algo.old_logp_source=trainer``) is the stage's question per batch (:meth:`PreparationStage.takes_engine_logp`).  Then ``log mu(x_t) = log pi_v(x_t | x_<t)`` for a row whose tokens all came from version ``v``.
    A row that spans versions (weights taken in flight) is not covered: its later tokens were sampled over a
    KV cache the earlier version wrote, so ``mu`` is not ``pi_v`` there, and that row keeps its pass."""
    ro, rt = cfg.rollout, cfg.algo.routing
    return (ro.engine == "hf" and ro.dtype == "float32" and cfg.model.dtype == "float32"
            and float(ro.router_noise) == 0.0 and float(ro.router_perturb) == 0.0
            and int(ro.top_k) == 0 and float(ro.top_p) >= 1.0
            and (not is_moe or rt.replay == "r3") and not measure_routing and not bool(cfg.trainer.mismatch_metrics))


def one_version_rows(batch: RolloutBatch) -> torch.Tensor:
    """A bool per row: every response token of the row was sampled by one policy version (all rows when the batch
    carries no per-token versions)."""
    if batch.token_versions is None:
        return torch.ones(batch.response_mask.shape[0], dtype=torch.bool)
    mask = batch.response_mask.bool()
    tv = batch.token_versions
    big = torch.iinfo(tv.dtype).max if not tv.is_floating_point() else float("inf")
    lo = torch.where(mask, tv, torch.full_like(tv, big)).amin(1)
    hi = torch.where(mask, tv, torch.full_like(tv, -big)).amax(1)
    return (lo == hi) | ~mask.any(1)


@dataclass(frozen=True)
class PreparedBatch:
    """One generated batch after preparation: the batch with its old log-probs, R2 routes and measurements, or
    ``error``, the :class:`~offpolicy_moe.run.nonfinite.NonFiniteError` that spoiled it (then ``batch`` is None)."""

    batch: Optional[RolloutBatch]
    error: Optional[NonFiniteError] = None

    def __post_init__(self) -> None:
        if (self.batch is None) == (self.error is None):
            raise ValueError("a PreparedBatch holds either a batch or an error")


class PreparationStage:
    """``strategy`` applied to generated batches on ``model`` (the trainer's bare policy, only read) through
    ``forward``; ``keep`` past versions in the ring (0: every batch is prepared at the version the model holds);
    ``accelerator`` makes :meth:`agree` collective over the trainer's processes; ``engine_exact``: the engine's
    behaviour log-probs are the pass's old log-probs (:func:`engine_logp_exact`), so a batch whose old log-probs the
    strategy would take in a pass takes them from the engine instead, for its rows sampled under one version
    (:meth:`takes_engine_logp`)."""

    def __init__(self, strategy: OldLogpStrategy, *, model: torch.nn.Module, forward: RoutedForward,
                 accelerator: Any, keep: int = 0, engine_exact: bool = False):
        self.strategy = strategy
        self.engine_exact = bool(engine_exact)
        self.model = model
        self.accelerator = accelerator
        self.ring = VersionRing(keep) if keep > 0 else None
        self.past = PastWeights(model, forward)

    def prepare(self, batch: RolloutBatch, *, current: int) -> PreparedBatch:
        """``batch`` with its old log-probs and measurements, or its non-finite error (stage ``old_logp`` where the
        old log-probs are taken now, ``metrics`` where they are only measured)."""
        if self.takes_engine_logp(batch):
            return self._from_engine(batch, current)
        return self._by_pass(batch, current)

    def _from_engine(self, batch: RolloutBatch, current: int) -> PreparedBatch:
        """The engine's log-probs for the rows sampled under one version; the pass for the rows that span several
        (:func:`engine_logp_exact`)."""
        old = batch.behav_logp.clone()
        spans = (~one_version_rows(batch)).nonzero().flatten()
        if spans.numel():
            passed = self._by_pass(batch.index_select(spans), current)
            if passed.error is not None:
                return passed
            old[spans] = passed.batch.old_logp.to(old.dtype)
        return PreparedBatch(replace(batch, old_logp=old, extras={}))

    def _by_pass(self, batch: RolloutBatch, current: int) -> PreparedBatch:
        """The strategy's passes, each version's on the rows holding its tokens (module docstring)."""
        old = trainer_routes = None
        extras: dict[str, float] = {}
        try:
            for j, version in enumerate(versions_of(batch)):
                model = self.model if version == current else self._past(version)
                if j == 0:
                    taken = self._pass(model, batch)
                    old, trainer_routes, extras = taken.old_logp, taken.trainer_routes, taken.extras
                    if old is None:
                        break
                    continue
                # a newer version's pass runs only on the rows holding its tokens
                mine = batch.token_versions == version
                rows = (mine & batch.response_mask.bool()).any(1).nonzero().flatten()
                taken = self._pass(model, batch.index_select(rows))
                if taken.old_logp is not None:
                    old = old.clone() if j == 1 else old
                    old[rows] = torch.where(mine[rows], taken.old_logp.to(old.dtype), old[rows])
        except NonFiniteError as err:
            return PreparedBatch(None, err)
        routes = trainer_routes if trainer_routes is not None else batch.trainer_routes
        return PreparedBatch(replace(batch, old_logp=old, trainer_routes=routes, extras=extras))

    def takes_engine_logp(self, batch: RolloutBatch) -> bool:
        """Whether ``batch``'s old log-probs are its behaviour log-probs, with no pass: the engine's are exact
        (``engine_exact``), the strategy would take them in a pass now (not fused, not at consumption) and the
        batch has finite behaviour log-probs."""
        return (self.engine_exact and batch.behav_logp is not None
                and self.strategy.stage_after_generation(batch) == "old_logp"
                and all_finite(batch.behav_logp, batch.response_mask))

    def _pass(self, model: torch.nn.Module, batch: RolloutBatch) -> AfterGeneration:
        stage = self.strategy.stage_after_generation(batch)
        what = "trainer log-probs" if stage == "old_logp" else "log-probs of the measurements"
        with nonfinite_as(stage, what), probes.poisoned(stage, batch.generated_at + 1, model):
            taken = self.strategy.after_generation(model, batch)
        if taken.old_logp is not None and not all_finite(taken.old_logp, batch.response_mask):
            raise NonFiniteError("old_logp", "old log-probs")
        return taken

    def _past(self, version: int) -> torch.nn.Module:
        if self.ring is None:
            raise RuntimeError(f"a batch sampled by policy version {version} reached a preparation stage that keeps "
                               "no past versions (buffer.mode=async and rollout.publish_every > 1 keep them)")
        return self.past.model_at(version, self.ring)

    def agree(self, prepared: PreparedBatch) -> PreparedBatch:
        """``prepared`` as every process sees it: with several processes, the latest stage any process found
        non-finite spoils the batch everywhere (one all-reduce, which every process makes)."""
        if self.accelerator.num_processes == 1:
            return prepared
        err = agree_on_stage(prepared.error, self.accelerator)
        return prepared if err is None or prepared.error is not None else PreparedBatch(None, err)

    def keep(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Remember ``weights`` (copied to the CPU) as ``version``."""
        if self.ring is not None:
            self.ring.add(version, weights)

    def weights(self, version: int) -> Mapping[str, torch.Tensor]:
        """The weights kept as ``version``."""
        if self.ring is None:
            raise RuntimeError("this preparation stage keeps no past versions")
        return self.ring[version]
