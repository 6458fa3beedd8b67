"""One device per vLLM engine: the rule of ``rollout/devices.py``, and what the local workers' transport and the Ray
transport hand their workers (the environment a worker process starts with, the Ray options of an actor), checked
on a CPU with a stand-in GPU count.  None of this has run on a GPU (docs/engines.md)."""
from __future__ import annotations

import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch

from offpolicy_moe.config import load_config
from offpolicy_moe.rollout import devices
from offpolicy_moe.rollout.devices import engine_gpu, ray_gpus_per_actor, visible_devices, worker_environment
from offpolicy_moe.rollout.messages import WorkerFailed, WorkerSpec, unpack
from offpolicy_moe.rollout.worker import worker_main
from offpolicy_moe.sources.process_transport import ProcessTransport
from offpolicy_moe.sources.ray_transport import actor_options


def cfg(*overrides):
    return load_config(overrides=["rollout.engine=vllm", "buffer.mode=async", "buffer.staleness=1", *overrides])


def test_the_engine_of_a_slot_takes_its_device():
    assert [engine_gpu(s, [], 4) for s in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [engine_gpu(s, [4, 5, 6, 7], 8) for s in range(5)] == [4, 5, 6, 7, 4]
    assert engine_gpu(3, [], 0) is None                                 # no GPU: vLLM's own choice (a CPU)
    with pytest.raises(ValueError, match=r"rollout.vllm_devices=\[1, 9\]: GPU 9 is not one of the 8") as err:
        engine_gpu(0, [1, 9], 8)
    assert "\n" not in str(err.value)


def test_an_index_means_the_same_gpu_in_the_trainer_and_in_its_worker():
    assert visible_devices(2, None) == "2"
    assert visible_devices(1, "4,5,6,7") == "5"
    with pytest.raises(ValueError, match="GPU 3 is not one of the 2"):
        visible_devices(3, "0,1")


@pytest.mark.parametrize("overrides, local, index, n, want", [
    ([], "0", 0, 8, "0"),
    (["rollout.workers=2"], "1", 1, 8, "3"),                          # worker 1 of local rank 1: slot 1 * 2 + 1
    (["rollout.workers=2", "rollout.vllm_devices=[4,5,6,7]"], "1", 1, 8, "7"),
    (["rollout.workers=2"], "3", 0, 4, "2"),                          # more workers than GPUs: shared, in turn
])
def test_a_local_worker_starts_with_its_gpu(monkeypatch, overrides, local, index, n, want):
    monkeypatch.setenv("LOCAL_RANK", local)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert worker_environment(cfg(*overrides), rank=99, index=index, n_visible=n) == {"CUDA_VISIBLE_DEVICES": want}


def test_a_worker_of_the_built_in_engine_or_without_gpus_gets_no_device(monkeypatch):
    assert worker_environment(load_config(overrides=["buffer.mode=async", "buffer.staleness=1"]), rank=0, index=0,
                              n_visible=8) == {}
    assert worker_environment(cfg(), rank=0, index=0, n_visible=0) == {}


class _Ctx:
    """A multiprocessing context that records the process it is asked for instead of starting it."""

    def __init__(self):
        self.started = []

    def Pipe(self, duplex=False):
        return multiprocessing.Pipe(duplex=duplex)

    def Process(self, target, args, name, daemon):
        self.started.append(args[0])
        return SimpleNamespace(start=lambda: None, pid=0, sentinel=None)


def test_the_process_transport_hands_each_worker_its_gpu(monkeypatch):
    monkeypatch.setattr(devices, "visible_gpus", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    transport = ProcessTransport(cfg("rollout.workers=2"), entry=worker_main, rank=1, world=2)
    transport._ctx = _Ctx()
    transport.spawn(0)
    transport.spawn(1)
    assert [s.env for s in transport._ctx.started] == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "3"}]
    hf = ProcessTransport(load_config(overrides=["buffer.mode=async", "buffer.staleness=1"]), entry=worker_main,
                          rank=1, world=2)
    hf._ctx = _Ctx()
    hf.spawn(0)
    assert hf._ctx.started[0].env == {}
    for t in (transport, hf):        # no process was started: close the order pipes, end the result reader
        for p in t._procs.values():
            p.orders.close()
        t._results.stop()


def test_a_worker_sets_its_environment_before_anything_else(monkeypatch):
    """The worker fails right after (no config): its GPU was set already, before any CUDA use."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    sent = []
    spec = WorkerSpec(cfg=None, index=0, rank=0, world=1, parent_pid=os.getpid(),
                      env={"CUDA_VISIBLE_DEVICES": "3"})
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit):
            worker_main(spec, None, None, SimpleNamespace(send_bytes=sent.append))
    finally:
        torch.set_num_threads(threads)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert isinstance(unpack(sent[0]), WorkerFailed)


@pytest.mark.parametrize("overrides, cuda, want", [
    (["rollout.backend=ray"], True, 1.0),                            # vLLM and a CUDA trainer: one GPU an actor
    (["rollout.backend=ray"], False, 0.0),
    (["rollout.backend=ray", "rollout.ray_num_gpus=2"], False, 2.0),   # the key decides
    (["rollout.backend=ray", "rollout.engine=hf"], True, 0.0),       # the built-in engine's workers use the CPU
])
def test_a_ray_actor_asks_for_its_gpu(overrides, cuda, want):
    c = cfg(*overrides)
    assert ray_gpus_per_actor(c, cuda) == want
    opts = actor_options(c, "offpolicy-moe-rollout-1-0-0-0", cuda)
    assert opts == {"num_cpus": 1, "num_gpus": want, "max_restarts": 0, "max_task_retries": 0,
                    "name": "offpolicy-moe-rollout-1-0-0-0"}
