"""Resuming real runs from damaged, hostile and old-format checkpoints (tiny MoE, CPU, one thread)."""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from offpolicy_moe.config.load import to_yaml
from offpolicy_moe.run.checkpoint import CheckpointError, load_checkpoint, main
from offpolicy_moe.trainer.launch import train

from tests.tiny import tiny_config

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ("buffer.staleness=1", "trainer.steps=4", "trainer.checkpoint_every=1", "algo.routing.replay=r3",
             "algo.correction.mode=truncate", "trainer.threads=1", "trainer.keep_checkpoints=0")


def weights(run_dir: Path, step: int) -> dict:
    return load_file(str(run_dir / "checkpoints" / f"step_{step}" / "model.safetensors"))


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref") / "run"
    assert train(tiny_config(d, *OVERRIDES))["status"] == "completed"
    return d


def copy_until(reference_run: Path, dst: Path, step: int) -> Path:
    """The reference run folder as a run killed right after checkpoint ``step`` would have left it."""
    shutil.copytree(reference_run, dst)
    (dst / "summary.json").unlink()
    for p in (dst / "checkpoints").iterdir():
        if int(p.name.split("_")[1]) > step:
            shutil.rmtree(p)
    return dst


def test_flipped_byte_in_newest_model_resumes_from_older_bit_identical(reference_run, tmp_path, capsys):
    d = copy_until(reference_run, tmp_path / "run", 3)
    f = d / "checkpoints" / "step_3" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x10
    f.write_bytes(bytes(data))
    summary = train(tiny_config(d, *OVERRIDES), resume=True)
    assert summary["status"] == "completed"
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "step_2" in err
    ref, got = weights(reference_run, 4), weights(d, 4)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert metrics(d) == metrics(reference_run)


def write_old_format(ckpt: Path) -> None:
    """Rewrite a checkpoint as the previous version wrote it: ``model.pt`` + ``state.pt`` pickles, one RNG state
    with numpy's state as ``np.random.get_state()`` returns it."""
    ck = load_checkpoint(ckpt)
    st = dict(ck.state)
    py, nps = ck.rng["python"], ck.rng["numpy"]
    st["rng"] = {"python": (py["version"], tuple(py["state"].tolist()), py["gauss_next"]),
                 "numpy": (nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                           nps["cached_gaussian"]),
                 "torch": ck.rng["torch"]}
    st["predictors"], st["ref_model"] = None, None
    for p in ckpt.iterdir():
        p.unlink()
    torch.save(ck.model, ckpt / "model.pt")
    torch.save(st, ckpt / "state.pt")


def test_old_format_checkpoint_is_refused_then_converted_on_request_and_resumes_bit_identical(reference_run,
                                                                                               tmp_path):
    d = copy_until(reference_run, tmp_path / "run", 2)
    ckpt = d / "checkpoints" / "step_2"
    write_old_format(ckpt)
    shutil.rmtree(d / "checkpoints" / "step_1")
    shutil.rmtree(d / "checkpoints" / "step_0")
    cfg = tiny_config(d, *OVERRIDES)
    with pytest.raises(CheckpointError, match="convert.*--trust-pickle"):
        train(cfg, resume=True)
    assert main(["convert", str(ckpt), "--trust-pickle"]) == 0
    assert not (ckpt / "model.pt").exists() and (ckpt / "manifest.json").exists()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)      # resume must restore the RNGs itself
    assert train(cfg, resume=True)["status"] == "completed"
    ref, got = weights(reference_run, 4), weights(d, 4)
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert metrics(d) == metrics(reference_run)


def _cli_resume(d: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    cfg = tiny_config(d, *OVERRIDES)
    y = tmp_path / "cfg.yaml"
    y.write_text(to_yaml(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "offpolicy_moe", "train", str(y), "--resume"], env=env,
                          capture_output=True, text=True, timeout=300)


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _rehash(ckpt: Path) -> None:
    m = json.loads((ckpt / "manifest.json").read_text())
    for n in m["files"]:
        b = (ckpt / n).read_bytes()
        m["files"][n] = {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)}
    (ckpt / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("kind", ["payload_state", "garbage_model"])
def test_cli_resume_refuses_hostile_or_garbage_checkpoint_in_one_line(reference_run, tmp_path, kind):
    d = copy_until(reference_run, tmp_path / "run", 1)
    shutil.rmtree(d / "checkpoints" / "step_0")
    ckpt = d / "checkpoints" / "step_1"
    marker = tmp_path / "pwned"
    if kind == "payload_state":
        torch.save({"optimizer": Payload(marker)}, ckpt / "state.pt")
        bad = "state.pt"
    else:
        (ckpt / "model.safetensors").write_bytes(b"\x00garbage" * 50)
        bad = "model.safetensors"
    _rehash(ckpt)
    res = _cli_resume(d, tmp_path)
    assert res.returncode == 1
    assert not marker.exists()
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in res.stderr
    assert len(lines) == 1 and bad in lines[0], res.stderr[-2000:]
