"""Two processes (torchrun, gloo on CPU): the plug-in's gradient averaged over processes as DDP averages it equals
the gradient of the library's M2PO + TIS loss over the union of both processes' micro-batches, with R3 (global
counts and the M2PO selection all-reduced / all-gathered across processes)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "trl_dist_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_gradient_equals_union_batch_gradient(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(WORKER), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in ranks:
        assert res["world"] == 2 and res["same_keys"]
        assert res["dropped"] > 0                      # M2PO dropped tokens
        assert res["worst"] <= 1e-6 * max(1.0, res["scale"]), res
    assert any(res["differs"] for res in ranks), "the selection across processes equals each process's own"
