"""Validation of a resolved :class:`~offpolicy_moe.config.schema.TrainConfig`, before any compute.

``validate(cfg, model_is_moe=None)`` raises :class:`ConfigError` (a ``ValueError``) listing EVERY violated rule,
each message one line that starts with the keys involved, and returns the list of warnings (strings) for
combinations that are legal but probably not what the user meant. ``model_is_moe`` tells whether the policy is a
Mixture-of-Experts model; ``None`` infers it from the config (``model.preset``, ``model.num_experts``, or
``config.json`` of ``model.path`` when that exists) and skips the MoE rules when it cannot tell.

Per-key rules are declared once, next to each schema field (:mod:`offpolicy_moe.config.ranges`): every number of
every key must be finite (NaN fails every ``<`` test, so it is refused first), then within its declared range, and
every enumerated key one of its choices (vocabularies imported from their owners' torch-free modules; the loss keys
are checked against the loss catalogue, :mod:`offpolicy_moe.losses.catalogue`, so validation imports no torch
unless ``model.experts_implementation`` names one of transformers' kernels). The loss keys, whose dataclass
the losses own, take their ranges from :data:`LOSS_RULES`. Then one function per config section checks the
cross-field rules (E = error, W = warning):

| section | rule |
|---|---|
| loss | ``algo.loss.name`` registered (E); ``algo.loss.options`` checked by the loss's registry entry (E); a sequence-level loss with a token-summing ``agg`` (W: GSPO, arXiv 2507.18071) |
| correction | ``mode`` ≠ none with ``old_logp_source=engine`` (E: the mismatch would be corrected twice); ``low`` < ``high`` (E); truncate with ``high`` < 1 (W) |
| routing | replay on a dense model (E); R2 with bypass (E: R2 records in the old-log-prob pass bypass skips); R2 with one update per step (W: R3 paper, arXiv 2510.11370) |
| rollout | ``group_size`` < 2 with ``adv_norm=std`` (W: every advantage 0); router noise on a dense model (W); a ``vllm_`` key with another engine (E); with ``engine=vllm``: ``vllm_devices`` distinct indices >= 0, not with ``backend=ray`` (E), ``vllm_max_model_len`` < ``max_new_tokens`` + 1 (E), ``vllm_routes=hooks`` without ``vllm_eager`` when routes are recorded (E); ``ray_num_gpus`` without ``backend=ray`` (W) |
| trainer/buffer | ``updates_per_step`` × ``grad_accum`` ≤ sequences per step (E), divisible (W); ``buffer.staleness`` < ``trainer.steps`` (E: the requested staleness would never be reached); ``buffer.max_delay`` set with a mode other than ``bounded`` (E: only ``bounded`` reads it), above ``buffer.staleness`` (W: the later batches are dropped, never trained staler than k); ``trainer.follow_threads`` without local workers (``buffer.mode`` async or stream, ``rollout.backend=local``) (E) |
| unread keys | a key set away from its default while the key that switches it on is off (:data:`UNREAD_UNLESS`: correction bounds without a correction, the KL kind without a KL, PR2 settings without PR2, ``task.max_terms`` / ``task.length_tail`` / ``task.estimate_share`` with a task other than longtail, the ``eval`` sampling keys with ``eval.samples=0``) (W) |
| optim | ``betas`` two values in [0, 1) (E) |
| model | MoE preset: 2 ≤ ``num_experts``, ``top_k`` ≤ ``num_experts``; preset ``hidden_size`` a multiple of the head size, an even head size (rotary pairs); known preset unless ``model.path``; no ``/path/to/`` placeholder; ``experts_implementation=deepgemm`` with both dtypes bfloat16 (E) |
| task | arithmetic: ``operators`` ⊆ ``+-*``, ``min_digits`` ≤ ``max_digits``; reverse, chain: the same digit bounds; longtail: one-digit operands; else ``jsonl:<path>`` or ``dataset:<source>`` (E) |
| logging | ``loggers`` ⊆ console, jsonl, wandb (E) |

The rules of each ``buffer.mode`` belong to the batch source class that runs it (``check_rules``); ``more`` takes
them (:func:`offpolicy_moe.sources.modes.validate_run`), so that this module never reads the mode's name.

Checks that read files (task files, ``model.path``, tokenizer, answer lengths, buffer feasibility) live in
:mod:`offpolicy_moe.config.preflight`.
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Optional

from offpolicy_moe.config.ranges import Rule, declared_rules, field_problems
from offpolicy_moe.config.schema import LOGGERS, RolloutConfig, TrainConfig
import offpolicy_moe.models as models
from offpolicy_moe.losses.catalogue import (list_policy_losses, loss_interface, loss_options_problem,
                                            resolve_loss_options)
from offpolicy_moe.losses.vocabulary import AGG_MODES
from offpolicy_moe.models.moe_shape import declares_moe
from offpolicy_moe.models.vocabulary import EXPERTS_OWN, PRESET_NAMES
from offpolicy_moe.tasks.reward_specs import parse_reward_specs

# Ranges of the loss keys (their dataclass belongs to the losses; the generic walk applies these).
LOSS_RULES: dict[str, Rule] = {
    "algo.loss.agg": Rule(choices=AGG_MODES, optional=True),
    "algo.loss.adv_norm": Rule(choices=("std", "none")),
    "algo.loss.norm_length": Rule(ge=1, optional=True),         # a divisor: 0 gives inf/NaN
}


#: experts kernels of transformers that take bfloat16 hidden states only (the others take any float dtype)
BF16_ONLY_EXPERTS = ("deepgemm",)


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending keys (and the file or override)."""


