"""Continuous batching on vLLM (``buffer.mode=stream`` with ``rollout.engine=vllm``): vLLM's own scheduler fills
the slots, and newer weights go in between two engine steps.

:class:`VLLMStreamSampler` has the interface of :class:`~offpolicy_moe.rollout.slots.SlotSampler` (``submit``,
``step``, ``queued``, ``active``), so the streaming worker drives either.  Each submitted sample is one vLLM request
with its own seed and ``RequestOutputKind.DELTA`` outputs; vLLM admits waiting requests into free sequence slots
(``max_num_seqs`` = ``rollout.stream_slots``) at every step, so a finished row's slot is taken at the next step.

Each :meth:`VLLMStreamSampler.step` first runs ``engine.between_tokens`` (the worker's weight load: vLLM's in-place
reload through ``collective_rpc``), then ONE ``LLMEngine.step``.  The engine is started for this
(:class:`~offpolicy_moe.rollout.vllm_engine.VLLMRolloutEngine` with ``stream=True``): its core runs in this
process and asynchronous scheduling is off, so a step schedules, runs one forward and samples from it before it
returns.  Every token a step returns was therefore scored by the weights loaded before the step, and it carries
that version.  ``behav_logp`` is vLLM's processed log-prob of the sampled token (after temperature), the
distribution it was drawn from.  Routes are vLLM's own ``routed_experts`` where this build returns them, else the
recorder's in vLLM's worker (:mod:`~offpolicy_moe.rollout.vllm_worker`), taken after every step; a route is
recorded by the forward that fed the token, so it is the route of the weights of that step.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from offpolicy_moe.rollout import vllm_worker
from offpolicy_moe.rollout.slots import FinishedSample, StreamSample, checked_sample
from offpolicy_moe.routing.engines import vllm_routes
from offpolicy_moe.run.nonfinite import NonFiniteError

__all__ = ["VLLMStreamSampler"]


@dataclass
class _Request:
    """One sample in flight: what it has drawn so far, with each token's version and its routes' chunks."""

    sample: StreamSample
    internal_id: str
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)     # recorder: positions fed ...
    ids: list[np.ndarray] = field(default_factory=list)           # ... and their experts [n, L_moe, K]


class VLLMStreamSampler:
    """Continuous batching on a stepped vLLM engine (see the module docstring)."""

    def __init__(self, engine: Any):
        """A sampler on ``engine``, a :class:`~offpolicy_moe.rollout.vllm_engine.VLLMRolloutEngine` started with
        ``stream=True``; ``ValueError`` in one line for any other."""
        opts = getattr(engine, "opts", None)
        if opts is None or not getattr(opts, "stream", False) or not opts.in_process:
            raise ValueError("VLLMStreamSampler needs a VLLMRolloutEngine started with stream=True (its core in "
                             "this process, no asynchronous scheduling)")
        self.engine = engine
        self._requests: dict[str, _Request] = {}
        self._next = 0
        self._submitted: collections.deque[StreamSample] = collections.deque()

    # ------------------------------------------------------------------ queue
    def submit(self, samples: Iterable[StreamSample]) -> None:
        """Queue ``samples``; they become vLLM requests at the next :meth:`step`, after its weight load."""
        for s in samples:
            n = int(checked_sample(s).prompt_ids.numel())
            if n + self.engine.max_new_tokens > self.engine.opts.max_model_len:
                raise ValueError(f"rollout.vllm_max_model_len={self.engine.opts.max_model_len}: a prompt of {n} "
                                 f"tokens + rollout.max_new_tokens={self.engine.max_new_tokens} does not fit; raise "
                                 "rollout.vllm_max_model_len")
            self._submitted.append(s)

    @property
    def queued(self) -> int:
        """Samples submitted and not yet given to vLLM."""
        return len(self._submitted)

    @property
    def active(self) -> int:
        """Requests vLLM holds (running or waiting for a slot)."""
        return len(self._requests)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[FinishedSample]:
        """Run ``engine.between_tokens`` (the weight load), hand queued samples to vLLM, run one engine step;
        return the samples that finished (EOS or ``max_new_tokens``).  ``NonFiniteError`` (stage ``generation``)
        when a sampled token's log-prob is not finite."""
        eng = self.engine
        if eng.between_tokens is not None:
            eng.between_tokens(eng)
        self._add_submitted()
        if not self._requests:
            return []
        llm_engine = eng.llm.llm_engine
        version = int(eng.version)
        outputs = llm_engine.step()
        if eng.routes_from == "hooks":
            self._take_routes()
        finished = []
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:
                continue
            comp = out.outputs[0]
            new = list(comp.token_ids)
            lps = [d[t].logprob if t in d else next(iter(d.values())).logprob
                   for d, t in zip(comp.logprobs or [], new)]
            if len(lps) != len(new) or not all(math.isfinite(x) for x in lps):
                raise NonFiniteError("generation", f"behaviour log-probs of the sampled tokens (request "
                                                   f"{req.sample.key})")
            req.tokens.extend(int(t) for t in new)
            req.logps.extend(float(x) for x in lps)
            req.versions.extend([version] * len(new))
            if out.finished:
                del self._requests[out.request_id]
                finished.append(self._finish(req, comp))
        return finished

    def _add_submitted(self) -> None:
        from vllm.inputs import TokensPrompt

        eng = self.engine
        while self._submitted:
            s = self._submitted.popleft()
            rid = f"stream-{self._next}"
            self._next += 1
            internal = eng.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=[int(t) for t in
                                                                                          s.prompt_ids.tolist()]),
                                                      eng.sampling_params(s.seed, delta=True))
            self._requests[rid] = _Request(s, str(internal))

    def _take_routes(self) -> None:
        """The recorder's routes of this step, appended to their requests."""
        raw = self.engine.llm.collective_rpc(vllm_worker.take_routes)[0]
        by_internal = {r.internal_id: r for r in self._requests.values()}
        for rid, (pos, ids) in vllm_worker.decode_routes(raw).items():
            req = by_internal.get(rid) or self._requests.get(rid)
            if req is not None:
                req.positions.append(pos)
                req.ids.append(ids)

    def _finish(self, req: _Request, comp: Any) -> FinishedSample:
        """The finished request as plain CPU tensors (routes ``[p + n, L_moe, K]``, -1 where not recorded)."""
        eng = self.engine
        p, n = int(req.sample.prompt_ids.numel()), len(req.tokens)
        routes = None
        if eng.routes_from == "native":
            routes = vllm_routes(p, n, comp.routed_experts, layer_ids=tuple(eng.layer_ids),
                                 num_hidden_layers=eng._num_hidden_layers)
        elif eng.routes_from == "hooks":
            arr = np.full((max(p + n - 1, 0), len(eng.layer_ids), eng.top_k_experts), -1, dtype=np.int16)
            for pos, ids in zip(req.positions, req.ids):
                keep = pos < p + n - 1
                arr[pos[keep]] = ids[keep]
            routes = vllm_routes(p, n, arr, layer_ids=tuple(eng.layer_ids))
        return FinishedSample(key=req.sample.key, prompt_ids=req.sample.prompt_ids,
                              response_ids=torch.tensor(req.tokens, dtype=torch.long),
                              behav_logp=torch.tensor(req.logps, dtype=torch.float32),
                              versions=torch.tensor(req.versions, dtype=torch.long),
                              routes=None if routes is None else routes.long())

    def abort(self) -> None:
        """Drop every request (vLLM's and the queue): after a failure, the worker reports their groups lost."""
        if self._requests:
            self.engine.llm.llm_engine.abort_request([r.internal_id for r in self._requests.values()],
                                                     internal=True)
        self._requests.clear()
        self._submitted.clear()
