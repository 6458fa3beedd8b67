"""The loss of one micro-batch as a pure function: the tensors in, the loss and its metrics out.

Every term of the objective is composed here, in one place (as verl composes its policy loss at one call site):

    policy = objective(logp, old_logp, advantages, mask; behaviour weights, global counts, loss options)
             + kl.coef * aggregate(kl_penalty(logp, ref_logp))                        (with a reference)
    total  = policy + pr2_loss / micro_batches                                        (PR2 predictors)

The objective is the registry loss of ``algo.loss`` (its off-policy correction enters as the behaviour weights);
the PR2 predictor loss is computed from the update forward's router capture by the caller and only added here
(its gradient reaches the predictors alone).  Nothing in this module reads a config, a model or a counter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from offpolicy_moe.losses import aggregate, kl_penalty

__all__ = ["LossOptions", "MicroBatchTensors", "MicroLoss", "micro_batch_loss", "options_from"]


@dataclass(frozen=True)
class LossOptions:
    """The resolved options of the loss: the registry function and its options (``algo.loss``), the aggregation
    and its length normaliser, and the KL penalty to the reference (``algo.kl``)."""

    fn: Callable
    options: dict
    agg: Optional[str]
    norm_length: int
    kl_coef: float = 0.0
    kl_kind: str = "k3"


@dataclass
class MicroBatchTensors:
    """One micro-batch on the device: the update forward's log-probs, the old log-probs, the advantages, the
    response mask, the behaviour weights (None: none), the mini-batch's global token / sequence counts, the
    metrics of weights computed for this micro-batch alone, the reference log-probs (None: no KL term) and the
    loss's selection over the whole mini-batch (keyword arguments of the loss)."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    num_tokens: torch.Tensor
    num_seqs: torch.Tensor
    weights: Optional[torch.Tensor] = None
    weight_metrics: dict = field(default_factory=dict)
    ref_logp: Optional[torch.Tensor] = None
    selection: dict = field(default_factory=dict)


@dataclass
class MicroLoss:
    """``policy``: the objective with its KL term (what the non-finite check judges); ``total``: what the backward
    runs on (``policy`` plus the PR2 term); ``metrics``: the loss's, ``actor/kl_ref``, the weights' and PR2's."""

    policy: torch.Tensor
    total: torch.Tensor
    metrics: dict


def micro_batch_loss(t: MicroBatchTensors, opts: LossOptions,
                     pr2: Optional[tuple[torch.Tensor, dict]] = None, micro_batches: int = 1) -> MicroLoss:
    """The micro-batch loss of the module docstring; ``pr2``: the PR2 predictor loss and its metrics (None: no PR2
    term), spread over the mini-batch's ``micro_batches`` pieces.  Raises what the loss library raises (a
    ``ValueError`` for a non-finite input)."""
    kw = dict(agg=opts.agg, num_tokens=t.num_tokens, num_seqs=t.num_seqs, norm_length=opts.norm_length,
              weights=t.weights, **opts.options)
    kw.update(t.selection)
    loss, metrics = opts.fn(t.logp, t.old_logp, t.advantages, t.mask, **kw)
    if t.ref_logp is not None and opts.kl_coef > 0:
        kl_tok = kl_penalty(t.logp, t.ref_logp, opts.kl_kind, mask=t.mask)
        kl = aggregate(kl_tok, t.mask, opts.agg or "token-mean", num_tokens=t.num_tokens, num_seqs=t.num_seqs,
                       norm_length=opts.norm_length)
        loss = loss + opts.kl_coef * kl
        metrics = dict(metrics, **{"actor/kl_ref": kl.detach()})
    if t.weight_metrics:
        metrics = dict(metrics, **t.weight_metrics)
    total = loss
    if pr2 is not None:
        ploss, pmetrics = pr2
        total = loss + ploss / micro_batches
        metrics = dict(metrics, **pmetrics)
    return MicroLoss(loss, total, metrics)


def options_from(loss_fn: Callable, options: dict, cfg: Any, norm_length: int) -> LossOptions:
    """:class:`LossOptions` of ``algo.loss`` / ``algo.kl`` in ``cfg`` (``loss_fn`` and ``options``: the registry's
    resolved entry)."""
    return LossOptions(fn=loss_fn, options=dict(options), agg=cfg.algo.loss.agg, norm_length=norm_length,
                       kl_coef=float(cfg.algo.kl.coef), kl_kind=cfg.algo.kl.kind)