class Findings:
    """Errors and warnings collected by the section checks."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, msg: str) -> None:
        """Record an error (one line, starting with the key); a repeated message is kept once."""
        if msg not in self.errors:
            self.errors.append(msg)

    def warn(self, msg: str) -> None:
        """Record a warning (one line, starting with the key)."""
        self.warnings.append(msg)

    def raise_if_errors(self) -> None:
        """Raise :class:`ConfigError`: one line for one error, else a header and one line per error."""
        if len(self.errors) == 1:
            raise ConfigError(f"invalid configuration: {self.errors[0]}")
        if self.errors:
            raise ConfigError("\n  - ".join([f"invalid configuration ({len(self.errors)} problems):", *self.errors]))


def vocabularies() -> dict[str, tuple]:
    """``{dotted key: allowed values}`` of every enumerated key (declared in the schema, plus the loss keys)."""
    out = {k: r.choices for k, r in declared_rules(TrainConfig).items() if r.choices is not None}
    out.update({k: r.choices for k, r in LOSS_RULES.items() if r.choices is not None})
    out["algo.loss.name"] = tuple(list_policy_losses())
    out["model.experts_implementation"] = models.experts_implementations()
    return out


def validate(cfg: Any, *, model_is_moe: Optional[bool] = None,
             more: tuple[Callable[[Any, Findings], None], ...] = ()) -> list[str]:
    """Check every key's declared range and every section's cross-field rules (module docstring), then the rules
    ``more`` adds (the batch source's: :func:`offpolicy_moe.sources.modes.validate_run` passes them).

    Returns the warnings (strings naming their keys). Raises :class:`ConfigError` listing every error found.
    """
    if model_is_moe is None:
        model_is_moe = infer_model_is_moe(cfg)
    found = Findings()
    for msg in field_problems(cfg, "", LOSS_RULES):
        found.error(msg)
    check_loss(cfg, found)
    check_correction(cfg, found)
    check_routing(cfg, found, model_is_moe)
    check_rollout(cfg, found, model_is_moe)
    check_trainer(cfg, found)
    check_buffer(cfg, found)
    check_unread(cfg, found)
    check_optim(cfg, found)
    check_model(cfg, found, model_is_moe)
    check_task(cfg, found)
    check_logging(cfg, found)
    for rules in more:
        rules(cfg, found)
    found.raise_if_errors()
    return found.warnings


def check_loss(cfg: Any, found: Findings) -> None:
    """``algo.loss``: a registered name, its ``options`` checked by the loss's own registry entry (names and
    values, with a did-you-mean), and a token-summing ``agg`` with a sequence-level loss (W)."""
    loss = cfg.algo.loss
    registered = list_policy_losses()
    if loss.name not in registered:
        found.error(f"algo.loss.name: unknown loss {loss.name!r}; registered: {', '.join(sorted(registered))}")
        return
    problem = loss_options_problem(loss.name, loss.options)
    if problem:
        found.error(f"algo.loss.options: {problem}")
    if loss_interface(loss.name).sequence_level and loss.agg not in (None, "seq-mean-token-mean"):
        found.warn(f"algo.loss.agg={loss.agg} with algo.loss.name={loss.name} (a sequence-level ratio): token-level "
                   "sums weight each sequence by its length; use seq-mean-token-mean")


def check_correction(cfg: Any, found: Findings) -> None:
    """``algo.correction``: not with bypass; ``low`` < ``high``; a TIS cap below 1."""
    corr = cfg.algo.correction
    if corr.mode != "none" and cfg.algo.old_logp_source == "engine":
        found.error(f"algo.correction.mode={corr.mode} with algo.old_logp_source=engine (bypass): the PPO ratio is "
                    "already pi_theta/mu, so TIS/MIS weights would correct the mismatch twice; use "
                    "old_logp_source=trainer or correction.mode=none")
    if corr.low is not None and corr.high is not None and corr.low >= corr.high:
        found.error(f"algo.correction.low ({corr.low}) must be < algo.correction.high ({corr.high})")
    if corr.mode == "truncate" and 0 < corr.high < 1:
        found.warn(f"algo.correction.high={corr.high} < 1 with correction.mode=truncate: every TIS weight is capped "
                   "below 1")
    check_proximal(cfg, found)
    loss = cfg.algo.loss
    if (corr.mode != "none" and corr.level != "token" and loss.name in list_policy_losses()
            and not loss_options_problem(loss.name, loss.options)
            and resolve_loss_options(loss.name, loss.options).get("fold_weights") is True):
        found.warn(f"algo.loss.name={loss.name} folds the correction weights into its per-token kernel "
                   f"(fold_weights), so a {corr.level}-level correction weight counts once per token; use "
                   "algo.correction.level=token or algo.loss.options.fold_weights=false")


def check_proximal(cfg: Any, found: Findings) -> None:
    """``algo.proximal_logp=loglinear`` belongs to decoupled PPO (``old_logp_source=proximal``), and takes each
    micro-batch's proximal log-probs from its own update forward, which a loss that selects over the whole
    mini-batch before that forward (M2PO's global pass) cannot wait for."""
    algo = cfg.algo
    if algo.proximal_logp != "loglinear":
        return
    if algo.old_logp_source != "proximal":
        found.error(f"algo.proximal_logp=loglinear approximates decoupled PPO's proximal log-probs, but "
                    f"algo.old_logp_source={algo.old_logp_source}; set algo.old_logp_source=proximal")
    elif algo.loss.name in list_policy_losses() and loss_interface(algo.loss.name).wants_global_pass(
            resolve_loss_options(algo.loss.name, algo.loss.options) if not loss_options_problem(
                algo.loss.name, algo.loss.options) else {}):
        found.error(f"algo.proximal_logp=loglinear with algo.loss.name={algo.loss.name}: its selection over the "
                    "whole mini-batch needs the proximal log-probs before the update forward; use "
                    "algo.proximal_logp=exact")


def check_routing(cfg: Any, found: Findings, model_is_moe: Optional[bool]) -> None:
    """``algo.routing``: replay needs an MoE model; R2 needs the trainer's old-log-prob pass; the trainer adds no
    load-balancing loss, so a non-zero ``algo.router_aux_loss_coef`` is refused rather than ignored."""
    replay = cfg.algo.routing.replay
    if cfg.algo.router_aux_loss_coef > 0:
        found.error(f"algo.router_aux_loss_coef={cfg.algo.router_aux_loss_coef}: the trainer does not add a "
                    "load-balancing loss (set 0); in your own loop, RoutingController.load_balancing_loss gives it "
                    "from the experts actually used under replay")
    if replay in ("r2", "r3", "pr2") and model_is_moe is False:
        found.error(f"algo.routing.replay={replay} needs a Mixture-of-Experts model, but the model is dense "
                    f"(model.preset={cfg.model.preset!r}, model.path={cfg.model.path!r})")
    if replay == "r2" and cfg.algo.old_logp_source == "engine":
        found.error("algo.routing.replay=r2 with algo.old_logp_source=engine: R2 records routes in the trainer's "
                    "old-log-prob pass, which bypass mode skips; use old_logp_source=trainer, or replay=r3")
    if replay == "r2" and cfg.trainer.updates_per_step == 1:
        found.warn("algo.routing.replay=r2 with trainer.updates_per_step=1: R2 only fixes routing drift across "
                   "mini-steps")
    rt = cfg.algo.routing
    if rt.drift_metrics and model_is_moe is False:
        found.warn("algo.routing.drift_metrics=true on a dense model has no effect (no routes)")
    elif rt.drift_metrics and not rt.metrics and replay not in ("r3", "pr2"):
        found.error("algo.routing.drift_metrics=true needs the engine's routes: set algo.routing.metrics=true "
                    "(or replay r3/pr2, which record them)")


def check_rollout(cfg: Any, found: Findings, model_is_moe: Optional[bool]) -> None:
    """``rollout``: group-normalised advantages need groups; router noise and the router perturbation need a
    router."""
    ro = cfg.rollout
    if 1 <= ro.group_size < 2 and cfg.algo.loss.adv_norm == "std":
        found.warn(f"rollout.group_size={ro.group_size} with algo.loss.adv_norm=std: every group advantage is 0")
    if ro.router_noise > 0 and model_is_moe is False:
        found.warn("rollout.router_noise > 0 on a dense model has no effect")
    if ro.router_perturb > 0 and model_is_moe is False:
        found.warn("rollout.router_perturb > 0 on a dense model has no effect")
    if ro.ray_num_gpus is not None and ro.backend != "ray":
        found.warn(f"rollout.ray_num_gpus={ro.ray_num_gpus} has no effect with rollout.backend={ro.backend}: it is "
                   "read only with rollout.backend=ray")
    if ro.engine != "vllm":
        defaults = RolloutConfig()
        for key in (f.name for f in fields(RolloutConfig) if f.name.startswith("vllm_")):
            if getattr(ro, key) != getattr(defaults, key):
                found.error(f"rollout.{key} sets the vLLM engine, but rollout.engine={ro.engine}: set "
                            "rollout.engine=vllm or leave it out")
    else:
        check_vllm(cfg, found, model_is_moe)


def check_vllm(cfg: Any, found: Findings, model_is_moe: Optional[bool]) -> None:
    """``rollout.engine=vllm``: the device list, the length it serves, and recording hooks without eager mode
    (where the config alone says the routes come from hooks; the engine's own checks, with the model's config,
    follow in :func:`offpolicy_moe.trainer.checks.check_config`, before any engine starts)."""
    ro, rt = cfg.rollout, cfg.algo.routing
    devices = list(ro.vllm_devices or [])
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in devices) or len(set(devices)) < len(devices):
        found.error(f"rollout.vllm_devices={devices}: expected distinct GPU indices >= 0 (as CUDA_VISIBLE_DEVICES "
                    "numbers them)")
    if devices and ro.backend == "ray":
        found.error("rollout.vllm_devices with rollout.backend=ray: Ray gives each actor its GPU; set "
                    "rollout.ray_num_gpus instead")
    if ro.vllm_max_model_len is not None and ro.vllm_max_model_len < ro.max_new_tokens + 1:
        found.error(f"rollout.vllm_max_model_len={ro.vllm_max_model_len}: shorter than one sequence "
                    f"(rollout.max_new_tokens + 1 = {ro.max_new_tokens + 1})")
    routes_needed = model_is_moe is not False and (rt.replay in ("r3", "pr2") or bool(rt.metrics))
    if ro.vllm_routes == "hooks" and not ro.vllm_eager and routes_needed:
        found.error("rollout.vllm_routes=hooks with rollout.vllm_eager=false: the recording hooks do not see CUDA "
                    "graphs or torch.compile'd forwards; set rollout.vllm_eager=true or rollout.vllm_routes=auto")


