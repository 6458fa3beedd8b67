"""The update's seams: one old-log-prob strategy chosen in trainer/build.py (the only reader of
``algo.old_logp_source``), the micro-batch loss as a pure function, and the fault injection reaching the step only
through the test seam of run/probes.py."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import offpolicy_moe
from offpolicy_moe.losses import aggregate, get_loss_spec, kl_penalty, resolve_loss_options
from offpolicy_moe.run import fault_injection, probes
from offpolicy_moe.logprobs import strategies
from offpolicy_moe.trainer.build import old_logp_strategy
from offpolicy_moe.trainer.micro_loss import LossOptions, MicroBatchTensors, micro_batch_loss
from tests.tiny import tiny_config


class _Passes:
    """What the strategies read of the pass after generation."""

    def __init__(self, measure_routing: bool = False):
        self.measure_routing = measure_routing


@pytest.mark.parametrize("overrides,expected", [
    ((), strategies.Fused),
    (("trainer.fuse_old_logp=false",), strategies.Recomputed),
    (("buffer.staleness=1",), strategies.Recomputed),
    (("algo.correction.mode=truncate",), strategies.Recomputed),
    (("algo.old_logp_source=engine",), strategies.FromEngine),
    (("algo.old_logp_source=proximal", "buffer.staleness=1"), strategies.AtConsumption),
    (("algo.old_logp_source=proximal", "algo.proximal_logp=loglinear", "buffer.staleness=1"), strategies.Loglinear),
])
def test_the_strategy_is_chosen_once_from_the_config(tmp_path, overrides, expected):
    cfg = tiny_config(tmp_path, *overrides)
    got = old_logp_strategy(cfg, _Passes(), needs_global_pass=False, device=torch.device("cpu"))
    assert type(got) is expected


def test_a_global_selection_pass_or_measured_replay_rules_fusion_out(tmp_path):
    cfg = tiny_config(tmp_path)
    assert type(old_logp_strategy(cfg, _Passes(), needs_global_pass=True, device="cpu")) is strategies.Recomputed
    cfg = tiny_config(tmp_path, "algo.routing.replay=r3")
    assert type(old_logp_strategy(cfg, _Passes(True), needs_global_pass=False, device="cpu")) is strategies.Recomputed
    assert type(old_logp_strategy(cfg, _Passes(False), needs_global_pass=False, device="cpu")) is strategies.Fused


def test_only_the_builder_reads_old_logp_source():
    root = Path(offpolicy_moe.__file__).parent
    readers = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("config/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("old_logp_source", "proximal_logp"):
                readers.add(rel)
    assert readers == {"trainer/build.py"}


def _tensors(seed: int = 0, rows: int = 3, cols: int = 5) -> MicroBatchTensors:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, cols, generator=g)
    mask = (torch.rand(rows, cols, generator=g) > 0.2).float()
    return MicroBatchTensors(logp=logp, old_logp=logp - 0.1 * torch.rand(rows, cols, generator=g),
                             advantages=torch.randn(rows, generator=g), mask=mask,
                             num_tokens=mask.sum(), num_seqs=torch.tensor(float(rows)),
                             ref_logp=logp - 0.2 * torch.rand(rows, cols, generator=g))


def _options(kl_coef: float) -> LossOptions:
    spec = get_loss_spec("grpo")
    return LossOptions(fn=spec.fn, options=resolve_loss_options("grpo", {}), agg="token-mean", norm_length=5,
                       kl_coef=kl_coef, kl_kind="k3")


def test_the_micro_batch_loss_composes_objective_kl_and_pr2():
    t, opts = _tensors(), _options(0.3)
    objective, _ = opts.fn(t.logp, t.old_logp, t.advantages, t.mask, agg="token-mean", num_tokens=t.num_tokens,
                           num_seqs=t.num_seqs, norm_length=5, weights=None, **opts.options)
    kl = aggregate(kl_penalty(t.logp, t.ref_logp, "k3", mask=t.mask), t.mask, "token-mean",
                   num_tokens=t.num_tokens, num_seqs=t.num_seqs, norm_length=5)
    pr2 = (torch.tensor(0.8), {"pr2/x": torch.tensor(1.0)})
    got = micro_batch_loss(t, opts, pr2, micro_batches=4)
    assert torch.equal(got.policy, objective + 0.3 * kl)
    assert torch.equal(got.total, objective + 0.3 * kl + 0.8 / 4)
    assert torch.equal(got.metrics["actor/kl_ref"], kl.detach()) and "pr2/x" in got.metrics
    plain = micro_batch_loss(t, _options(0.0))
    assert torch.equal(plain.policy, objective) and plain.total is plain.policy
    assert "actor/kl_ref" not in plain.metrics


def test_the_micro_batch_loss_is_pure():
    t = _tensors(1)
    before = {k: v.clone() for k, v in vars(t).items() if isinstance(v, torch.Tensor)}
    a, b = micro_batch_loss(t, _options(0.1)), micro_batch_loss(t, _options(0.1))
    assert torch.equal(a.total, b.total)
    assert all(torch.equal(before[k], getattr(t, k)) for k in before)


def test_without_a_probe_the_seam_changes_nothing():
    fault_injection.disarm()
    assert probes.installed() is None
    x = torch.ones(3)
    assert probes.value("loss", 2, x) is x
    assert probes.poison_("gradients", 2, x) is False and torch.equal(x, torch.ones(3))
    with probes.poisoned("reference", 2, torch.nn.Linear(2, 2)) as fired:
        assert fired is False
    assert probes.handoff() is None


def test_arming_a_fault_installs_it_in_the_seam_and_disarming_removes_it():
    try:
        fault_injection.arm("loss", 2)
        assert probes.installed() is fault_injection.PROBE
        fn, args = probes.handoff()
        assert args == ((fault_injection.Fault("loss", 2, 1),),)
        assert torch.isnan(probes.value("loss", 2, torch.ones(2))).all()
        assert torch.equal(probes.value("loss", 2, torch.ones(2)), torch.ones(2))     # consumed
    finally:
        fault_injection.disarm()
    assert probes.installed() is None
