"""Full states of FSDP2-sharded models (run/full_state.py, and the checkpoint storage's full optimizer state and
loaders in run/checkpoint.py): the rollout engine, checkpoints and exports see the
same plain tensors as for an unsharded model, and loading them back restores the sharded model and optimizer.
FSDP2 runs on CPU over gloo with one process here; the GPU run is in experiments/gpu/smoke.sh."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from offpolicy_moe.run.checkpoint import full_optimizer_state, load_full_model_state, load_full_optimizer_state
from offpolicy_moe.run.full_state import as_full_tensor, full_model_state, is_sharded
from tests.tiny import free_port


@pytest.fixture
def gloo_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_plain_models_pass_through():
    m = _net(0)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    _step(m, opt, 1)
    assert not is_sharded(m)
    assert full_model_state(m).keys() == m.state_dict().keys()
    assert full_optimizer_state(m, opt)["state"].keys() == opt.state_dict()["state"].keys()


def test_sharded_states_equal_the_unsharded_run_and_round_trip(gloo_group):
    plain, sharded = _net(0), _net(0)
    fully_shard(sharded)
    assert is_sharded(sharded)
    po = torch.optim.AdamW(plain.parameters(), lr=0.1)
    so = torch.optim.AdamW(sharded.parameters(), lr=0.1)
    for s in range(3):
        _step(plain, po, s)
        _step(sharded, so, s)
    full = full_model_state(sharded)
    ref = plain.state_dict()
    assert all(type(v) is torch.Tensor for v in full.values())
    assert all(torch.allclose(full[k], ref[k], atol=1e-6) for k in ref)
    osd = full_optimizer_state(sharded, so)
    saved = copy.deepcopy((full, osd))
    _step(sharded, so, 7)                            # move away, then load the saved states back
    load_full_model_state(sharded, saved[0])
    load_full_optimizer_state(sharded, so, saved[1])
    back = full_model_state(sharded)
    assert all(torch.equal(back[k], saved[0][k]) for k in back)
    _step(sharded, so, 9)
    _step(plain, po, 9)                              # the restored optimizer continues like the plain one
    after, ref = full_model_state(sharded), plain.state_dict()
    assert all(torch.allclose(after[k], ref[k], atol=1e-5) for k in ref)


def test_gradient_norm_of_a_sharded_model_is_a_plain_tensor(gloo_group):
    """The FSDP2 GPU run failed turning the gradient norm (a DTensor) into a metric float."""
    plain, sharded = _net(0), _net(0)
    fully_shard(sharded)
    for m in (plain, sharded):
        torch.manual_seed(3)
        m(torch.randn(5, 4)).pow(2).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1e9)
    assert isinstance(norm, torch.distributed.tensor.DTensor)
    full = as_full_tensor(norm)
    assert type(full) is torch.Tensor
    assert torch.allclose(full, torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9), atol=1e-6)
    assert full.tolist() == pytest.approx(float(full))