def check_trainer(cfg: Any, found: Findings) -> None:
    """``trainer`` with ``rollout`` and ``buffer``: mini-batches not empty (nor uneven); staleness reachable (threads
    that follow the workers need local workers: the batch source's rule,
    :func:`offpolicy_moe.sources.modes.follow_threads_problem`)."""
    ro, tr = cfg.rollout, cfg.trainer
    n_seq = ro.prompts_per_step * ro.group_size
    parts = tr.updates_per_step * tr.grad_accum
    if n_seq >= 1 and parts >= 1:
        if parts > n_seq:
            found.error(f"trainer.updates_per_step x trainer.grad_accum = {parts} exceeds the {n_seq} sequences per "
                        "step (rollout.prompts_per_step x rollout.group_size): some mini-batches would be empty")
        elif n_seq % parts:
            found.warn(f"rollout.prompts_per_step x rollout.group_size = {n_seq} is not divisible by "
                       f"trainer.updates_per_step x trainer.grad_accum = {parts}: mini-batches are uneven")
    k = cfg.buffer.staleness
    if tr.steps >= 1 and k >= 1 and k >= tr.steps:
        found.error(f"buffer.staleness={k} >= trainer.steps={tr.steps}: the trained policy reaches version "
                    f"{tr.steps - 1} at most, so a lag of {k} versions never occurs; use trainer.steps > {k}")


