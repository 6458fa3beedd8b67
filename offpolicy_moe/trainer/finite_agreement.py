"""Non-finite values as every process sees them, before the run's one policy (``trainer.on_nan``, a
:class:`~offpolicy_moe.run.nonfinite.NanCounter`) decides: with several processes one process's NaN is every
process's, so their updates and batches stay in step."""
from __future__ import annotations

from typing import Any, Optional

import torch

from offpolicy_moe.run.faults import is_finite
from offpolicy_moe.run.nonfinite import STAGES, NanCounter, NonFiniteError, as_nonfinite

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
    """Finiteness checks agreed over processes for the step being trained (:attr:`step`, :attr:`iteration`, set by
    the update at each call); :attr:`agreed_err` is the last agreed error of a stage before any optimizer update."""

    def __init__(self, nan: NanCounter, accelerator: Any):
        self.nan, self.acc = nan, accelerator
        self.world, self.device = accelerator.num_processes, accelerator.device
        self.step, self.iteration = 0, 0
        self.agreed_err: Optional[NonFiniteError] = None

    def check(self, value: torch.Tensor, what: str, stage: str) -> bool:
        """True when ``value`` is finite on every process; otherwise the policy decides (:attr:`nan`): it raises
        :class:`NonFiniteError` (``stop``, or too many skips in a row) or counts the skip and False is returned."""
        ok = is_finite(value)
        if self.world > 1:
            flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
            ok = float(self.acc.reduce(flag, "sum").item()) == 0.0
        if not ok:
            self.nan.record(NonFiniteError(stage, what, step=self.step, iteration=self.iteration))
        return ok

    def agreed(self, err: Optional[NonFiniteError], stage: str, what: str) -> Optional[NonFiniteError]:
        """``err`` as every process sees it: with several processes, one process's error is every process's
        (their updates must stay in step); also kept in :attr:`agreed_err`."""
        if self.world > 1:
            flag = torch.tensor([0.0 if err is None else 1.0], device=self.device)
            if float(self.acc.reduce(flag, "sum").item()) > 0 and err is None:
                err = NonFiniteError(stage, f"{what} (on another process)")
        self.agreed_err = err
        return err

    @staticmethod
    def refusal(exc: BaseException, stage: str, what: str) -> NonFiniteError:
        """``exc`` as a :class:`NonFiniteError` of ``stage``; re-raised when it is not a non-finite refusal."""
        err = as_nonfinite(exc, stage, what)
        if err is None:
            raise exc
        return err
