"""A real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``), started once for the Ray tests.

The Ray tests are marked ``ray``; the default suite leaves them out (pyproject's ``addopts``) and they run with
``python -m pytest -q -m ray`` once the ``[ray]`` extra is installed."""
from __future__ import annotations

import os

import pytest

try:
    import ray
    from ray.cluster_utils import Cluster
except ImportError:     # the default suite runs before the [ray] extra is installed (.ci/run): leave the cluster
    ray = None          # tests uncollected; test_ray_weights.py needs no Ray and still runs
    collect_ignore = ["test_ray_source.py", "test_ray_faults.py"]


@pytest.fixture(scope="session")
def cluster():
    """A head node without CPUs (the cluster's control and the trainer's weight registry) and one rollout node with
    one logical CPU (one rollout actor); this process is connected to it.  A dead node is noticed within about 5 s
    (Ray's default is about 30 s); faster checks declare live nodes dead on this loaded 2-core machine."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 5,
                           "health_check_initial_delay_ms": 0}})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False, logging_level="ERROR")
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def make_cfg(tmp_path):
    """``make_cfg(*overrides)``: the tiny config in a fresh run folder under ``tmp_path``."""
    from tests.tiny import tiny_config
    counter = {"n": 0}

    def make(*overrides):
        counter["n"] += 1
        return tiny_config(tmp_path / f"run{counter['n']}", *overrides)

    return make
