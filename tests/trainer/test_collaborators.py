"""The trainer's collaborators: callbacks never change the computation, the lr schedule equals the formula it
replaced, a micro-batch's forward equals the uncut batch's bit for bit, rollout engines are chosen by name, and the
engine layer never imports the commands."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from offpolicy_moe.trainer.callbacks import Callback, CallbackList, FunctionCallback
from offpolicy_moe.trainer.launch import train
from offpolicy_moe.trainer.optim import lr_schedule
from offpolicy_moe.rollout.engine import ENGINES, EngineCapabilities, HFRolloutEngine, make_engine, register_engine
from offpolicy_moe.trainer.trainer import Trainer
from tests.trainer.test_trainer import final_weights, read_metrics


def old_lr_multiplier(kind: str, warmup: int, total: int):
    """The hand-written schedule the trainer used before ``transformers.get_scheduler`` (the reference)."""
    def f(n: int) -> float:
        if warmup > 0 and n < warmup:
            return (n + 1) / warmup
        if kind == "constant":
            return 1.0
        frac = min(max(n - warmup, 0) / max(total - warmup, 1), 1.0)
        return 0.5 * (1 + math.cos(math.pi * frac)) if kind == "cosine" else 1.0 - frac
    return f


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup,total", [(0, 1), (0, 10), (1, 5), (3, 10), (7, 5), (4, 33)])
def test_lr_schedule_equals_the_old_formula_exactly(kind, warmup, total):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.3)
    sched = lr_schedule(opt, kind, warmup, total)
    f = old_lr_multiplier(kind, warmup, total)
    for n in range(total + 4):          # the n-th update, past the end too
        assert opt.param_groups[0]["lr"] == 0.3 * f(n), (kind, warmup, total, n)
        opt.step()
        sched.step()


def test_lr_schedule_refuses_unknown_kinds():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="optim.scheduler must be constant, cosine or linear"):
        lr_schedule(opt, "exponential", 0, 10)


class _Recorder(Callback):
    def __init__(self):
        self.fused, self.steps = [], []

    def on_batch(self, trainer, batch):
        self.fused.append(batch.old_logp is None)     # fused: the update forward gives them

    def on_step_end(self, trainer, step, metrics):
        self.steps.append(step)


def test_a_callback_leaves_the_run_bit_identical(make_cfg):
    """Before, an ``on_batch`` hook switched the fused old-logp path off: observing a run changed it."""
    common = ("buffer.staleness=0", "trainer.steps=2", "rollout.dtype=bfloat16", "algo.routing.metrics=false")
    plain, observed = make_cfg(*common), make_cfg(*common)
    train(plain)
    rec = _Recorder()
    train(observed, callbacks=[rec])
    assert rec.fused == [True, True] and rec.steps == [1, 2]
    a, b = final_weights(plain.run_dir, 2), final_weights(observed.run_dir, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(plain.run_dir)]
    assert strip == [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in read_metrics(observed.run_dir)]


def test_callbacks_must_be_callback_objects():
    with pytest.raises(TypeError, match="Callback instances, got dict"):
        CallbackList([{"on_batch": print}])
    calls = []
    CallbackList([FunctionCallback(on_step_end=lambda t, s, m: calls.append(s))]).on_step_end(None, 3, {})
    assert calls == [3]


def test_a_micro_batch_forward_equals_the_uncut_batch_bit_for_bit(make_cfg):
    """A micro-batch holding part of a prompt group packs rows as wide as the whole group's, so its log-probs are
    bit for bit the whole batch's (before, a half group packed a narrower row: different float rounding)."""
    tr = Trainer(make_cfg("rollout.dtype=float32", "algo.routing.metrics=false"))
    batch = tr.source.generate(0)
    with torch.no_grad():
        whole = tr.forward.logp(tr.unwrapped, batch)
        for rows in (torch.arange(1, 7), torch.arange(batch.size - 3, batch.size)):
            part = tr.forward.logp(tr.unwrapped, batch.index_select(rows))
            assert torch.equal(part, whole.index_select(0, rows)), rows
        # a 2-row micro-batch: bit for bit where torch's CPU kernels round alike at every batch size; on the AMD
        # EPYC (AVX2) machine the suite runs on since 2026-11-25 the model's own forward (no code of ours: a plain
        # call, hidden layer 1) differs by one float32 ulp between 16 rows and 2, so here it is equal to one ulp
        rows = torch.arange(2)
        part = tr.forward.logp(tr.unwrapped, batch.index_select(rows))
        torch.testing.assert_close(part, whole.index_select(0, rows), rtol=2 ** -23, atol=0)


def test_rollout_engines_are_chosen_by_name_and_capability(make_cfg):
    cfg = make_cfg()
    tr = Trainer(cfg)
    assert isinstance(tr.engine, HFRolloutEngine) and ENGINES["hf"] is HFRolloutEngine
    assert HFRolloutEngine.capabilities == EngineCapabilities(records_routes=True, router_offsets=True,
                                                              records_kept_tokens=True)
    cfg.rollout.engine = "sglang"
    with pytest.raises(ValueError, match=r"rollout.engine='sglang' is not a known engine; choose one of \['hf', 'vllm'\]"):
        make_engine(tr.unwrapped, tr.tok, cfg.rollout)

    class Plain(HFRolloutEngine):
        capabilities = EngineCapabilities()

    ENGINES["plain"] = Plain
    try:
        cfg.rollout.engine = "plain"
        with pytest.raises(ValueError, match="does not support route recording"):
            make_engine(tr.unwrapped, tr.tok, cfg.rollout, record_routes=True)
        cfg.rollout.top_p = 0.9      # truncated sampling needs the kept sets for the trainer's log-probs
        with pytest.raises(ValueError, match="does not support returning the kept sets"):
            make_engine(tr.unwrapped, tr.tok, cfg.rollout)
        cfg.rollout.top_p = 1.0
        assert isinstance(make_engine(tr.unwrapped, tr.tok, cfg.rollout), Plain)
    finally:
        del ENGINES["plain"]


def test_the_trainer_and_run_rooms_never_import_the_commands():
    code = ("import sys, offpolicy_moe.trainer.launch, offpolicy_moe.run.run_dir; "
            "print(sorted(m for m in sys.modules if m.startswith('offpolicy_moe.commands')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    from offpolicy_moe.commands import env
    from offpolicy_moe.run import run_dir

    assert env.environment_info is run_dir.environment_info
    assert {"python", "torch", "transformers"} <= set(run_dir.environment_info())


@pytest.mark.parametrize("fails", [False, True])
def test_a_synchronous_run_closes_its_engine_however_it_ends(make_cfg, monkeypatch, fails):
    """The engine's processes and threads stop with the run (a vLLM client thread alive at interpreter exit aborts
    the process after a finished run), and when the run fails too."""
    closed = []

    class Counted(HFRolloutEngine):
        def close(self) -> None:
            closed.append(self.version)

    register_engine("counted", Counted)
    try:
        tr = Trainer(make_cfg("rollout.engine=counted", "trainer.steps=2"))
        if fails:
            monkeypatch.setattr(tr, "evaluate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("evaluation broke")))
            with pytest.raises(RuntimeError, match="evaluation broke"):
                tr.run()
        else:
            assert tr.run()["status"] == "completed"
    finally:
        del ENGINES["counted"]
    assert len(closed) == 1
