"""The preparation stage as the run wires it: sources hand batches to a stage object built in trainer/build.py and
get values back (never a callback into the trainer); old log-probs are written by logprobs/ alone; every
batch's old log-probs are those of the weights that generated it, also when generation lags behind the trainer."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import torch

import offpolicy_moe
from offpolicy_moe.sources.asynchronous import AsyncBatchSource
from offpolicy_moe.sources.sync import SyncBatchSource
from offpolicy_moe.trainer.callbacks import Callback
from offpolicy_moe.trainer.trainer import Trainer
from tests.tiny import tiny_config

ROOT = Path(offpolicy_moe.__file__).parent


def test_a_source_holds_the_stage_and_no_method_of_the_trainer(tmp_path):
    tr = Trainer(tiny_config(tmp_path / "run", "buffer.staleness=1"))
    assert tr.source.stage is tr.stage
    for value in vars(tr.source).values():
        assert getattr(value, "__self__", None) is not tr, value
    for cls in (SyncBatchSource, AsyncBatchSource):
        params = inspect.signature(cls.__init__).parameters
        assert "prepare" not in params and "on_nonfinite" not in params and "stage" in params


def test_old_logp_is_written_only_by_the_logprobs_package():
    writers = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            stores = [t for t in getattr(node, "targets", [getattr(node, "target", None)]) if t is not None]
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
                    isinstance(t, ast.Attribute) and t.attr == "old_logp" for s in stores for t in ast.walk(s)):
                writers.add(rel)
            if isinstance(node, ast.Call) and any(k.arg == "old_logp" for k in node.keywords) \
                    and getattr(node.func, "id", getattr(node.func, "attr", "")) == "replace":
                writers.add(rel)
    assert writers and all(w.startswith("logprobs/") for w in writers), writers


def test_no_module_of_the_trainer_or_the_sources_writes_another_objects_attributes():
    """Only ``self.x = ...``; a parameter's gradient slot and torch's backend flags are torch's own API."""
    found = []
    for pkg in ("trainer", "sources", "logprobs"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
                if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    continue
                for sub in (s for t in targets if t is not None for s in ast.walk(t)):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                        owner = ast.unparse(sub.value)
                        if owner != "self" and sub.attr != "grad" and not owner.startswith("torch.backends"):
                            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(sub)}")
    assert not found, found


def test_the_trainer_package_stays_under_3000_lines():
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "trainer").rglob("*.py"))
    assert lines < 3000, lines


class _Batches(Callback):
    def __init__(self):
        self.seen = []

    def on_batch(self, trainer, batch):
        live = {k: v.detach().clone() for k, v in trainer.unwrapped.state_dict().items()}
        self.seen.append((trainer.step, batch, live))


def test_old_logp_comes_from_the_generating_weights_when_generation_lags_the_trainer(tmp_path):
    """``rollout.publish_every=2``: step 1 trains on a batch of version 0 while the trainer holds version 1.  Its
    old log-probs are version 0's (before, the pass ran on the trainer's live weights, version 1's)."""
    common = ["rollout.publish_every=2", "trainer.steps=2", "rollout.dtype=float32", "algo.correction.mode=truncate",
              "trainer.fuse_old_logp=false"]
    seen = _Batches()
    tr = Trainer(tiny_config(tmp_path / "run", *common), callbacks=[seen])
    v0 = {k: v.detach().clone() for k, v in tr.unwrapped.state_dict().items()}
    tr.run()
    step, batch, live = seen.seen[1]
    assert step == 1 and batch.version == 0
    refs = {}
    for name, state in (("v0", v0), ("live", live)):
        holder = Trainer(tiny_config(tmp_path / name, *common))
        holder.unwrapped.load_state_dict(state)
        plain = dataclasses.replace(batch, old_logp=None, token_versions=None)
        refs[name] = holder.stage.prepare(plain, current=plain.version).batch.old_logp
    assert not torch.equal(refs["v0"], refs["live"])
    assert torch.equal(batch.old_logp, refs["v0"])
