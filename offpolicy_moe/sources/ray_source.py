"""``buffer.mode=async rollout.backend=ray``: the asynchronous pipeline with its rollout workers as Ray actors.

:class:`RayBatchSource` is :class:`~offpolicy_moe.sources.asynchronous.AsyncBatchSource` with another
transport; everything that decides what is trained is shared, unchanged: the :class:`Dispatcher` (iterations in
order, ``buffer.staleness`` with ``wait`` or ``drop``, re-issues with the iteration's seed), the
:class:`VersionRing` and the old-log-prob pass under the version that sampled each token, the checkpointed
in-flight state (``state_dict``: same format as the local pipeline, so a run may resume on the other backend) and
the metric names (``async/*``).  What differs:

* workers are ``rollout.workers`` :class:`~offpolicy_moe.rollout.ray_actor.RolloutActor` s, placed by Ray anywhere
  in the cluster of ``rollout.ray_address`` (else ``RAY_ADDRESS``, else ``ray.init()``'s default: a cluster on this
  machine), ``rollout.worker_threads`` CPUs each;
* weights: each published version is ``ray.put`` once into the object store; a
  :class:`~offpolicy_moe.rollout.ray_actor.WeightRegistry` actor, pinned to the trainer's node, holds the newest
  reference, and an actor pulls it (once per version it uses) when it starts an order (``async/weight_sync_s``:
  the trainer's put);
* an order is an actor call; the trainer waits on the calls' results (``ray.wait``, at most
  ``rollout.worker_timeout_s`` without news, then a :class:`PipelineTimeout` naming the iteration and the actor);
* an actor that dies (seen at once through its ``watch`` call, pending for the actor's life like a process
  sentinel, even when it has no order in flight; checked at every step), or whose call raises (:func:`actor_died`
  tells the two apart), is named with its node; under ``rollout.on_worker_death=restart`` a
  new actor takes its place and its iterations are issued again with their seeds (``stop``: :class:`WorkerDied`,
  the loop checkpoints and stops).  When the actor's NODE is gone, ``rollout.ray_on_node_loss`` decides:
  ``continue`` with the remaining actors, or ``stop``.

Nothing here imports Ray at module level (``importlib`` in the constructor): without ``rollout.backend=ray`` no Ray
module is loaded.
"""
from __future__ import annotations

import importlib
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.ray_actor import RolloutActor, WeightRegistry, encode_weights
from offpolicy_moe.rollout.seeds import iteration_seed
from offpolicy_moe.rollout.worker import BatchDone, Order, WorkerSpec
from offpolicy_moe.sources.asynchronous import AsyncBatchSource, PipelineTimeout, WorkerDied
from offpolicy_moe.sources.schedule import Assignment

__all__ = ["RayBatchSource", "actor_died", "connect", "ray_address"]
_MAX_RESTARTS = 3          # per worker slot; then the run stops with a checkpoint
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


@dataclass
class _Actor:
    index: int
    handle: Any
    info: dict
    restarts: int = 0


@dataclass
class _Call:
    worker: int
    iteration: int
    attempt: int


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


