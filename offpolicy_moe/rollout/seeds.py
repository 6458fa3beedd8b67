"""The sampling seed of a generation iteration: a pure function of the run's seed, the iteration and the process,
so a resumed run, an asynchronous worker and the synchronous loop all draw the same streams for one iteration."""
from __future__ import annotations

import numpy as np

__all__ = ["iteration_seed"]


def iteration_seed(seed: int, iteration: int, rank: int = 0, salt: int = 0) -> int:
    """Sampling seed of generation iteration ``iteration`` on process ``rank``: the first word of
    ``numpy.random.SeedSequence([seed, iteration, rank, salt])``, so a resumed run regenerates exactly the batch an
    uninterrupted run would have generated."""
    return int(np.random.SeedSequence([seed, iteration, rank, salt]).generate_state(1)[0])
