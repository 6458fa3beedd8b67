"""Each process gets its OWN RNG states back from a checkpoint (before: rank 0's were applied on every rank)."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from offpolicy_moe.run.checkpoint import gather_rng_states, load_checkpoint, save_checkpoint, set_rng_state

REPO = Path(__file__).resolve().parents[2]


def worker(ckpt_root: str, out: str) -> None:
    """Two gloo processes: different RNG streams per rank, one checkpoint, each rank restores and draws."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    random.seed(10 + rank), np.random.seed(20 + rank), torch.manual_seed(30 + rank)
    rngs = gather_rng_states(SimpleNamespace(num_processes=2))
    want = (random.random(), float(np.random.rand()), torch.rand(3))
    if rank == 0:
        save_checkpoint(ckpt_root, 1, model={"w": torch.zeros(1)}, extra={}, rng_states=rngs)
    dist.barrier()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(load_checkpoint(Path(ckpt_root) / "step_1", rank=rank, require=()).rng)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    torch.save({"want": want, "got": got}, out)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_rank_restores_its_own_rng_states(tmp_path):
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, __file__, str(tmp_path / "ck"), str(tmp_path / f"r{r}.pt")],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    for p in procs:
        log, _ = p.communicate(timeout=180)
        assert p.returncode == 0, log[-3000:]
    res = [torch.load(tmp_path / f"r{r}.pt", weights_only=True) for r in range(2)]
    for r in range(2):
        w, g = res[r]["want"], res[r]["got"]
        assert w[0] == g[0] and w[1] == g[1] and torch.equal(w[2], g[2]), f"rank {r} did not get its own RNG"
    assert not torch.equal(res[0]["got"][2], res[1]["got"][2])     # the ranks' streams really differ


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