class RayBatchSource(AsyncBatchSource):
    """Rollout actors on a Ray cluster generating ahead of the trainer within ``buffer.staleness`` versions (see
    module docstring).  Connects to the cluster at construction (before any compute); the actors start on the
    first :meth:`next`, with the weights last published."""

    def __init__(self, cfg: Any, *, model: torch.nn.Module, prepare: Callable[[RolloutBatch], None],
                 rank: int = 0, world: int = 1):
        super().__init__(cfg, model=model, prepare=prepare, rank=rank, world=world)
        self.ray = connect(cfg)
        self.on_node_loss = cfg.rollout.ray_on_node_loss
        self._actors: dict[int, _Actor] = {}
        self._calls: dict[Any, _Call] = {}          # object ref of a generate call -> what it generates
        self._watch: dict[Any, _Actor] = {}         # object ref of an actor's watch call (fails when it dies)
        self._registry: Any = None

    # ------------------------------------------------------------------ actors
    def _start(self, step: int) -> None:
        """Start the registry and the actors with the newest published weights, then hand out the first orders."""
        if step != self.cursor:
            raise RuntimeError(f"async pipeline: trainer step {step} but the pipeline's next iteration is "
                               f"{self.cursor} (a checkpoint from another buffer mode?)")
        self._registry = self._place_registry()
        self._board = _ObjectStoreWeights(self.ray, self._registry)
        self._board.publish(self.ring[self.published], self.published)
        for i in range(self.n_workers):
            self._actors[i] = self._create(i)
        self._issue(self.published)

    def _place_registry(self) -> Any:
        """A :class:`WeightRegistry` actor pinned to the trainer's own node (hard node affinity; it needs no CPU,
        so it always fits there).  A soft affinity is not enough: a raylet without CPUs (a head node started with
        ``num_cpus=0``) spills even a zero-CPU actor to another node, and a registry on a rollout node dies with
        that node, failing every other actor's orders."""
        strategies = importlib.import_module("ray.util.scheduling_strategies")
        here = strategies.NodeAffinitySchedulingStrategy(node_id=self.ray.get_runtime_context().get_node_id(),
                                                         soft=False)
        return self.ray.remote(WeightRegistry).options(num_cpus=0, scheduling_strategy=here).remote()

    def registry_node(self) -> str:
        """Ray node id of the weight registry actor (the trainer's node)."""
        return self.ray.get(self._registry.node.remote(), timeout=self.timeout)

    def _create(self, index: int, restarts: int = 0) -> _Actor:
        """A new actor for worker slot ``index``, waited for (at most ``rollout.worker_timeout_s``)."""
        ro = self.cfg.rollout
        spec = WorkerSpec(cfg=self.cfg, index=index, rank=self.rank, world=self.world, parent_pid=os.getpid(),
                          threads=int(ro.worker_threads), weight_timeout_s=self.timeout,
                          update_in_flight=bool(ro.update_in_flight))
        handle = self.ray.remote(concurrency_groups={"watch": 1})(RolloutActor).options(
            num_cpus=int(ro.worker_threads), max_restarts=0, max_task_retries=0,
            name=f"offpolicy-moe-rollout-{os.getpid()}-{self.rank}-{index}-{restarts}").remote(spec, self._registry)
        try:
            info = self.ray.get(handle.ready.remote(), timeout=self.timeout)
        except self.ray.exceptions.GetTimeoutError:
            self.ray.kill(handle)
            raise PipelineTimeout(f"waited {self.timeout:.0f} s (rollout.worker_timeout_s) for Ray rollout actor "
                                  f"{index} to start (no node with {ro.worker_threads} free CPU(s)?)") from None
        except self.ray.exceptions.RayError as e:
            raise WorkerDied(f"Ray rollout actor {index} failed to start: {_cause(e)}") from None
        actor = _Actor(index=index, handle=handle, info=info, restarts=restarts)
        self._watch[handle.watch.options(concurrency_group="watch").remote()] = actor
        return actor

    def worker_pids(self) -> list[int]:
        """Process ids of the live actors (slot order)."""
        return [self._actors[i].info["pid"] for i in sorted(self._actors)]

    def actor_nodes(self) -> list[str]:
        """Ray node ids of the live actors (slot order)."""
        return [self._actors[i].info["node_id"] for i in sorted(self._actors)]

    def _send(self, a: Assignment) -> None:
        order = Order(iteration=a.iteration, seed=iteration_seed(self.cfg.seed, a.iteration, self.rank),
                      min_version=a.min_version, attempt=a.attempt)
        ref = self._actors[a.worker].handle.generate.remote(order, self._board.version, [self._board.ref])
        self._calls[ref] = _Call(a.worker, a.iteration, a.attempt)

    def _name(self, actor: _Actor) -> str:
        return f"Ray rollout actor {actor.index} (pid {actor.info['pid']} on {actor.info['ip']})"

    # ------------------------------------------------------------------ receiving
    def take(self, step: int) -> tuple[RolloutBatch, float]:
        """The prepared batch of iteration ``step`` and the seconds the trainer waited for it (not counting the
        time it spent preparing batches that arrived meanwhile)."""
        if step != self.cursor:
            raise RuntimeError(f"async pipeline: the trainer asks for iteration {step}, the next one is "
                               f"{self.cursor}")
        t0, prep0 = time.perf_counter(), self.timing["prepare_s"]
        last = t0
        self._receive(timeout=0)     # deaths and errors that came meanwhile, even when this batch is ready already
        while step not in self.ready:
            if self._receive(timeout=min(1.0, self.timeout)):
                last = time.perf_counter()
            elif time.perf_counter() - last > self.timeout:
                holder = next((a for a in self._actors.values() if step in self.dispatch.inflight.get(a.index, [])),
                              None)
                who = self._name(holder) if holder is not None else "no actor (the iteration was never issued)"
                raise PipelineTimeout(f"waited {self.timeout:.0f} s (rollout.worker_timeout_s) for the batch of "
                                      f"iteration {step} from {who}")
        waited = time.perf_counter() - t0 - (self.timing["prepare_s"] - prep0)
        self.timing["trainer_wait_s"] += waited
        self.dispatch.release(step)
        return self.ready.pop(step), waited

    def _receive(self, timeout: float) -> bool:
        """Handle the calls that finished within ``timeout`` seconds (batches, errors, deaths); True if any."""
        refs = list(self._calls) + list(self._watch)
        if not refs:
            time.sleep(min(timeout, 0.05))
            return False
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
                    self._on_actor_death(actor, cause, died=True, raw=raw)
                continue
            call = self._calls.pop(ref, None)
            if call is None or call.worker not in self._actors:
                continue                     # a call of an actor already replaced
            actor = self._actors[call.worker]
            try:
                iteration, attempt, state, timings = self.ray.get(ref, timeout=self.timeout)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.RayTaskError) as e:
                died = actor_died(self.ray, e)
                self._on_actor_death(actor, _cause(e), died=died, raw=str(e) if died else "")
                continue
            self._handle(actor, BatchDone(actor.index, iteration, attempt, state, timings))
        return bool(done)

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

    def _on_actor_death(self, actor: _Actor, reason: str, *, died: bool, raw: str = "") -> None:
        """Actor ``actor`` died (``died``) or a call of it raised: name it, then restart it, go on without it, or
        stop, as configured; its iterations in flight are issued again (same seeds)."""
        node_lost = died and ("node has died" in raw or self._node_dies(actor.info["node_id"]))
        lost = self.dispatch.worker_lost(actor.index)
        self._calls = {r: c for r, c in self._calls.items() if c.worker != actor.index}
        self._watch = {r: a for r, a in self._watch.items() if a is not actor}
        doing = f" while generating iteration(s) {lost}" if lost else ""
        what = f"its node {actor.info['node_id'][:12]} ({actor.info['ip']}) left the cluster" if node_lost else reason
        msg = f"{self._name(actor)} died{doing}: {what}"
        del self._actors[actor.index]
        self.ray.kill(actor.handle, no_restart=True)
        if node_lost:
            if self.on_node_loss == "stop" or not self._actors:
                why = "rollout.ray_on_node_loss=stop" if self.on_node_loss == "stop" else "no rollout actor left"
                raise WorkerDied(f"{msg}; stopping ({why})")
            del self.dispatch.inflight[actor.index]         # the dispatcher hands out to the remaining actors
            print(f"offpolicy-moe: {msg}; going on with {len(self._actors)} rollout actor(s) "
                  "(rollout.ray_on_node_loss=continue)", file=sys.stderr)
        else:
            if self.on_death == "stop" or actor.restarts >= _MAX_RESTARTS:
                why = "rollout.on_worker_death=stop" if self.on_death == "stop" else f"{_MAX_RESTARTS} restarts"
                raise WorkerDied(f"{msg}; stopping ({why})")
            print(f"offpolicy-moe: {msg}; restarting it (rollout.on_worker_death=restart)", file=sys.stderr)
            self.restarts += 1
            self._actors[actor.index] = self._create(actor.index, restarts=actor.restarts + 1)
        self._issue(self.published)

    # ------------------------------------------------------------------ shutdown
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
