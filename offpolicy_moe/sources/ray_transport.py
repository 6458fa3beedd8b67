"""Rollout workers as Ray actors: the asynchronous source's transport for ``rollout.backend=ray``.

The source (:class:`~offpolicy_moe.sources.asynchronous.AsyncBatchSource`) is the same as with local processes:
orders, staleness, the old-log-prob pass, the checkpoint (a run may resume on the other backend) and the metrics
(``async/*``).  What this transport does differently:

* workers are ``rollout.workers`` :class:`~offpolicy_moe.rollout.ray_actor.RolloutActor` s, placed by Ray anywhere
  in the cluster of ``rollout.ray_address`` (else ``RAY_ADDRESS``, else ``ray.init()``'s default: a cluster on this
  machine), ``rollout.worker_threads`` CPUs and :func:`~offpolicy_moe.rollout.devices.ray_gpus_per_actor` GPUs
  each (one with vLLM when the trainer sees CUDA); one that does not start within ``rollout.worker_timeout_s``
  is a :class:`PipelineTimeout`, one that fails to start a :class:`WorkerDied`;
* weights: each published version is ``ray.put`` once into the object store; a
  :class:`~offpolicy_moe.rollout.ray_actor.WeightRegistry` actor, pinned to the trainer's node, holds the newest
  reference, and an actor pulls it (once per version it uses) when it starts an order (``async/weight_sync_s``:
  the trainer's put);
* an order is an actor call returning a :class:`~offpolicy_moe.rollout.worker.BatchDone`; the trainer waits on the
  calls (``ray.wait``);
* an actor that dies is seen at once through its ``watch`` call (pending for the actor's life, like a process
  sentinel, even when it has no order in flight); a call that raises is told apart from a dead actor by
  :func:`actor_died`.  Either is reported as a :class:`~offpolicy_moe.sources.transport.WorkerLost` naming the
  cause; when the actor's NODE is gone (said by Ray, or seen within ``_NODE_GRACE_S``), ``node_lost`` is set and
  the source applies ``rollout.ray_on_node_loss`` instead of ``rollout.on_worker_death``.

Nothing here imports Ray at module level (``importlib`` in the constructor, :func:`connect`): without
``rollout.backend=ray`` no Ray module is loaded, and the source imports this module only for that backend.
"""
from __future__ import annotations

import importlib
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

import torch

from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.rollout.devices import ray_gpus_per_actor
from offpolicy_moe.rollout.ray_actor import RolloutActor, WeightRegistry, encode_weights
from offpolicy_moe.rollout.messages import BatchDone, Order, WorkerSpec
from offpolicy_moe.sources.transport import Event, PipelineTimeout, WorkerDied, WorkerLost

__all__ = ["RayTransport", "actor_died", "actor_options", "connect", "ray_address"]
_CONNECT_TIMEOUT_S = 5.0
_NODE_GRACE_S = 15.0       # how long a dead actor's node is watched for its own death before a restart


def ray_address(cfg: Any) -> Optional[str]:
    """The cluster the actors go to: ``rollout.ray_address``, else ``RAY_ADDRESS``, else None (``ray.init()``'s
    default: a running local cluster, or a new one)."""
    return cfg.rollout.ray_address or os.environ.get("RAY_ADDRESS") or None