def check_buffer(cfg: Any, found: Findings) -> None:
    """``buffer.max_delay``: read by the bounded buffer only; above ``buffer.staleness`` it drops batches.

    In bounded mode a batch arrives ``d ~ U{0..max_delay}`` iterations after it was generated and is dropped when the
    trainer has moved more than ``k = buffer.staleness`` versions past it, so whatever ``max_delay`` is, no batch is
    trained more than ``k`` versions stale: delays above ``k`` show as drops (``offpolicy/dropped``), not as
    staleness."""
    b = cfg.buffer
    if b.max_delay is None:
        return
    if b.max_delay > b.staleness:
        found.warn(f"buffer.max_delay={b.max_delay} > buffer.staleness={b.staleness}: a batch that arrives after the "
                   f"trainer has moved more than {b.staleness} versions past it is dropped (offpolicy/dropped), so "
                   f"no batch is trained more than {b.staleness} versions stale; raise buffer.staleness for staler "
                   "data")


#: ``key: (the key that switches it on, the predicate of that key's value, what it says)``: a key set away from its
#: default while the predicate is false is not read by the run (:func:`check_unread` warns)
UNREAD_UNLESS: dict[str, tuple[str, Any, str]] = {
    **{f"algo.correction.{k}": ("algo.correction.mode", lambda v: v != "none", "a correction mode")
       for k in ("level", "high", "low", "opsm_delta")},
    "algo.kl.kind": ("algo.kl.coef", lambda v: v > 0, "algo.kl.coef > 0"),
    **{f"algo.routing.{k}": ("algo.routing.replay", lambda v: v == "pr2", "algo.routing.replay=pr2")
       for k in ("pr2_lr_mult", "pr2_feature_sample_rate", "pr2_bias_in_weights")},
    **{f"task.{k}": ("task.name", lambda v: v == "longtail", "task.name=longtail")
       for k in ("max_terms", "length_tail", "estimate_share")},
    **{f"eval.{k}": ("eval.samples", lambda v: v > 0, "eval.samples > 0 (sampled evaluation)")
       for k in ("temperature", "top_p", "top_k", "seed")},
}


