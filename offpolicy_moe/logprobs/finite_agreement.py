"""Non-finite values as every process sees them: with several processes one process's NaN is every process's, so
their updates and batches stay in step.  What is found is raised as one
:class:`~offpolicy_moe.run.nonfinite.NonFiniteError`; the training loop alone applies ``trainer.on_nan`` to it."""
from __future__ import annotations

from typing import Any, Optional

import torch

from offpolicy_moe.run.nonfinite import STAGES, NonFiniteError, is_finite

__all__ = ["FiniteAgreement", "agree_on_stage"]


def agree_on_stage(err: Optional[NonFiniteError], accelerator: Any) -> Optional[NonFiniteError]:
    """``err`` (None: finite here) as every process sees it, for a batch all processes consume together: the
    latest stage (in :data:`~offpolicy_moe.run.nonfinite.STAGES` order) any process found non-finite; one
    all-reduce, which every process must make."""
    code = float(STAGES.index(err.stage) + 1) if err is not None else 0.0
    t = torch.tensor([code], device=accelerator.device)
    worst = int(accelerator.reduce(t, "max").item())
    if worst and err is None:
        err = NonFiniteError(STAGES[worst - 1], "values on another process")
    return err


class FiniteAgreement:
    """Finiteness checks agreed over processes for the step being trained (set by :meth:`at` at each update), raised
    as :class:`NonFiniteError` located at that step and iteration."""

    def __init__(self, accelerator: Any):
        self.acc = accelerator
        self.world, self.device = accelerator.num_processes, accelerator.device
        self.step, self.iteration = 0, 0

    def at(self, step: int, iteration: int) -> None:
        """The checks that follow belong to trained step ``step`` (1-based) at generation iteration ``iteration``."""
        self.step, self.iteration = step, iteration

    def require(self, value: torch.Tensor, what: str, stage: str) -> None:
        """Return when ``value`` is finite on every process; otherwise raise :class:`NonFiniteError` (``stage``)
        on every process."""
        ok = is_finite(value)
        if self.world > 1:
            flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
            ok = float(self.acc.reduce(flag, "sum").item()) == 0.0
        if not ok:
            raise NonFiniteError(stage, what, step=self.step, iteration=self.iteration)

    def raise_agreed(self, err: Optional[NonFiniteError], stage: str, what: str) -> None:
        """Raise ``err`` as every process sees it (located at the current step): with several processes, one
        process's error is every process's (their updates must stay in step); return when no process has one."""
        if self.world > 1:
            flag = torch.tensor([0.0 if err is None else 1.0], device=self.device)
            if float(self.acc.reduce(flag, "sum").item()) > 0 and err is None:
                err = NonFiniteError(stage, f"{what} (on another process)")
        if err is not None:
            raise err.located(self.step, self.iteration)