def _probe(address: str) -> None:
    """Raise ``OSError`` unless a TCP connection to ``address``'s ``host:port`` opens within a few seconds (so an
    unreachable cluster fails at once, not after ``ray.init``'s retries)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise OSError("not host:port")
    with socket.create_connection((host, int(port)), timeout=_CONNECT_TIMEOUT_S):
        pass


def connect(cfg: Any) -> Any:
    """The ``ray`` module, connected to the cluster of :func:`ray_address` (kept if this process is already
    connected); a one-line :class:`ConfigError` naming the address when Ray is missing or the cluster cannot be
    reached."""
    try:
        ray = importlib.import_module("ray")
    except ImportError as e:
        raise ConfigError(f"rollout.backend=ray needs Ray: pip install -e \".[ray]\" ({e})") from None
    if ray.is_initialized():
        return ray
    address = ray_address(cfg)
    where = ("rollout.ray_address" if cfg.rollout.ray_address else "RAY_ADDRESS") if address else "ray.init()"
    try:
        if address and address not in ("auto", "local"):
            _probe(address)
        kwargs = {} if address else {"include_dashboard": False}
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False, logging_level="ERROR",
                 configure_logging=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure to connect becomes the one-line error below
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"rollout.backend=ray: cannot reach the Ray cluster at {address or 'the default'} "
                          f"({where}): {first}") from None
    return ray


def actor_options(cfg: Any, name: str, cuda: Optional[bool] = None) -> dict:
    """The Ray options of a rollout actor named ``name``: ``rollout.worker_threads`` CPUs, its GPUs
    (:func:`~offpolicy_moe.rollout.devices.ray_gpus_per_actor`; ``cuda``: whether the trainer sees CUDA, read when
    None), no restart by Ray (the source restarts it)."""
    return dict(num_cpus=int(cfg.rollout.worker_threads), num_gpus=ray_gpus_per_actor(cfg, cuda), max_restarts=0,
                max_task_retries=0, name=name)


@dataclass
class _Actor:
    index: int
    handle: Any
    info: dict                    # {"pid", "node_id", "ip"}: where it runs


class _ObjectStoreWeights:
    """What the local pipeline's :class:`~offpolicy_moe.rollout.weights.WeightBoard` does, across machines: each
    published version is put into Ray's object store once and announced to the registry."""

    def __init__(self, ray: Any, registry: Any):
        self.ray, self.registry = ray, registry
        self.version, self.ref = -1, None

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        """Put ``state_dict`` as ``version`` (:func:`encode_weights`: NumPy byte views, stored without pickling
        the tensors); returns the seconds spent."""
        t0 = time.perf_counter()
        self.ref, self.version = self.ray.put(encode_weights(state_dict)), int(version)
        self.registry.set.remote(self.version, [self.ref])
        return time.perf_counter() - t0


