"""Checkpoint files: atomic writes, safe reading (no payload ever runs), checksums, fallback, junk, metrics offset."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from offpolicy_moe.run.checkpoint import (CheckpointError, clean_checkpoint_root, convert_legacy_checkpoint,
                                             latest_checkpoint, load_checkpoint, main, restore_metrics,
                                             resume_checkpoint, rng_state, save_checkpoint, set_rng_state,
                                             verify_checkpoint)


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def rehash(ckpt: Path) -> None:
    """Make the manifest agree with the (tampered) files, so the deserialiser itself is what gets tested."""
    mf = ckpt / "manifest.json"
    m = json.loads(mf.read_text())
    for name in m["files"]:
        data = (ckpt / name).read_bytes()
        m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    mf.write_text(json.dumps(m))


def tiny_checkpoint(root: Path, step: int = 1, **kw) -> Path:
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 / (n + 1))
    args = dict(model=lin, optimizer=opt, scheduler=sched, extra={"step": step, "queue": [(0, {"x": torch.ones(2)})]},
                modules={"predictors": torch.nn.Linear(2, 2, bias=False)})
    args.update(kw)
    return save_checkpoint(root, step, **args)


# ------------------------------------------------------------------------------------------------- writing / layout
def test_checkpoints_are_atomic_and_pruned(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        save_checkpoint(root, step, model={"w": torch.full((2,), float(step))}, extra={"step": step}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]
    (root / ".tmp_step_9_deadbeef").mkdir()     # killed before the rename: never picked
    (root / "step_10").mkdir()                  # incomplete: no files
    assert latest_checkpoint(root).name == "step_3"
    ck = load_checkpoint(latest_checkpoint(root), require=())
    assert ck.state["step"] == 3 and torch.equal(ck.model["w"], torch.full((2,), 3.0))
    save_checkpoint(root, 3, model={"w": torch.zeros(2)}, extra={"step": 3}, keep=0)    # re-save the same step
    assert torch.equal(load_checkpoint(root / "step_3", require=()).model["w"], torch.zeros(2))
    assert latest_checkpoint(tmp_path / "none") is None


def test_round_trip_of_every_part(tmp_path):
    lin = torch.nn.Linear(3, 2)
    tied = {"a": torch.arange(4.0), "b": None}
    tied["b"] = tied["a"]                       # shared storage (tied embeddings) is stored as two tensors
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    rngs = [rng_state(), rng_state()]
    rngs[1]["torch"] = torch.manual_seed(123).get_state()
    p = save_checkpoint(tmp_path, 4, model=lin, optimizer=opt, extra={"n": 7, "t": (1, "x", None, 2.5)},
                        modules={"ref_model": tied, "skipped": None}, rng_states=rngs)
    names = sorted(x.name for x in p.iterdir())
    assert names == ["manifest.json", "model.safetensors", "ref_model.safetensors", "rng_0.pt", "rng_1.pt",
                     "state.pt"]
    ck = load_checkpoint(p, rank=1, require=("optimizer",))
    assert all(torch.equal(v, lin.state_dict()[k]) for k, v in ck.model.items())
    assert torch.equal(ck.modules["ref_model"]["b"], torch.arange(4.0))
    assert ck.state["n"] == 7 and ck.state["t"] == (1, "x", None, 2.5)
    assert torch.equal(ck.state["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(ck.rng["torch"], rngs[1]["torch"])
    assert torch.equal(load_checkpoint(p, rank=0, require=()).rng["torch"], rngs[0]["torch"])
    with pytest.raises(CheckpointError, match="process 2"):
        load_checkpoint(p, rank=2, require=())


def test_rng_state_round_trip_restores_every_generator():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.standard_normal()                 # leaves a cached gaussian in numpy's state
    st = rng_state()
    want = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(st)
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == want


# ------------------------------------------------------------------------------------------------- no payload runs
def _write_torch_payload(f: Path, marker: Path) -> None:
    torch.save({"optimizer": Payload(marker), "scheduler": {}}, f)


def _write_raw_payload(f: Path, marker: Path) -> None:
    f.write_bytes(pickle.dumps(Payload(marker)))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")   # the raw payload is protocol 4
@pytest.mark.parametrize("name", ["state.pt", "rng_0.pt", "model.safetensors", "predictors.safetensors",
                                  "manifest.json"])
@pytest.mark.parametrize("writer", [_write_torch_payload, _write_raw_payload])
def test_a_payload_in_any_checkpoint_file_is_refused_unrun(tmp_path, name, writer):
    p = tiny_checkpoint(tmp_path / "ck")
    marker = tmp_path / "pwned"
    writer(p / name, marker)
    if name != "manifest.json":
        rehash(p)                               # checksums agree: the reader itself must refuse
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(p)
    assert not marker.exists()
    msg = str(err.value)
    assert name in msg and "\n" not in msg


def test_a_class_reference_outside_the_allow_list_is_refused(tmp_path):
    p = tiny_checkpoint(tmp_path, extra={"step": 1, "buffer": {"queue": [(0, {"x": {"__class__": "os:system",
                                                                                     "state": "echo"}})]}})
    with pytest.raises(CheckpointError, match=r"state\.pt.*'os:system'"):
        load_checkpoint(p)


def test_old_pickle_checkpoint_is_refused_unrun_and_converted_only_on_request(tmp_path, capsys):
    p = tmp_path / "step_2"
    p.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(2)}, p / "model.pt")
    torch.save({"evil": Payload(marker)}, p / "state.pt")
    assert latest_checkpoint(tmp_path) == p and resume_checkpoint(tmp_path) == p
    with pytest.raises(CheckpointError, match="old pickle format.*--trust-pickle"):
        load_checkpoint(p)
    with pytest.raises(CheckpointError, match="--trust-pickle"):
        convert_legacy_checkpoint(p)
    assert main(["convert", str(p)]) == 1 and "--trust-pickle" in capsys.readouterr().err
    assert not marker.exists()
    assert clean_checkpoint_root(tmp_path) == [] and p.exists()    # an old checkpoint is not junk


# ------------------------------------------------------------------------------------------------- integrity
def test_flipped_byte_in_model_file_is_caught_before_reading(tmp_path):
    p = tiny_checkpoint(tmp_path)
    f = p / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01                            # a weight's low bit: the file still parses
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*sha256"):
        load_checkpoint(p)
    assert main(["verify", str(p)]) == 1


def test_truncated_newest_falls_back_to_newest_intact(tmp_path):
    for s in (1, 2, 3):
        tiny_checkpoint(tmp_path, s)
    f = tmp_path / "step_3" / "state.pt"
    f.write_bytes(f.read_bytes()[:20])
    logged: list[str] = []
    assert resume_checkpoint(tmp_path, log=logged.append) == tmp_path / "step_2"
    assert "step_3" in logged[0] and "state.pt" in logged[0] and "step_2" in logged[1]


def test_no_intact_checkpoint_names_the_file(tmp_path):
    for s in (1, 2):
        tiny_checkpoint(tmp_path, s)
    (tmp_path / "step_2" / "rng_0.pt").unlink()
    (tmp_path / "step_1" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as err:
        resume_checkpoint(tmp_path, log=lambda m: None)
    assert "step_2" in str(err.value) and "rng_0.pt" in str(err.value) and "\n" not in str(err.value)


def test_garbage_model_file_gives_one_line_error(tmp_path):
    p = tiny_checkpoint(tmp_path)
    (p / "model.safetensors").write_bytes(os.urandom(300))
    rehash(p)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(p)
    assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)


def test_state_without_optimizer_key_gives_one_line_error(tmp_path):
    p = tiny_checkpoint(tmp_path, optimizer=None)
    with pytest.raises(CheckpointError, match=r"state\.pt.*'optimizer'"):
        load_checkpoint(p)


# ------------------------------------------------------------------------------------------------- junk, metrics
def test_junk_of_interrupted_writes_is_cleaned(tmp_path):
    tiny_checkpoint(tmp_path, 1)
    p5 = tiny_checkpoint(tmp_path, 5)
    os.replace(p5, tmp_path / ".old_step_5_0123abcd")      # killed between the two renames of a re-save
    (tmp_path / ".tmp_step_5_deadbeef").mkdir()
    (tmp_path / ".old_step_1_00ff00ff").mkdir()           # step_1 exists: stale copy
    (tmp_path / "step_7").mkdir()                          # no files
    lines = clean_checkpoint_root(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_5"]
    assert len(lines) == 4
    verify_checkpoint(tmp_path / "step_5")


def test_metrics_shorter_than_the_checkpoint_offset_is_refused_not_padded(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_bytes(b'{"step": 0}\n{"step": 1}\n')
    with pytest.raises(CheckpointError, match="fewer than the 40"):
        restore_metrics(f, 40, "step_1")
    assert f.read_bytes() == b'{"step": 0}\n{"step": 1}\n' and b"\0" not in f.read_bytes()
    with pytest.raises(CheckpointError, match="does not end a line"):
        restore_metrics(f, 5)
    restore_metrics(f, 12)
    assert f.read_bytes() == b'{"step": 0}\n'
