"""``OffPolicyGRPOTrainer``: TRL's ``GRPOTrainer`` with this library's losses, correction weights and R3.

It overrides four methods of ``GRPOTrainer`` (TRL 1.16), each around TRL's own code (``super()``): generation
records the routes and keeps the behaviour log-probs; every policy and reference forward replays the routes under
``routing_replay="r3"``; the batch gains the routes, behaviour log-probs and correction weights; and the loss is the
registered one, called as the project's trainer calls it (global counts, a mini-batch-wide selection pass where the
loss declares one, TRL's advantages and ``beta`` k3 KL).  docs/trl.md describes each.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch
from torch import nn
from trl import GRPOTrainer

from offpolicy_moe.losses import (aggregate, correction_weights, get_loss_spec, global_counts, kl_penalty,
                                  metrics_to_floats, mismatch_metrics)
from offpolicy_moe.routing import RouteTrace, RoutingController, router_perturbation

from .config import OffPolicyGRPOConfig
from .generation import GenerationRecord, capture_generate

__all__ = ["OffPolicyGRPOTrainer", "ReplayCheckpointContext"]

_OVERRIDDEN = ("_generate_single_turn", "_get_per_token_logps_and_entropies", "_generate_and_score_completions",
               "_compute_loss")
for _name in _OVERRIDDEN:
    if not callable(getattr(GRPOTrainer, _name, None)):
        raise ImportError(f"trl.GRPOTrainer has no method {_name}: this TRL is not supported by "
                          "offpolicy_moe.integrations.trl (see docs/trl.md)")


class ReplayCheckpointContext(str):
    """``context_fn`` of ``torch.utils.checkpoint`` for TRL's activation checkpointing under replay
    (:meth:`RoutingController.checkpoint_context_fn`).

    It sits in ``args.activation_checkpointing_kwargs``, so it must survive what is done to training args: a ``str``
    (its name) for ``args.to_json_string()``; a deep copy shares the controller; a pickle keeps only the name, and
    calling the unpickled one says to rebuild the trainer."""

    def __new__(cls, controller: Optional[RoutingController] = None):
        obj = super().__new__(cls, "offpolicy_moe.ReplayCheckpointContext")
        obj.controller = controller
        return obj

    def __call__(self):
        if self.controller is None:
            raise RuntimeError("these training args were unpickled: build OffPolicyGRPOTrainer again to checkpoint "
                               "activations under routing replay")
        return self.controller.checkpoint_context_fn()

    def __reduce__(self):
        return (ReplayCheckpointContext, ())

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


class OffPolicyGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer(model, reward_funcs, args=OffPolicyGRPOConfig(...), ...)`` with this library's loss and R3.
    On an MoE model the routes of ``model.generate`` are always recorded; ``routing_replay="r3"`` replays them."""

    def __init__(self, *args, **kwargs):
        cfg = kwargs.get("args", args[2] if len(args) > 2 else None)
        if not isinstance(cfg, OffPolicyGRPOConfig):
            raise TypeError("OffPolicyGRPOTrainer needs args=OffPolicyGRPOConfig(...), got "
                            f"{type(cfg).__name__}")
        super().__init__(*args, **kwargs)
        cfg.check_plugin_keys()
        self.loss_spec = get_loss_spec(cfg.policy_loss)
        self.loss_options = dict(cfg.policy_loss_options or {})
        self.global_pass = self.loss_spec.wants_global_pass(self.loss_options)
        self.world = self.accelerator.num_processes
        if self.loss_spec.distributed and self.world > 1:
            self.loss_options["process_group"] = torch.distributed.group.WORLD
        self.norm_length = cfg.loss_norm_length or self.max_completion_length
        self._controllers: dict[int, Optional[RoutingController]] = {}
        self._refusals: dict[int, str] = {}
        policy = self.accelerator.unwrap_model(self.model)
        self.controller = self._controller(policy)
        if cfg.routing_replay == "r3" and self.controller is None:
            raise ValueError(f"routing_replay='r3' needs an MoE model the routing layer supports: "
                             f"{self._refusals[id(policy)]}")
        if cfg.routing_replay == "r3" and (self.tools or self.rollout_func is not None):
            raise ValueError("routing_replay='r3' records one model.generate per batch; tools and rollout_func "
                             "generate elsewhere or in several turns")
        if self.controller is not None and cfg.activation_checkpointing:
            ckpt = dict(cfg.activation_checkpointing_kwargs or {})
            if ckpt.get("use_reentrant"):
                raise ValueError("activation checkpointing with use_reentrant=True cannot replay routes in its "
                                 "recompute: leave use_reentrant unset or False")
            ckpt.update(use_reentrant=False, context_fn=ReplayCheckpointContext(self.controller))
            cfg.activation_checkpointing_kwargs = cfg.gradient_checkpointing_kwargs = ckpt
        self.perturbation = None
        if cfg.router_perturb > 0:
            if self.controller is None:
                raise ValueError(f"router_perturb needs an MoE model the routing layer supports: "
                                 f"{self._refusals[id(policy)]}")
            c = self.controller
            self.perturbation = router_perturbation(c.hidden_size, c.num_experts, c.num_moe_layers,
                                                    cfg.router_perturb, cfg.seed,
                                                    device=next(policy.parameters()).device)
        self._generation: Optional[GenerationRecord] = None
        self._replaying: Optional[RouteTrace] = None
        self._window: Optional[dict] = None

    # ------------------------------------------------------------------ routing helpers
    def _controller(self, model: nn.Module) -> Optional[RoutingController]:
        """The routing controller of ``model`` (unwrapped), built once; None for a model without MoE routers."""
        bare = self.accelerator.unwrap_model(model)
        key = id(bare)
        if key not in self._controllers:
            try:
                self._controllers[key] = RoutingController(bare)
            except ValueError as err:       # a dense model, or a router the routing layer refuses (named)
                self._controllers[key] = None
                self._refusals[key] = str(err)
        return self._controllers[key]

    @property
    def replays(self) -> bool:
        """Whether the recorded routes are replayed (``routing_replay="r3"``)."""
        return self.args.routing_replay == "r3"

    @contextlib.contextmanager
    def replaying(self, trace: Optional[RouteTrace]) -> Iterator[None]:
        """Forwards through :meth:`_get_per_token_logps_and_entropies` inside the block replay ``trace``
        (laid out like their ``input_ids``); None: the router's own choice."""
        prev, self._replaying = self._replaying, trace
        try:
            yield
        finally:
            self._replaying = prev

    def _trace_for_call(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        logits_to_keep: int) -> Optional[RouteTrace]:
        if self._replaying is not None:
            return self._replaying
        if self.replays and self._generation is not None and self._generation.trace is not None:
            # TRL's own old-log-prob / reference pass inside _generate_and_score_completions
            return self._generation.trace_for(input_ids, attention_mask, logits_to_keep)
        return None

    # ------------------------------------------------------------------ TRL overrides
    def _generate_single_turn(self, *args, **kwargs):
        """TRL's generation, with the routes recorded and the behaviour log-probs kept (transformers path)."""
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        sink: list = []
        rec = None
        with contextlib.ExitStack() as stack:
            if self.controller is not None:
                rec = stack.enter_context(self.controller.record())
                if self.perturbation is not None:
                    stack.enter_context(self.controller.offsets(self.perturbation, in_weights=True))
            stack.enter_context(capture_generate(model, sink))
            out = super()._generate_single_turn(*args, **kwargs)
        if len(sink) != 1:
            raise RuntimeError(f"expected one model.generate call per generation batch, saw {len(sink)}")
        seq, width, behav = sink[0]
        trace = rec.trace() if rec is not None else None
        self._generation = GenerationRecord(seq, width, behav, trace)
        return out

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                           batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                           **kwargs):
        """TRL's log-prob forward, chunk by chunk under :meth:`RoutingController.replay` of the routes of the
        rows when replaying (text models only); TRL's forward unchanged otherwise."""
        trace = self._trace_for_call(input_ids, attention_mask, logits_to_keep)
        ctl = self._controller(model) if trace is not None else None
        if ctl is None:
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **kwargs)
        extra = sorted(k for k, v in kwargs.items() if v is not None)
        if extra:
            raise ValueError(f"routing replay covers text inputs only; this batch also has {', '.join(extra)}")
        n = input_ids.shape[0]
        step = batch_size or n
        logps, ents, auxes = [], [], []
        for start in range(0, n, step):
            rows = torch.arange(start, min(start + step, n), device=trace.ids.device)
            with ctl.replay(trace.index_select(rows)):
                lp, ent, aux = super()._get_per_token_logps_and_entropies(
                    model, input_ids[start:start + step], attention_mask[start:start + step], logits_to_keep,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss)
            logps.append(lp)
            ents.append(ent)
            auxes.append(aux)
        entropy = torch.cat(ents) if compute_entropy else None
        aux_loss = torch.stack(auxes).mean() if compute_aux_loss else None
        return torch.cat(logps), entropy, aux_loss

    def _generate_and_score_completions(self, inputs):
        """TRL's batch, plus ``route_ids``, ``sampling_per_token_logps``, ``old_per_token_logps`` and
        ``correction_weights`` as needed, and the ``mismatch/*`` metrics."""
        self._generation = None
        try:
            out = super()._generate_and_score_completions(inputs)
            gen = self._generation
        finally:
            self._generation = None
        mode = "train" if self.model.training else "eval"
        cfg = self.args
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        att = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        width = out["completion_ids"].shape[1]
        mask = self._loss_mask(out)
        trace = None
        if gen is not None:
            if gen.trace is not None:
                trace = gen.trace_for(ids, att, width)
                out["route_ids"] = trace.ids
            if out.get("sampling_per_token_logps") is None:
                out["sampling_per_token_logps"] = gen.behav_for(out["completion_mask"])
        behav = out.get("sampling_per_token_logps")
        if behav is not None:
            mask = mask.bool() & torch.isfinite(behav)
            behav = torch.nan_to_num(behav, nan=0.0)
        needs_old = behav is not None and (cfg.correction_mode != "none" or cfg.mismatch_metrics)
        if needs_old and out.get("old_per_token_logps") is None:
            out["old_per_token_logps"] = self._logp_pass(ids, att, width, trace if self.replays else None, mode)
        metrics: dict[str, Any] = {}
        if cfg.correction_mode != "none":
            if behav is None:
                raise RuntimeError("correction_mode needs generation-time log-probs and this batch has none")
            w, wm = correction_weights(out["old_per_token_logps"], behav, mask, level=cfg.correction_level,
                                       mode=cfg.correction_mode, high=cfg.correction_high, low=cfg.correction_low,
                                       advantages=out["advantages"], opsm_delta=cfg.correction_opsm_delta)
            out["correction_weights"] = w
            metrics.update(wm)
        if cfg.mismatch_metrics and behav is not None:
            old = out["old_per_token_logps"]
            metrics.update(mismatch_metrics(old, behav, mask))
            if trace is not None:
                other = self._logp_pass(ids, att, width, None if self.replays else trace, mode)
                with_r3, without = (old, other) if self.replays else (other, old)
                for name, lp in (("r3", with_r3), ("no_r3", without)):
                    mm = mismatch_metrics(lp, behav, mask)
                    metrics[f"mismatch/k3_kl_{name}"] = mm["mismatch/k3_kl"]
                    metrics[f"mismatch/extreme_frac_{name}"] = mm["mismatch/extreme_frac"]
        self._log_metrics(mode, metrics)
        return out

    @torch.no_grad()
    def _logp_pass(self, ids: torch.Tensor, att: torch.Tensor, width: int, trace: Optional[RouteTrace],
                   mode: str) -> torch.Tensor:
        """Log-probs of the current policy on the whole generation batch (no gradient), replaying ``trace``."""
        bs = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with self.replaying(trace):
            lp, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, att, width, batch_size=bs)
        return lp

    @staticmethod
    def _loss_mask(inputs: dict) -> torch.Tensor:
        mask = inputs["completion_mask"]
        return mask if inputs.get("tool_mask") is None else mask * inputs["tool_mask"]

    def _routes(self, inputs: dict) -> Optional[RouteTrace]:
        """The replayed routes of a TRL micro-batch (None without replay)."""
        if not self.replays or inputs.get("route_ids") is None:
            return None
        c = self.controller
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        return RouteTrace(inputs["route_ids"], c.num_experts, c.top_k, c.layer_ids).with_tokens(
            torch.where(torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1).bool(), ids, -1))

    def _log_metrics(self, mode: str, metrics: dict) -> None:
        for k, v in metrics_to_floats(metrics).items():
            if math.isfinite(v):
                self._metrics[mode][k].append(v)

    # ------------------------------------------------------------------ the loss
    def _counts(self, parts: list[dict], pg) -> tuple[torch.Tensor, torch.Tensor]:
        """``(num_tokens, num_seqs)`` over ``parts`` and the processes; ``num_seqs`` counts every row with
        ``count_masked_rows`` (TRL's row means), else the rows with a valid token."""
        masks = [self._loss_mask(p) for p in parts]
        n_tok, n_seq = global_counts(masks, pg)
        if self.args.count_masked_rows:
            n_seq = global_counts([torch.ones_like(m[:, :1]) for m in masks], pg)[1]
        return n_tok, n_seq

    def _window_of(self, inputs: dict, mode: str) -> tuple[Any, Any, dict]:
        """``(num_tokens, num_seqs, selection kwargs)`` of this micro-batch: counts over the optimizer step's
        micro-batches (all processes), and the loss's mini-batch-wide selection (M2PO's global mask) when it has
        one and the step has several micro-batches or processes."""
        pg = torch.distributed.group.WORLD if self.world > 1 else None
        if mode != "train":
            n_tok, n_seq = self._counts([inputs], pg)
            return n_tok, n_seq, {}
        ga = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        spg = self.args.steps_per_generation
        j = self._step % ga
        start = self._step - j
        if self._window is None or self._window["start"] != start:
            parts = [self._buffered_inputs[(start + i) % spg] for i in range(ga)]
            n_tok, n_seq = self._counts(parts, pg)
            sel = [{} for _ in parts]
            if self.global_pass and (ga > 1 or self.world > 1):
                sel = self._global_selection(parts)
            self._window = {"start": start, "parts": parts, "counts": (n_tok, n_seq), "sel": sel}
        win = self._window
        if win["parts"][j] is not inputs:
            raise RuntimeError("the micro-batch TRL passed to compute_loss is not the buffered one of this step: "
                               "unsupported TRL batching")
        return win["counts"][0], win["counts"][1], win["sel"][j]

    @torch.no_grad()
    def _global_selection(self, parts: list[dict]) -> list[dict]:
        """One no-grad pass over the optimizer step's micro-batches: log-ratios under the current weights (replaying
        the routes), then the loss's selection over all of them (and all processes)."""
        lrs, advs, masks = [], [], []
        for p in parts:
            ids = torch.cat([p["prompt_ids"], p["completion_ids"]], 1)
            att = torch.cat([p["prompt_mask"], p["completion_mask"]], 1)
            with self.replaying(self._routes(p)):
                lp, _, _ = self._get_per_token_logps_and_entropies(self.model, ids, att, p["completion_ids"].shape[1])
            old = p.get("old_per_token_logps")
            lrs.append(lp - (lp if old is None else old))
            advs.append(p["advantages"])
            masks.append(self._loss_mask(p))
        opts = {k: v for k, v in self.loss_options.items() if k != "process_group"}
        pg = torch.distributed.group.WORLD if self.world > 1 else None
        return self.loss_spec.run_global_pass(lrs, advs, masks, opts, pg)

    def _compute_loss(self, model, inputs):
        """The registered loss on this micro-batch, as the project's trainer calls it (see the module docstring);
        returns the micro-batch's share of the optimizer step's loss (times the number of processes, which DDP
        averages)."""
        mode = "train" if self.model.training else "eval"
        cfg = self.args
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        width = inputs["completion_ids"].shape[1]
        mask = self._loss_mask(inputs)
        with self.replaying(self._routes(inputs)):
            logp, entropy, aux = self._get_per_token_logps_and_entropies(
                model, ids, att, width, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled)
        old = inputs.get("old_per_token_logps")
        old = logp.detach() if old is None else old
        n_tok, n_seq, sel = self._window_of(inputs, mode)
        kw = dict(agg=cfg.loss_agg, num_tokens=n_tok, num_seqs=n_seq, norm_length=self.norm_length,
                  weights=inputs.get("correction_weights"), **self.loss_options, **sel)
        loss, lm = self.loss_spec.fn(logp, old, inputs["advantages"], mask, **kw)
        metrics = dict(lm)
        if self.beta != 0.0:
            kl_tok = kl_penalty(logp, inputs["ref_per_token_logps"], "k3", mask=mask)
            kl = aggregate(kl_tok, mask, cfg.loss_agg or "token-mean", num_tokens=n_tok, num_seqs=n_seq,
                           norm_length=self.norm_length)
            loss = loss + self.beta * kl
            metrics["actor/kl_ref"] = kl.detach()
        if aux is not None:
            ga = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
            ga = ga if mode == "train" else 1
            loss = loss + self.router_aux_loss_coef * aux / ga
            metrics["aux_loss"] = aux.detach()
        m = mask.bool()
        metrics["entropy"] = (entropy.detach() * m).sum() / m.sum().clamp(min=1)
        metrics["actor/loss"] = loss.detach()
        self._log_metrics(mode, metrics)
        return loss * self.world