class RayTransport:
    """Rollout actors of trainer process ``rank`` (of ``world``) on a Ray cluster (see module docstring).
    Connects to the cluster at construction (before any compute)."""

    noun = "actor"

    def __init__(self, cfg: Any, *, rank: int = 0, world: int = 1):
        self.cfg, self.rank, self.world = cfg, int(rank), int(world)
        self.timeout = float(cfg.rollout.worker_timeout_s)
        self.ray = connect(cfg)
        self._actors: dict[int, _Actor] = {}
        self._calls: dict[Any, int] = {}            # object ref of a generate call -> the slot it went to
        self._watch: dict[Any, _Actor] = {}         # object ref of an actor's watch call (fails when it dies)
        self._registry: Any = None
        self._weights: Optional[_ObjectStoreWeights] = None

    # ------------------------------------------------------------------ weights
    def start(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """The weight registry on the trainer's node, and ``weights`` put as ``version``."""
        self._registry = self.place_registry()
        self._weights = _ObjectStoreWeights(self.ray, self._registry)
        self._weights.publish(weights, version)

    def place_registry(self) -> Any:
        """A new :class:`WeightRegistry` actor pinned to the trainer's own node (hard node affinity; it needs no
        CPU, so it always fits there).  A soft affinity is not enough: a raylet without CPUs (a head node started
        with ``num_cpus=0``) spills even a zero-CPU actor to another node, and a registry on a rollout node dies
        with that node, failing every other actor's orders."""
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        here = strategies.NodeAffinitySchedulingStrategy(node_id=self.ray.get_runtime_context().get_node_id(),
                                                         soft=False)
        return self.ray.remote(WeightRegistry).options(num_cpus=0, scheduling_strategy=here).remote()

    def registry_node(self) -> str:
        """Ray node id of the weight registry actor (the trainer's node)."""
        return self.ray.get(self._registry.node.remote(), timeout=self.timeout)

    def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> float:
        """Put ``weights`` into the object store as ``version``; returns the seconds spent."""
        return self._weights.publish(weights, version)

    # ------------------------------------------------------------------ actors
    def spawn(self, index: int, restarts: int = 0) -> None:
        """A new actor for slot ``index`` (named with its ``restarts``), waited for (at most
        ``rollout.worker_timeout_s``)."""
        ro = self.cfg.rollout
        spec = WorkerSpec(cfg=self.cfg, index=index, rank=self.rank, world=self.world, parent_pid=os.getpid(),
                          threads=int(ro.worker_threads), weight_timeout_s=self.timeout,
                          update_in_flight=bool(ro.update_in_flight))
        options = actor_options(self.cfg, f"offpolicy-moe-rollout-{os.getpid()}-{self.rank}-{index}-{restarts}")
        handle = self.ray.remote(concurrency_groups={"watch": 1})(RolloutActor).options(**options).remote(
            spec, self._registry)
        try:
            info = self.ray.get(handle.ready.remote(), timeout=self.timeout)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.kill(handle)
            gpus = f" and {options['num_gpus']:g} free GPU(s)" if options["num_gpus"] else ""
            raise PipelineTimeout(f"waited {self.timeout:.0f} s (rollout.worker_timeout_s) for Ray rollout actor "
                                  f"{index} to start (no node with {ro.worker_threads} free CPU(s){gpus}?)") from None
        except self.ray.exceptions.RayError as e:
            raise WorkerDied(f"Ray rollout actor {index} failed to start: {_cause(e)}") from None
        actor = _Actor(index=index, handle=handle, info=info)
        self._actors[index] = actor
        self._watch[handle.watch.options(concurrency_group="watch").remote()] = actor

    def send(self, index: int, order: Order) -> None:
        """An actor call generating ``order`` with at least the newest put version."""
        ref = self._actors[index].handle.generate.remote(order, self._weights.version, [self._weights.ref])
        self._calls[ref] = index

    def actor_nodes(self) -> list[str]:
        """Ray node ids of the live actors (slot order)."""
        return [self._actors[i].info["node_id"] for i in sorted(self._actors)]

    def pids(self) -> list[int]:
        """Process ids of the live actors (slot order)."""
        return [self._actors[i].info["pid"] for i in sorted(self._actors)]

    def alive(self, index: int) -> bool:
        """Whether actor ``index``'s watch call is still pending (the actor not seen dead)."""
        return index in self._actors and any(a is self._actors[index] for a in self._watch.values())

    def describe(self, index: int, detail: str = "") -> str:
        """``Ray rollout actor <index> (pid <pid> on <ip>[, detail])``."""
        info = self._actors[index].info
        extra = f", {detail}" if detail else ""
        return f"Ray rollout actor {index} (pid {info['pid']} on {info['ip']}{extra})"

    # ------------------------------------------------------------------ receiving
    def receive(self, timeout: float) -> Iterator[Event]:
        """The calls that finished within ``timeout`` seconds: batches, and the deaths of actors (their watch call
        ended, or a call raised).  Calls of an actor already retired are passed over."""
        refs = list(self._calls) + list(self._watch)
        if not refs:
            time.sleep(min(timeout, 0.05))
            return
        done, rest = self.ray.wait(refs, num_returns=1, timeout=timeout)
        if done and rest:
            done += self.ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        for ref in done:
            if ref in self._watch:
                actor = self._watch.pop(ref)
                if self._actors.get(actor.index) is actor:
                    try:
                        self.ray.get(ref, timeout=self.timeout)
                        cause, raw = "its watch call returned", ""
                    except self.ray.exceptions.RayError as e:
                        cause, raw = _cause(e), str(e)
                    yield self._lost(actor, cause, died=True, raw=raw)
                continue
            index = self._calls.pop(ref, None)
            if index is None or index not in self._actors:
                continue                     # a call of an actor already retired
            actor = self._actors[index]
            try:
                done_msg = self.ray.get(ref, timeout=self.timeout)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.RayTaskError) as e:
                died = actor_died(self.ray, e)
                yield self._lost(actor, _cause(e), died=died, raw=str(e) if died else "")
                continue
            if not isinstance(done_msg, BatchDone):
                raise TypeError(f"Ray rollout actor {index} answered a {type(done_msg).__name__}, not a BatchDone")
            yield done_msg

    def _lost(self, actor: _Actor, cause: str, *, died: bool, raw: str) -> WorkerLost:
        """The death report of ``actor``: its node's loss when the actor died (``died``) and Ray says, or soon
        shows, that its node is gone; else ``cause``."""
        node_lost = died and ("node has died" in raw or self._node_dies(actor.info["node_id"]))
        if node_lost:
            return WorkerLost(actor.index, f"its node {actor.info['node_id'][:12]} ({actor.info['ip']}) left the "
                                           "cluster", node_lost=True)
        return WorkerLost(actor.index, cause)

    def _node_alive(self, node_id: str) -> bool:
        return any(n.get("NodeID") == node_id and n.get("Alive") for n in self.ray.nodes())

    def _node_dies(self, node_id: str) -> bool:
        """True when node ``node_id`` is, or within ``_NODE_GRACE_S`` seconds is reported, dead: an actor's death
        is often reported before its node's (the cluster's health checks take a few seconds to declare a node
        dead), so a dead actor's node is watched that long before the actor is restarted on the same slot."""
        deadline = time.perf_counter() + _NODE_GRACE_S
        while self._node_alive(node_id):
            if time.perf_counter() > deadline:
                return False
            time.sleep(0.5)
        return True

    def retire(self, index: int) -> None:
        """Forget actor ``index``'s calls and watch, and kill it (no restart by Ray)."""
        actor = self._actors.pop(index)
        self._calls = {r: i for r, i in self._calls.items() if i != index}
        self._watch = {r: a for r, a in self._watch.items() if a is not actor}
        self.ray.kill(actor.handle, no_restart=True)

    def close(self, timeout: float = 5.0) -> None:
        """Kill the actors and the registry (the cluster itself stays up); idempotent."""
        for a in self._actors.values():
            self.ray.kill(a.handle, no_restart=True)
        if self._registry is not None:
            self.ray.kill(self._registry, no_restart=True)
        self._actors, self._calls, self._watch, self._registry = {}, {}, {}, None


def actor_died(ray: Any, e: BaseException) -> bool:
    """Whether Ray error ``e`` from an actor's call says that the ACTOR is gone (dead, or unreachable:
    ``ActorUnavailableError``), as opposed to the call raising.  A call that raised is a ``RayTaskError`` even
    when what it raised is itself an actor error (the actor's own call to another actor, e.g. the weight registry,
    failed): Ray's ``RayTaskError.as_instanceof_cause`` makes such an error an instance of BOTH classes, so the
    ``RayTaskError`` test comes first; otherwise the other actor's death (its node's, say) would be read as this
    actor's."""
    exc = ray.exceptions
    if isinstance(e, exc.RayTaskError):
        return False
    return isinstance(e, exc.RayActorError)


def _cause(e: BaseException) -> str:
    """A Ray error's cause in one short line: a dead actor's exit type and detail, else the error's last line (a
    call's exception)."""
    text = str(e)
    kind = re.search(r"Worker exit type: (\w+)", text)
    if kind:
        detail = re.search(r"Worker exit detail: (.*?\.)", text)
        return f"its process died ({kind.group(1)}{': ' + detail.group(1) if detail else ''})"
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else type(e).__name__