def _get(obj: Any, key: str) -> Any:
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check_unread(cfg: Any, found: Findings) -> None:
    """A key of :data:`UNREAD_UNLESS` set away from its default while its switch is off: a warning naming both, so
    that an option is never silently ignored."""
    default = type(cfg)()
    for key, (switch, on, needs) in UNREAD_UNLESS.items():
        value = _get(cfg, key)
        if value != _get(default, key) and not on(_get(cfg, switch)):
            found.warn(f"{key}={value} has no effect with {switch}={_get(cfg, switch)}: it is read only with "
                       f"{needs}")


def check_optim(cfg: Any, found: Findings) -> None:
    """``optim.betas``: two values in [0, 1) (the scalar keys are covered by their declared ranges)."""
    betas = tuple(cfg.optim.betas)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        found.error(f"optim.betas: expected two values in [0, 1), got {list(betas)}")


def _known_experts(name: str) -> bool:
    """``auto`` and ``eager`` without importing transformers; any other name is looked up in its kernels."""
    return name in EXPERTS_OWN or name in models.experts_implementations()


def check_model(cfg: Any, found: Findings, model_is_moe: Optional[bool]) -> None:
    """``model``: a known experts implementation; a built-in preset's shape can be built; ``model.path`` is not a
    placeholder; trained weights are not float16 (the trainer does no loss scaling: the warm start's first step gave a NaN loss)."""
    m = cfg.model
    if m.dtype in ("float16", "fp16"):
        found.error("model.dtype=float16: the trainer keeps no loss scale, so float16 training weights underflow "
                    "(NaN at the first step); use bfloat16 or float32 (rollout.dtype=float16 is fine for the engine)")
    if not _known_experts(m.experts_implementation):
        found.error(f"model.experts_implementation: unknown value {m.experts_implementation!r}; expected one of "
                    f"{', '.join(models.experts_implementations())}")
    if m.experts_implementation in BF16_ONLY_EXPERTS:
        bad = [f"{k}={v}" for k, v in (("model.dtype", m.dtype), ("rollout.dtype", cfg.rollout.dtype))
               if v not in ("bfloat16", "bf16")]
        if bad:
            found.error(f"model.experts_implementation={m.experts_implementation} runs bfloat16 hidden states only "
                        f"(the trainer's and the engine's copy), but {' and '.join(bad)}; set both to bfloat16 or "
                        "use another experts implementation")
    if m.path is None:
        if m.preset not in PRESET_NAMES:
            found.error(f"model.preset: unknown preset {m.preset!r}; expected one of {', '.join(sorted(PRESET_NAMES))} "
                        "or set model.path")
        if model_is_moe is not False and m.num_experts >= 1 and m.top_k >= 1:
            if m.num_experts < 2:
                found.error(f"model.num_experts: an MoE preset needs >= 2 experts, got {m.num_experts}")
            elif m.top_k > m.num_experts:
                found.error(f"model.top_k: must be in [1, model.num_experts={m.num_experts}], got {m.top_k}")
        if m.hidden_size >= 1 and m.head_dim is not None and m.head_dim >= 1 and m.hidden_size % m.head_dim:
            found.error(f"model.hidden_size: the presets need a multiple of model.head_dim={m.head_dim}, "
                        f"got {m.hidden_size}")
        elif m.head_dim is not None and m.head_dim >= 1 and m.head_dim % 2:     # one problem at a time here
            found.error(f"model.head_dim: the presets' rotary position embedding rotates pairs of dimensions, so the "
                        f"head size must be even, got {m.head_dim}")
    for key, value in (("model.path", m.path), ("model.tokenizer_path", m.tokenizer_path),
                       ("task.name", cfg.task.name)):
        if isinstance(value, str) and "/path/to/" in value:
            found.error(f"{key}: {value!r} is a placeholder; set it to a real path (e.g. {key}=...)")


