"""The gradients of one optimizer update: the missing ones made zero, PR2 predictors' averaged over processes by
hand, and the global gradient norm (clipped)."""
from __future__ import annotations

from typing import Any

import torch

from offpolicy_moe.run.full_state import as_full_tensor

__all__ = ["zero_missing_grads", "average_predictor_grads", "grad_norm"]


def zero_missing_grads(model: torch.nn.Module) -> None:
    """Give every trainable parameter without a gradient a zero one.  Rows skipped for a zero advantage would have
    given the parameters they reach an exactly-zero gradient; with a zero (rather than a missing) gradient the
    optimizer decays its moment estimates as it would have, so the step equals the one without the skip."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def average_predictor_grads(predictors: Any, world: int) -> None:
    """PR2 predictors are not wrapped in DDP: average their gradients over processes by hand so every process
    applies the same predictor update.  Each process's backward ran on ``loss * world``, so the sum over
    processes is divided by ``world**2``: the mean over processes of the local gradients.  Nothing to do without
    predictors or with one process."""
    if predictors is None or world == 1:
        return
    params = [p for p in predictors.parameters() if p.requires_grad]
    for p in params:     # a process without PR2 features this step contributes zeros (no deadlock)
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    flat /= float(world * world)
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n


def grad_norm(accelerator: Any, model: torch.nn.Module, clip: float) -> torch.Tensor:
    """The global gradient norm ``sqrt(sum_p ||g_p||^2)``, clipped to ``clip`` by the accelerator when ``clip > 0``
    (``optim.grad_clip``); a plain tensor also for a sharded model."""
    if clip > 0:
        return as_full_tensor(accelerator.clip_grad_norm_(model.parameters(), clip))
    return as_full_tensor(torch.sqrt(sum((q.grad.detach().float() ** 2).sum() for q in model.parameters()
                                         if q.grad is not None)))
