"""Rollout engines: the policy copy that samples responses (behaviour policy μ).

:class:`RolloutEngine` is the interface; the built-in :class:`HFRolloutEngine` holds its OWN copy of the policy in
its own precision (bf16 by default, the realistic source of train/inference mismatch; optional router-logit noise
and a fixed router-weight perturbation), at an integer version, and samples ``G`` responses per prompt with its own
KV-cache loop (``sampler="native"``) or ``model.generate`` (``sampler="hf"``); both apply temperature, top-k, top-p
in ``generate``'s order and draw the same ``torch.multinomial`` samples from the same scores.

Behaviour log-probs are EXACT: ``behav_logp[t] = log_softmax(scores_t)[x_t]`` on the very tensor that was sampled
from (float32), and when it truncates, its finite entries are the token's kept set (``RolloutBatch.kept_tokens``).
Only one step's ``[B, V]`` scores are held at a time with a real vocabulary (:data:`SCORES_HELD_ELEMENTS`).
"""
from __future__ import annotations

import abc
import copy
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch
import transformers
from transformers import (LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from offpolicy_moe.rollout.batch import RolloutBatch
from offpolicy_moe.run.nonfinite import NonFiniteError
from offpolicy_moe.rollout.decode_step import DecodeForward
from offpolicy_moe.rollout.decode_attention import use_single_query_decode
from offpolicy_moe.rollout.kv_cache import preallocated_cache
from offpolicy_moe.models.layout import CACHE_KWARGS, accepts_kwarg, cache_kwarg, forward_params
from offpolicy_moe.models.kept_tokens import KeptTokens, step_support
from offpolicy_moe.models.token_logprobs import token_logprobs
from offpolicy_moe.routing import (FeatureCache, PR2Predictors, RoutingController, cat_features, cat_traces,
                                   router_perturbation)
from offpolicy_moe.models import is_moe
from offpolicy_moe.models.dtypes import resolve_dtype
from offpolicy_moe.tasks import decode_completions, encode_prompts

__all__ = ["REPLAY_ENGINE", "RolloutEngine", "HFRolloutEngine", "EngineCapabilities", "EngineNeeds",
           "check_capabilities", "check_native_loop", "causal_lm_class", "ENGINES", "register_engine",
           "check_engine_name", "check_engine_config", "make_engine", "resolve_dtype"]

REPLAY_ENGINE = ("r3", "pr2")    # replay modes whose routes come from the rollout engine


@dataclass(frozen=True)
class EngineCapabilities:
    """What a rollout engine can do beyond sampling: return its route trace (R3 / PR2 / routing metrics), apply
    router-logit offsets (PR2 predictors, router noise, router perturbation), and return the kept set of each token
    it sampled from a truncated distribution (``RolloutBatch.kept_tokens``; needed by ``rollout.top_k > 0`` or
    ``rollout.top_p < 1``)."""

    records_routes: bool = False
    router_offsets: bool = False
    records_kept_tokens: bool = False


@dataclass(frozen=True)
class EngineNeeds:
    """What a run asks of its rollout engine beyond sampling, each as the setting that asks for it (``""``: not
    asked), so that a refusal names the user's own key: the route trace (R3 / PR2 / routing metrics on an MoE
    model), router-logit offsets (PR2 predictors, ``rollout.router_noise``, ``rollout.router_perturb``), and the kept
    set of each sampled token (``rollout.top_p < 1`` or ``rollout.top_k > 0``)."""

    records_routes: str = ""
    router_offsets: str = ""
    kept_tokens: str = ""

    @classmethod
    def of_run(cls, cfg: Any, is_moe: bool) -> "EngineNeeds":
        """What the run of config ``cfg`` asks of its engine, before any model is built (``is_moe``: the policy
        has routed experts), as :func:`~offpolicy_moe.trainer.build.build_engine` and the rollout workers ask."""
        rt = cfg.algo.routing
        routes = ""
        if is_moe and rt.replay in REPLAY_ENGINE:
            routes = f"algo.routing.replay={rt.replay}"
        elif is_moe and bool(rt.metrics):
            routes = "algo.routing.metrics=true"
        offsets = f"algo.routing.replay={rt.replay}" if rt.replay == "pr2" and is_moe else ""
        sampling = cls.of_rollout(cfg.rollout)
        return cls(records_routes=routes, router_offsets=offsets or sampling.router_offsets,
                   kept_tokens=sampling.kept_tokens)

    @classmethod
    def of_rollout(cls, rollout: Any, *, record_routes: bool = False,
                   router_offsets: Optional[dict] = None) -> "EngineNeeds":
        """What an engine built from the ``rollout`` section with these keywords is asked for (see
        :func:`make_engine`)."""
        offsets = ""
        if router_offsets is not None:
            offsets = "algo.routing.replay=pr2"
        elif float(rollout.router_noise) > 0:
            offsets = f"rollout.router_noise={rollout.router_noise}"
        elif float(rollout.router_perturb) > 0:
            offsets = f"rollout.router_perturb={rollout.router_perturb}"
        kept = ""
        if float(rollout.top_p) < 1.0:
            kept = f"rollout.top_p={rollout.top_p}"
        elif int(rollout.top_k) > 0:
            kept = f"rollout.top_k={rollout.top_k}"
        return cls(records_routes="route recording" if record_routes else "", router_offsets=offsets,
                   kept_tokens=kept)


def check_capabilities(name: str, capabilities: EngineCapabilities, needs: EngineNeeds) -> None:
    """One-line ``ValueError`` naming the setting when the engine ``rollout.engine=name`` lacks a capability the run
    asks for (:class:`EngineNeeds`); shared by :func:`check_engine_config` (before any engine starts) and
    :func:`make_engine`."""
    for asked, have, what in (
            (needs.records_routes, capabilities.records_routes, "route recording (R3/PR2/routing metrics)"),
            (needs.router_offsets, capabilities.router_offsets, "router-logit offsets (PR2/router_noise/"
                                                                "router_perturb)"),
            (needs.kept_tokens, capabilities.records_kept_tokens,
             "returning the kept sets of top-k/top-p sampling, which the trainer needs to take its log-probs over "
             "the same distribution; use rollout.top_k=0 rollout.top_p=1")):
        if asked and not have:
            raise ValueError(f"{asked}: rollout.engine={name!r} does not support {what}")


class RolloutEngine(abc.ABC):
    """What the trainer needs from a rollout engine.  An engine is built from the ``rollout`` config section by
    :meth:`from_config` and declares its :class:`EngineCapabilities`."""

    version: int = 0
    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()

    @classmethod
    @abc.abstractmethod
    def from_config(cls, policy: torch.nn.Module, tokenizer: Any, rollout: Any, *, record_routes: bool = False,
                    router_offsets: Optional[dict] = None, device: Optional[torch.device] = None,
                    seed: int = 0) -> "RolloutEngine":
        """The engine for config section ``rollout`` (``RolloutConfig``); ``router_offsets``: the PR2 keywords
        (``pr2_predictors``, ``pr2_in_weights``, ``pr2_feature_sample_rate``) or None; ``seed``: the run's seed,
        from which ``rollout.router_perturb``'s fixed perturbation is drawn."""

    @classmethod
    def check_config(cls, rollout: Any, model_config: Any, needs: EngineNeeds = EngineNeeds()) -> None:
        """One-line ``ValueError`` when this engine cannot serve the model of ``model_config`` with the ``rollout``
        settings and what the run asks of it (``needs``), checked in the trainer's process before any engine, worker
        or actor starts.  Every refusal of an engine's constructor lives here (or in a function both call), so that
        ``train --dry-run`` finds it; tests/rollout/test_engine_refusals.py holds the constructors to that."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[str], answers: Sequence[str], *, group_size: int, seed: int,
                 iteration: int = 0) -> RolloutBatch:
        """Sample ``group_size`` responses per prompt; return a :class:`RolloutBatch` at ``self.version``."""

    def forget_version(self) -> None:
        """The weights held are no known version: the next sync of any version loads."""
        self.version = -1

    def call_between_tokens(self, hook: Optional[Any]) -> None:
        """``hook(engine)`` runs between decode steps, where it may sync newer weights (updates in flight);
        None: weights change between whole generations only."""
        self.between_tokens = hook

    @abc.abstractmethod
    def sync(self, state_dict: dict, version: int, predictors: Optional[dict] = None) -> None:
        """Load new policy weights (and PR2 predictor weights) and set the version."""

    def close(self) -> None:
        """Stop what the engine started (processes, threads), in order, before its owner exits; idempotent.  The
        built-in engine starts nothing."""


def _encode(tokenizer: Any, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids, attention_mask)``, encoded as the task's evaluation encodes them."""
    return encode_prompts(tokenizer, list(prompts))


# the native sampler takes the behaviour log-probs of the steps it holds once their scores reach this many floats
# (16 MiB of float32): one step at a time with a real vocabulary, all steps in one call with a tiny one
SCORES_HELD_ELEMENTS = 1 << 22


def _held_logprobs(held: list) -> torch.Tensor:
    """``[B, k]`` log-probs of the ``k`` held steps' drawn tokens under their scores; empties ``held``."""
    scores = torch.stack([s for s, _ in held], 1)
    drawn = torch.stack([x for _, x in held], 1)
    held.clear()
    return token_logprobs(scores, drawn)


def probabilities_finite(scores: torch.Tensor) -> bool:
    """True when ``softmax(scores)`` holds no NaN or Inf (``-inf`` scores are allowed: truncated tokens)."""
    return bool(torch.isfinite(scores.float().softmax(dim=-1)).all())


def draw(scores: torch.Tensor) -> torch.Tensor:
    """``[B]`` one token per row, ``x ~ softmax(scores)`` (``torch.multinomial``); scores whose probabilities are not
    finite raise :class:`~offpolicy_moe.run.nonfinite.NonFiniteError` (stage ``generation``)."""
    try:
        return torch.multinomial(scores.softmax(dim=-1), num_samples=1).squeeze(1)
    except RuntimeError as exc:
        if probabilities_finite(scores):
            raise
        raise NonFiniteError("generation", f"sampling probabilities ({str(exc).strip().splitlines()[0]})") from exc


class StepLogprobs(LogitsProcessor):
    """The last logits processor of a ``generate`` call: it holds the current step's processed scores and, at the
    next step (whose ``input_ids`` end with the token drawn from them), takes that token's log-prob
    ``s_t[x_t] - logsumexp(s_t)``; :meth:`finish` takes the last step's.  With ``record_kept`` it also takes each
    step's kept set (the finite scores, :func:`~offpolicy_moe.models.kept_tokens.step_support`) into
    :attr:`kept_steps`.  Scores pass through unchanged."""

    def __init__(self, record_kept: bool = False):
        self._held: Optional[torch.Tensor] = None
        self._logps: list[torch.Tensor] = []
        self.record_kept = bool(record_kept)
        self.kept_steps: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.vocab_size: Optional[int] = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._held is not None:
            self._logps.append(token_logprobs(self._held.unsqueeze(1), input_ids[:, -1:]))
        self._held = scores
        if self.record_kept:
            self.kept_steps.append(step_support(scores))
            self.vocab_size = int(scores.shape[-1])
        return scores

    def held_scores_finite(self) -> bool:
        """True unless the current step's scores give non-finite sampling probabilities."""
        return self._held is None or probabilities_finite(self._held)

    def finish(self, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """``[B, T']`` log-probs of ``sequences[:, prompt_len:]`` (the ``T'`` drawn tokens)."""
        if self._held is not None and sequences.shape[1] - prompt_len > len(self._logps):
            self._logps.append(token_logprobs(self._held.unsqueeze(1), sequences[:, -1:]))
        self._held = None
        steps = sequences.shape[1] - prompt_len
        if len(self._logps) != steps:
            raise RuntimeError(f"generate drew {steps} tokens but the logits processor saw {len(self._logps)} steps")
        return torch.cat(self._logps, 1) if self._logps else sequences.new_zeros((sequences.shape[0], 0),
                                                                                 dtype=torch.float32)


def _cat_traces(traces: list) -> Any:
    """Concatenate per-chunk route traces along the batch dimension (chunks are padded to a common length)."""
    if len(traces) == 1:
        return traces[0]
    return cat_traces(traces, side="right")     # responses are right-padded


def causal_lm_class(model_config: Any) -> Optional[type]:
    """The transformers causal-LM class that ``model_config`` builds (None where transformers maps none)."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(model_config, "model_type", ""), "")
    return getattr(transformers, name, None) if name else None


def check_native_loop(sampler: str, model_class: Optional[type], model_config: Any) -> None:
    """One-line ``ValueError`` for ``rollout.sampler=native`` on a model whose class cannot run the own sampling
    loop: it needs a decoder-only causal LM whose forward takes a KV cache and ``position_ids`` (None: unknown, not
    refused)."""
    if sampler != "native" or model_class is None:
        return
    params = forward_params(model_class)
    if (getattr(model_config, "is_encoder_decoder", False) or not any(k in params for k in CACHE_KWARGS)
            or "position_ids" not in params):
        raise ValueError(f"rollout.sampler=native needs a causal LM whose forward takes a KV cache and "
                         f"position_ids; {model_class.__name__} does not: use rollout.sampler=hf")


class HFRolloutEngine(RolloutEngine):
    """Hugging Face ``generate``-based engine with its own copy of the policy (see module docstring)."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities(records_routes=True, router_offsets=True,
                                                                    records_kept_tokens=True)

    @classmethod
    def check_config(cls, rollout: Any, model_config: Any, needs: EngineNeeds = EngineNeeds()) -> None:
        """The built-in engine serves any capability; ``rollout.sampler=native`` needs a model class that can run
        its own loop (:func:`check_native_loop`)."""
        check_capabilities(rollout.engine, cls.capabilities, needs)
        check_native_loop(rollout.sampler, causal_lm_class(model_config), model_config)

    @classmethod
    def from_config(cls, policy: torch.nn.Module, tokenizer: Any, rollout: Any, *, record_routes: bool = False,
                    router_offsets: Optional[dict] = None, device: Optional[torch.device] = None,
                    seed: int = 0) -> "HFRolloutEngine":
        """The engine of config section ``rollout`` (see :class:`RolloutEngine`)."""
        return cls(policy, tokenizer, rollout, record_routes=record_routes, router_offsets=router_offsets,
                   device=device, seed=seed)

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, rollout: Any, *, record_routes: bool = False,
                 router_offsets: Optional[dict] = None, device: Optional[torch.device] = None, seed: int = 0):
        """An engine copy of ``policy`` configured by the ``rollout`` section; ``rollout.router_perturb`` (sigma) > 0
        routes every MoE layer on ``logits + h dW_l^T`` (:func:`~offpolicy_moe.routing.router_perturbation` of
        ``seed``), composed with the PR2 offsets when both are on."""
        offsets = dict(router_offsets or {})
        dtype, max_new_tokens, sampler = rollout.dtype, rollout.max_new_tokens, rollout.sampler
        temperature, top_p, batch_size = rollout.temperature, rollout.top_p, rollout.batch_size
        router_noise, router_perturb, perturb_seed = rollout.router_noise, rollout.router_perturb, seed
        compact_finished, decode_attention = rollout.compact_finished, rollout.decode_attention
        pr2_predictors = offsets.get("pr2_predictors")
        pr2_in_weights = offsets.get("pr2_in_weights", True)
        pr2_feature_sample_rate = offsets.get("pr2_feature_sample_rate", 0.125)
        self.dtype = resolve_dtype(dtype)
        self.model = copy.deepcopy(policy).to(dtype=self.dtype)
        if device is not None:
            self.model.to(device)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(rollout.top_k)
        # a truncated sampling distribution: each token's kept set goes to the trainer (RolloutBatch.kept_tokens)
        self.truncates = self.top_p < 1.0 or self.top_k > 0
        self.batch_size = int(batch_size)
        self.record_routes = bool(record_routes)
        self.router_noise = float(router_noise)
        self.pr2_predictors = copy.deepcopy(pr2_predictors) if pr2_predictors is not None else None
        self.pr2_in_weights = pr2_in_weights
        self.pr2_feature_sample_rate = pr2_feature_sample_rate
        self.version = 0
        # called with the engine before every decode forward of the native sampler (may sync newer weights: updates
        # in flight, docs/async.md); the version of each forward is recorded per sampled token
        self.between_tokens: Optional[Any] = None
        self.scores_held_elements = SCORES_HELD_ELEMENTS
        self._step_versions: list[int] = []
        # the own sampling loop needs a Hugging Face causal LM whose forward takes a KV cache and positions
        check_native_loop(sampler, type(self.model), getattr(self.model, "config", None))
        self.sampler = sampler
        self._keeps_logits = accepts_kwarg(self.model, "logits_to_keep")
        # the engine's own copy only: the trainer's model keeps its attention implementation
        self.single_query_decode = (self.sampler == "native" and decode_attention == "single_query"
                                    and use_single_query_decode(self.model))
        self.compact_finished = bool(compact_finished)
        # the native sampler's decode steps: lean where the family's forward is mirrored (rollout/decode_step.py)
        self.decode = DecodeForward(self.model, lean=rollout.decode_forward == "lean")
        self._sync_targets = self.model.state_dict(keep_vars=True)     # name -> the engine's own tensor
        self.router_perturb = float(router_perturb)
        self.perturb_seed = int(perturb_seed)
        # router noise and the perturbation act on routers: on a dense model (validation warns) they do nothing
        shifts_routers = (self.router_noise > 0 or self.router_perturb > 0) and is_moe(self.model)
        self.controller = None
        if self.record_routes or shifts_routers or self.pr2_predictors is not None:
            self.controller = RoutingController(self.model)
        if self.pr2_predictors is not None:
            self.pr2_predictors.to(dtype=torch.float32)
        # the fixed router-weight perturbation dW (frozen, float32; never synced: a function of the seed alone)
        self.router_perturbation: Optional[PR2Predictors] = None
        if self.router_perturb > 0 and self.controller is not None:
            ctl = self.controller
            self.router_perturbation = router_perturbation(ctl.hidden_size, ctl.num_experts, ctl.num_moe_layers,
                                                           self.router_perturb, self.perturb_seed, device=self.device)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def sync(self, state_dict: dict, version: int, predictors: Optional[dict] = None) -> None:
        """Copy the trainer's weights in place (``copy_`` casts to the engine dtype; strict keys) and set the version,
        without ``load_state_dict``'s per-module walk."""
        targets = self._sync_targets
        if state_dict.keys() != targets.keys():
            missing = sorted(set(targets) - set(state_dict))
            extra = sorted(set(state_dict) - set(targets))
            raise KeyError(f"engine sync: state_dict does not match the engine model (missing {missing[:5]}, "
                           f"unexpected {extra[:5]})")
        with torch.no_grad():
            for name, dst in targets.items():
                src = state_dict[name]
                if src.shape != dst.shape:
                    raise ValueError(f"engine sync: {name} has shape {tuple(src.shape)}, the engine's is "
                                     f"{tuple(dst.shape)}")
                dst.copy_(src)
        if predictors is not None and self.pr2_predictors is not None:
            self.pr2_predictors.load_state_dict(predictors)
        self.version = int(version)

    # ------------------------------------------------------------------ sampling
    def _generation_kwargs(self, step_logprobs: Optional["StepLogprobs"] = None) -> dict:
        """``generate``'s arguments.  With ``step_logprobs`` the warpers are passed as our own ``logits_processor``
        list followed by ``step_logprobs`` (``generate`` runs a custom processor before its own warpers), and
        temperature, top-k, top-p and ``output_scores`` are left off: the same scores and draws, one step held."""
        tok = self.tokenizer
        kw = dict(do_sample=True, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                  max_new_tokens=self.max_new_tokens, min_new_tokens=0,
                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  return_dict_in_generate=True, output_scores=True, num_beams=1)
        if step_logprobs is not None:
            kw.update(temperature=1.0, top_p=1.0, top_k=0, output_scores=False,
                      logits_processor=LogitsProcessorList([*self._warpers(), step_logprobs]))
        return kw

    def _warpers(self) -> LogitsProcessorList:
        """The logits processors ``generate`` applies for this engine's sampling settings, in its order:
        temperature (only when ≠ 1), then top-k (only when > 0), then top-p (only when < 1)."""
        procs = LogitsProcessorList()
        if self.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k > 0:
            procs.append(TopKLogitsWarper(self.top_k))
        if self.top_p < 1.0:
            procs.append(TopPLogitsWarper(self.top_p))
        return procs

    def _process_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution's scores from float32 next-token logits, by the logits processors ``generate``
        runs: ``z / temperature``, then top-k (Fan et al. 2018, arXiv 1805.04833), then top-p (nucleus, Holtzman et al.
        arXiv 1904.09751; the most likely token is always kept), dropped tokens set to ``-inf``."""
        warpers = self._warpers()
        return warpers(None, logits) if warpers else logits

    def _shared_prefill_groups(self, ids: torch.Tensor, am: torch.Tensor, group_size: int) -> int:
        """``group_size`` when the rows come in blocks of identical prompts and the router hooks (if any) only record or
        apply the fixed perturbation, so equal rows stay equal: the prompt is prefilled ONCE per block.  1 under
        router-logit noise or PR2, which are per sample."""
        B = ids.shape[0]
        if group_size <= 1 or B % group_size or self.router_noise > 0 or self.pr2_predictors is not None:
            return 1
        blocks = ids.view(B // group_size, group_size, -1)
        mblocks = am.view(B // group_size, group_size, -1)
        same = bool((blocks == blocks[:, :1]).all()) and bool((mblocks == mblocks[:, :1]).all())
        return group_size if same else 1

    def _sample_loop(self, ids: torch.Tensor, am: torch.Tensor, recorder: Any = None, group_size: int = 1):
        """Ancestral sampling with a KV cache, without ``generate``'s per-step machinery: one prefill (shared by a
        prompt's samples unless router noise or PR2 make them differ), then one forward per token, ``x_t ~
        softmax(scores_t)``; finished rows leave the decode batch once a quarter has finished (not under noise or PR2).
        Returns ``(sequences [B, P+T'], logp [B, T'], kept)``; ``logp`` is taken whenever the held scores reach
        ``scores_held_elements`` floats (all of them would be 128 x 4096 x 152k floats = 318 GB)."""
        model, tok = self.model, self.tokenizer
        B, P = ids.shape
        cache = preallocated_cache(model.config, P + self.max_new_tokens)      # no per-token torch.cat of the cache
        pos = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 1)
        keep = {"logits_to_keep": 1} if self._keeps_logits else {}
        keep[cache_kwarg(model)] = cache
        g = self._shared_prefill_groups(ids, am, group_size)
        if g > 1:      # G samples of one prompt share its prefill: run it on one row per group, repeat the cache
            out = model(input_ids=ids[::g], attention_mask=am[::g], position_ids=pos[::g], use_cache=True,
                        **keep)
            cache.batch_repeat_interleave(g)
            out.logits = out.logits.repeat_interleave(g, dim=0)
            if recorder is not None:
                recorder.select_rows(torch.arange(B // g, device=ids.device).repeat_interleave(g))
        else:
            out = model(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True, **keep)
        logits = out.logits
        fwd_version, self._step_versions = self.version, []
        pad = torch.full((B,), tok.pad_token_id, dtype=ids.dtype, device=ids.device)
        unfinished = torch.ones(B, dtype=torch.bool, device=ids.device)
        tokens, logps, held = [], [], []      # held: the steps' (scores, token) whose log-probs are not yet taken
        kept_steps: list[tuple[torch.Tensor, torch.Tensor]] = []     # per step: (counts [B], ids) of the kept sets
        mask_buf = torch.cat([am, am.new_ones((B, self.max_new_tokens))], dim=1)    # mask[:, :P+t+1] at step t
        last_pos = pos[:, -1:]
        fed = torch.arange(B, device=ids.device)          # rows still fed to the model
        compact = self.compact_finished and self.router_noise == 0 and self.pr2_predictors is None
        for t in range(self.max_new_tokens):
            last = logits[:, -1, :].float()
            if fed.numel() < B:     # finished rows were dropped: their (unused) scores are uniform
                last = last.new_zeros((B, last.shape[-1])).index_copy_(0, fed, last)
            scores = self._process_scores(last)
            # every row draws (finished ones too, then padded): the random stream does not depend on compaction
            nxt = draw(scores)
            if self.truncates:      # the kept set of the rows that draw a real token (finished ones are padded)
                kept_steps.append(step_support(scores, unfinished))
            nxt = torch.where(unfinished, nxt, pad)
            tokens.append(nxt)
            held.append((scores, nxt))
            if len(held) * scores.numel() >= self.scores_held_elements:
                logps.append(_held_logprobs(held))
            self._step_versions.append(fwd_version)     # the weights whose forward gave these scores
            unfinished &= nxt != tok.eos_token_id
            if t == self.max_new_tokens - 1 or not bool(unfinished.any()):
                break
            still = unfinished.index_select(0, fed)
            if compact and 4 * int(still.sum()) <= 3 * fed.numel():   # >= 1/4 of the fed rows finished: drop them
                keep_rows = still.nonzero().flatten()
                cache.batch_select_indices(keep_rows)
                mask_buf, last_pos, fed = mask_buf[keep_rows], last_pos[keep_rows], fed[keep_rows]
                if recorder is not None:
                    recorder.scatter_rows(fed, B)
            mask = mask_buf[:, :P + t + 1]
            last_pos = last_pos + 1
            if self.between_tokens is not None:
                self.between_tokens(self)
            fwd_version = self.version
            logits = self.decode(nxt.index_select(0, fed).unsqueeze(1), mask, last_pos, cache)
        seq = torch.cat([ids, torch.stack(tokens, 1)], dim=1)
        if recorder is not None:
            recorder.final_len = int(seq.shape[1])   # the last sampled token is never fed to the model
        if held:
            logps.append(_held_logprobs(held))
        kept = None
        if self.truncates:
            kept = KeptTokens.from_steps([c for c, _ in kept_steps], [i for _, i in kept_steps], last.shape[-1])
        return seq, torch.cat(logps, dim=1), kept

    @torch.no_grad()
    def _generate_chunk(self, ids: torch.Tensor, am: torch.Tensor, feature_cache: Any, group_size: int = 1):
        with ExitStack() as stack:
            rec = None
            if self.controller is not None:
                if self.router_noise > 0:
                    stack.enter_context(self.controller.logit_noise(self.router_noise))
                if self.pr2_predictors is not None:     # PR2 offsets on top of the (perturbed) engine router
                    stack.enter_context(self.controller.offsets(self.pr2_predictors, in_weights=self.pr2_in_weights,
                                                                feature_cache=feature_cache,
                                                                fixed=self.router_perturbation))
                elif self.router_perturbation is not None:   # logits + h dW^T, selection and weights
                    stack.enter_context(self.controller.offsets(self.router_perturbation, in_weights=True))
                if self.record_routes or self.pr2_predictors is not None:
                    rec = stack.enter_context(self.controller.record())
            if self.sampler == "native" and self.controller is None:
                # no router hook: nothing produced here is kept by autograd-facing code, so inference mode (no
                # version counters or view tracking) is safe; the outputs are cloned back into normal tensors
                with torch.inference_mode():
                    sequences, logp, kept = self._sample_loop(ids, am, rec, group_size)
                sequences, logp = sequences.clone(), logp.clone()
                if kept is not None:
                    kept = KeptTokens(kept.counts.clone(), kept.ids.clone(), kept.vocab_size)
            elif self.sampler == "native":
                sequences, logp, kept = self._sample_loop(ids, am, rec, group_size)
            else:
                step_lp = StepLogprobs(record_kept=self.truncates)
                try:
                    out = self.model.generate(input_ids=ids, attention_mask=am, **self._generation_kwargs(step_lp))
                except RuntimeError as exc:    # the sampler refused the scores it was given: were they finite?
                    if step_lp.held_scores_finite():
                        raise
                    raise NonFiniteError("generation",
                                         f"sampling probabilities ({str(exc).strip().splitlines()[0]})") from exc
                sequences = out.sequences
                logp = step_lp.finish(sequences, ids.shape[1])
                kept = None
                if self.truncates:
                    steps = step_lp.kept_steps[:sequences.shape[1] - ids.shape[1]]
                    kept = KeptTokens.from_steps([c for c, _ in steps], [i for _, i in steps],
                                                 int(step_lp.vocab_size))
        trace = rec.trace() if rec is not None else None
        return sequences, logp, trace, kept

    def generate(self, prompts: Sequence[str], answers: Sequence[str], *, group_size: int, seed: int,
                 iteration: int = 0) -> RolloutBatch:
        """``len(prompts) * group_size`` sequences; sequence ``i`` answers prompt ``i // group_size``.

        Sampling is seeded with ``seed`` (``torch.manual_seed``) so a resumed run regenerates the same batch.
        """
        if len(prompts) != len(answers):
            raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        p_ids, p_am = _encode(self.tokenizer, prompts)
        p_ids = p_ids.repeat_interleave(group_size, 0).to(self.device)
        p_am = p_am.repeat_interleave(group_size, 0).to(self.device)
        P = p_ids.shape[1]
        torch.manual_seed(seed)
        start_version = self.version
        seqs, logps, traces, feats, sizes, versions, kepts = [], [], [], [], [], [], []
        for start in range(0, p_ids.shape[0], self.batch_size):
            cache = None
            if self.pr2_predictors is not None:
                gen = torch.Generator().manual_seed(seed + start)
                cache = FeatureCache(sample_rate=self.pr2_feature_sample_rate, generator=gen, store_device="cpu")
            chunk_ids = p_ids[start:start + self.batch_size]
            s, lp, tr, kp = self._generate_chunk(chunk_ids, p_am[start:start + self.batch_size], cache,
                                                 group_size if start % group_size == 0 else 1)
            seqs.append(s); logps.append(lp); traces.append(tr); sizes.append(chunk_ids.shape[0]); kepts.append(kp)
            steps = s.shape[1] - P
            vs = self._step_versions if (self.sampler == "native" and len(self._step_versions) == steps) \
                else [self.version] * steps
            versions.append(torch.tensor(vs, dtype=torch.long).expand(s.shape[0], steps))
            if cache is not None:
                feats.append(cache.collect())
        T = max(s.shape[1] for s in seqs) - P
        pad = self.tokenizer.pad_token_id
        seq = torch.cat([torch.nn.functional.pad(s, (0, P + T - s.shape[1]), value=pad) for s in seqs], 0)
        behav = torch.cat([torch.nn.functional.pad(lp, (0, T - lp.shape[1])) for lp in logps], 0)
        token_versions = torch.cat([torch.nn.functional.pad(v, (0, T - v.shape[1]), value=int(v[0, -1]))
                                    for v in versions], 0)
        resp = seq[:, P:]
        # response mask: tokens up to and including the first EOS (generate pads after it)
        is_eos = resp == self.tokenizer.eos_token_id
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        in_chunk = torch.cat([torch.arange(T, device=seq.device).unsqueeze(0).expand(s.shape[0], T)
                              < (s.shape[1] - P) for s in seqs], 0)
        response_mask = (~after_eos & in_chunk).long()
        attention_mask = torch.cat([p_am, response_mask], dim=1)
        behav = torch.where(response_mask.bool(), behav, torch.zeros_like(behav))   # -inf*0 would be NaN
        kept = None
        if self.truncates:    # the kept sets of the response tokens (count 0 after EOS and in padding)
            kept = KeptTokens.cat([k.to("cpu").pad_to(T) for k in kepts]).masked(response_mask.cpu())
            if not bool(kept.contains(resp.cpu())[response_mask.cpu().bool()].all()):
                raise RuntimeError("rollout engine: a sampled token lies outside its own kept set (top-k / top-p); "
                                   "the sampler's scores and its draws disagree")
        routes = _cat_traces(traces) if traces[0] is not None else None
        if routes is not None:
            routes = routes.to("cpu")
        features = None
        if feats:
            features = cat_features(feats, sizes) if len(feats) > 1 else feats[0]
            features = features.filter(attention_mask.cpu())     # drop left-pad and after-EOS positions
        # decoded as the task's evaluation decodes (cut at the first eos: the response mask's extent), so the
        # rewards agree with the evaluation's
        completions = decode_completions(self.tokenizer, resp.cpu())
        groups = torch.arange(len(prompts)).repeat_interleave(group_size)
        answers_rep = [a for a in answers for _ in range(group_size)]
        return RolloutBatch(input_ids=seq.cpu(), attention_mask=attention_mask.cpu(),
                            response_mask=response_mask.cpu(), behav_logp=behav.cpu(), group_ids=groups,
                            answers=answers_rep, completions=list(completions), prompt_len=P,
                            version=start_version, generated_at=iteration, routes=routes,
                            pr2_features=features, token_versions=token_versions, kept_tokens=kept)


ENGINES: dict[str, type[RolloutEngine]] = {}


def register_engine(name: str, engine: type[RolloutEngine]) -> None:
    """Make ``engine`` selectable as ``rollout.engine=<name>``."""
    ENGINES[name] = engine


register_engine("hf", HFRolloutEngine)


def check_engine_name(name: str) -> None:
    """One-line ``ValueError`` when ``rollout.engine`` names no registered engine (checked before any compute)."""
    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name!r} is not a known engine; choose one of {sorted(ENGINES)} "
                         "(offpolicy_moe.rollout.engine.register_engine adds one)")


def check_engine_config(rollout: Any, model_config: Any, needs: EngineNeeds = EngineNeeds()) -> None:
    """The named engine's own checks of the ``rollout`` section against the policy's transformers config and what
    the run asks of it (:class:`EngineNeeds`), before any engine, worker or actor starts
    (:meth:`RolloutEngine.check_config`); one-line ``ValueError``."""
    check_engine_name(rollout.engine)
    ENGINES[rollout.engine].check_config(rollout, model_config, needs)


def make_engine(policy: torch.nn.Module, tokenizer: Any, rollout: Any, *, record_routes: bool = False,
                router_offsets: Optional[dict] = None, device: Optional[torch.device] = None,
                seed: int = 0) -> RolloutEngine:
    """The engine named by ``rollout.engine``, built from the ``rollout`` section (``seed``: the run's seed, which
    fixes ``rollout.router_perturb``'s perturbation: the trainer and every rollout worker pass the same one, so they
    draw the same ``dW``); one-line error for an unknown name or an engine that lacks a capability the run needs
    (:func:`check_capabilities`, which the run's checks apply first)."""
    check_engine_name(rollout.engine)
    cls = ENGINES[rollout.engine]
    needs = EngineNeeds.of_rollout(rollout, record_routes=record_routes, router_offsets=router_offsets)
    check_capabilities(rollout.engine, cls.capabilities, needs)
    return cls.from_config(policy, tokenizer, rollout, record_routes=record_routes, router_offsets=router_offsets,
                           device=device, seed=seed)