def check_task(cfg: Any, found: Findings) -> None:
    """``task``: the arithmetic generator's options, or a ``jsonl:<path>`` name."""
    t = cfg.task
    if t.name == "arithmetic":
        if not t.operators or set(t.operators) - set("+-*"):
            found.error(f"task.operators: must be a non-empty subset of '+-*', got {t.operators!r}")
        if t.min_digits > t.max_digits:
            found.error(f"task.min_digits/task.max_digits: need min_digits <= max_digits, got {t.min_digits}, "
                        f"{t.max_digits}")
    elif t.name in ("reverse", "chain"):
        if t.min_digits > t.max_digits:
            found.error(f"task.min_digits/task.max_digits: need min_digits <= max_digits, got {t.min_digits}, "
                        f"{t.max_digits}")
    elif t.name == "longtail":
        if (t.min_digits, t.max_digits) != (1, 1):
            found.error(f"task.min_digits/task.max_digits: the longtail task's operands are one digit (so its longest "
                        f"problem fits 256 positions), got {t.min_digits}, {t.max_digits}")
    elif t.name in ("jsonl:", "dataset:") or not t.name.startswith(("jsonl:", "dataset:")):
        found.error(f"task.name: unknown task {t.name!r}; expected arithmetic, reverse, chain, longtail, "
                    "dataset:<folder or file> or jsonl:<path>")
    check_task_rewards(cfg, found)


