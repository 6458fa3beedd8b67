"""The routed forward: response log-probs of a batch under a model, replaying or recording its MoE routes.

One object, :class:`RoutedForward`, owns every forward the trainer makes for log-probs (old-logp pass, update,
reference model, M2PO pre-pass), so route replay (R3 / R2 / PR2), route recording and prompt sharing are decided in
one place.  :func:`eval_mode` is the single eval-mode toggle (restored in ``finally``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.rollout.engine import REPLAY_ENGINE
from offpolicy_moe.logprobs.length_buckets import row_widths
from offpolicy_moe.logprobs.micro_batch import MicroBatching
from offpolicy_moe.models.forward_plan import MODES as FORWARD_MODES
from offpolicy_moe.models.forward_plan import ForwardPlan
from offpolicy_moe.models.response_logprobs import plan_shared_forward, response_logprobs
from offpolicy_moe.routing import RoutingController, cat_traces

__all__ = ["RoutedForward", "eval_mode", "trimmed_width"]


def trimmed_width(attention_mask: torch.Tensor, prompt_len: int) -> int:
    """The columns a forward over these rows needs: the widest row's last real position + 1, at least one response
    column (``prompt_len + 1``).  Columns after it are padding in every row."""
    return max(int(row_widths(attention_mask).max()), int(prompt_len) + 1)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model.eval()`` for the block, then the previous training flag again (also when the block raises)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


class RoutedForward:
    """Log-probs of :class:`RolloutBatch` responses with the configured routing.

    ``controller`` hooks the actor (``None`` for a dense model or when routing is off); each copy of the actor
    (the reference, past versions' weights) gets its own, so it replays the same routes.  ``group_size`` is the
    width of a packed row, so a forward on part of a group (a micro-batch) packs rows as wide as the whole group's
    and gives bit for bit the same log-probs; :meth:`logp_pieces` runs a no-grad pass on the update's pieces.
    """

    def __init__(self, *, device: torch.device, controller: Optional[RoutingController], replay: str,
                 share_prompt: bool, temperature: float, group_size: Optional[int] = None,
                 micro_batching: MicroBatching = MicroBatching()):
        self.device = device
        self.micro_batching = micro_batching
        self.controller = controller
        self.replay = replay
        self.share_prompt = bool(share_prompt)
        self.group_size = group_size
        self.temperature = float(temperature)
        self.ref_model: Optional[torch.nn.Module] = None
        self.ref_controller: Optional[RoutingController] = None
        self._copies: dict[int, tuple[torch.nn.Module, Optional[RoutingController]]] = {}
        self.last_plan = ForwardPlan("plain")   # the way the last forward ran (perf/forward_* metrics)

    def set_reference(self, ref_model: Optional[torch.nn.Module]) -> None:
        """Register the frozen reference model (KL penalty); it gets its own routing controller when the actor has
        one, so under R3/R2 its log-probs replay the actor's routes."""
        self.ref_model = ref_model
        self.ref_controller = None
        if ref_model is not None and self.controller is not None:
            self.ref_controller = RoutingController(ref_model)

    def attach(self, model: torch.nn.Module) -> Optional[RoutingController]:
        """Give ``model`` (a copy of the actor: the reference, past versions' weights) its own routing controller
        when the actor has one, so its forwards replay and record routes like the actor's."""
        controller = RoutingController(model) if self.controller is not None else None
        self._copies[id(model)] = (model, controller)
        return controller

    def controller_for(self, model: torch.nn.Module) -> Optional[RoutingController]:
        """The routing controller hooking ``model`` (each attached copy has its own)."""
        if self.ref_model is not None and model is self.ref_model:
            return self.ref_controller
        copy = self._copies.get(id(model))
        if copy is not None and copy[0] is model:
            return copy[1]
        return self.controller

    def routes_for_update(self, batch: RolloutBatch) -> Any:
        """The routes every update forward replays: the engine's (R3/PR2), the trainer's own recorded ones (R2) or
        none."""
        if self.replay in REPLAY_ENGINE:
            return batch.routes
        if self.replay == "r2":
            return batch.trainer_routes
        return None

    def logp(self, model: torch.nn.Module, batch: RolloutBatch, routes: Any = None, record: bool | str = False):
        """Response log-probs of ``batch`` under ``model``, replaying ``routes`` when given; with ``record`` also
        the routes the forward used (``record=True`` or ``"used"``) or the router's own top-k under the replay
        (``record="own"``): ``(logp, RouteTrace [B, S])``.

        With ``share_prompt`` each group's prompt is run once (:mod:`offpolicy_moe.models.prompt_packing`, or a shared KV
        cache).  Replayed traces are re-laid out like the packed batch and recorded ones back like the plain batch;
        router-logit capture (PR2) needs the plain ``[B, S]`` forward, so nothing is shared while a routing context
        opened by the caller is active.

        When the engine truncated its sampling distribution (top-k / top-p) the batch's kept sets
        (``batch.kept_tokens``) are replayed like its routes: every log-prob is over the engine's kept ids,
        renormalised (:func:`~offpolicy_moe.models.response_logprobs.response_logprobs`).

        Columns that are padding in every row of ``batch`` are left out of the forward (:func:`trimmed_width`): their
        log-probs are 0 anyway.  Not while recording (the trace holds the padding's routes too) nor while a
        caller's routing context is open (its capture needs the ``[B, S]`` layout)."""
        dev = self.device
        ids, am = batch.input_ids.to(dev), batch.attention_mask.to(dev)
        if routes is not None and hasattr(routes, "to"):
            routes = routes.to(dev)
        ctl = self.controller_for(model)
        if record and ctl is None:
            raise RuntimeError("route recording needs a RoutingController (an MoE model with routing enabled)")
        caller_ctx = ctl is not None and ctl.active
        S, P = int(ids.shape[1]), int(batch.prompt_len)
        resp, kept = batch.response_mask.to(dev), batch.kept_tokens
        # a caller's capture needs the [B, S] layout, and a recorded trace holds the padding's routes too
        width = S if (caller_ctx or record) else trimmed_width(am, P)
        if width < S:      # columns that are padding in every row: left out, their log-probs are 0 anyway
            ids, am, resp = ids[:, :width], am[:, :width], resp[:, :width - P]
            kept = kept.narrow(0, width - P) if kept is not None else None
            routes = routes.slice(0, width) if routes is not None else None
        share = self.share_prompt and not caller_ctx
        replaying = routes is not None or record
        plan, packing = ForwardPlan("plain"), None
        if share:   # replayed / recorded traces: packing only (they are re-laid out; no routes flow in the cache way)
            plan, packing = plan_shared_forward(model, ids, am, batch.prompt_len, True, group_size=self.group_size,
                                                allowed=("plain", "pack") if replaying else FORWARD_MODES)
            if packing is not None and routes is not None:
                packed_routes = packing.pack_trace(routes)
                if packed_routes is None:
                    packing, plan = None, ForwardPlan("plain", plan.costs)
                else:
                    routes = packed_routes
        self.last_plan = plan
        replay_ctx = ctl.replay(routes) if (routes is not None and ctl is not None) else contextlib.nullcontext()
        rec_ctx = ctl.record("used" if record is True else record) if record else contextlib.nullcontext()
        kept = kept.to(dev) if kept is not None else None
        with replay_ctx, rec_ctx as rec:
            logp = response_logprobs(model, ids, am, P, temperature=self.temperature, response_mask=resp,
                                     share_prompt="cache" if plan.mode == "cache" else False, packing=packing,
                                     kept=kept)
        if width < S:
            logp = torch.nn.functional.pad(logp, (0, S - width))
        if not record:
            return logp
        trace = rec.trace()
        return logp, (packing.unpack_trace(trace) if packing is not None else trace)

    def logp_pieces(self, model: torch.nn.Module, batch: RolloutBatch, routes: Any = None,
                    record: bool | str = False):
        """:meth:`logp` of the whole ``batch``, run on the update's micro-batches (``micro_batching.pieces``) and
        concatenated back in the batch's row order: no forward holds more than ``trainer.micro_batch_tokens`` padded positions (the
        logits of a real vocabulary over a whole batch would not fit), and on-policy each piece's log-probs are
        those of the update forward on the same rows bit for bit.  For passes without gradient (old-logp,
        reference, proximal, the R3 counterfactual).  Length buckets hold rows out of order; they come back in order."""
        pieces = self.micro_batching.batch_pieces(batch.attention_mask)
        if len(pieces) <= 1:
            return self.logp(model, batch, routes, record)
        outs = [self.logp(model, batch.index_select(rows),
                          routes.index_select(rows) if routes is not None else None, record) for rows in pieces]
        order = torch.argsort(torch.cat(pieces))         # length buckets hold rows out of order: put them back
        if not record:
            return torch.cat(outs, 0).index_select(0, order.to(outs[0].device))
        trace = cat_traces([o[1] for o in outs], side="right")
        return (torch.cat([o[0] for o in outs], 0).index_select(0, order.to(outs[0][0].device)),
                trace.index_select(order))