def check_task_rewards(cfg: Any, found: Findings) -> None:
    """``task.rewards``: a list of ``{fn, weight, name}`` entries (shape only; import paths are resolved by the
    preflight, which builds the task); ``task.prompt_column`` / ``task.answer_column`` non-empty."""
    t = cfg.task
    try:
        parse_reward_specs(t.rewards)
    except ValueError as exc:
        found.error(str(exc))
    for key in ("prompt_column", "answer_column", "split"):
        if not isinstance(getattr(t, key), str) or not getattr(t, key):
            found.error(f"task.{key}: must be a non-empty string, got {getattr(t, key)!r}")


def check_logging(cfg: Any, found: Findings) -> None:
    """``logging.loggers``: a subset of the known loggers."""
    bad = [x for x in cfg.logging.loggers if x not in LOGGERS]
    if bad:
        found.error(f"logging.loggers: unknown logger(s) {bad}; expected a subset of {', '.join(LOGGERS)}")


def infer_model_is_moe(cfg: Any) -> Optional[bool]:
    """True/False when the config tells whether the policy is MoE, else ``None``.

    ``model.path`` with a readable ``config.json``: MoE iff it declares more than one routed expert
    (:func:`offpolicy_moe.models.moe_shape`, every family's key). Built-in presets: ``*dense*`` is dense; otherwise
    ``model.num_experts > 1``.
    """
    m = cfg.model
    if m.path:
        cj = Path(m.path).expanduser() / "config.json"
        if not cj.is_file():
            return None
        try:
            hf = json.loads(cj.read_text())
        except (OSError, ValueError):
            return None
        return declares_moe(hf) if isinstance(hf, dict) else None
    if "dense" in str(m.preset):
        return False
    return m.num_experts > 1
