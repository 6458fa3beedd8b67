"""Cross-field validation of a resolved :class:`~offpolicy_moe.config.schema.TrainConfig`, before any compute.

``validate(cfg, model_is_moe=None)`` raises :class:`ConfigError` (a ``ValueError``) listing EVERY violated rule,
each message naming the keys involved, and returns the list of warnings (strings) for combinations that are legal
but probably not what the user meant. ``model_is_moe`` tells whether the policy is a Mixture-of-Experts model;
``None`` infers it from the config (``model.preset``, ``model.num_experts``, or ``config.json`` of ``model.path``
when that exists) and skips the MoE rules when it cannot tell.

Rules (E = error, W = warning):

| # | keys | rule | why |
|---|------|------|-----|
| 1 | every enum-like string key (table ``ENUMS``) | value in its allowed set | typo guard (OmegaConf checks only types) |
| 2 | ``algo.loss.name`` | registered in ``offpolicy_moe.losses`` (built-ins when the registry is absent) | E |
| 3 | ``algo.loss.agg`` | ``None`` or an aggregation mode of algorithms.md | E |
| 4 | ``buffer.staleness`` | ≥ 0 | E: a delay line cannot be negative |
| 5 | ``algo.loss.m2po_tau`` | > 0 | E: τ ≤ 0 masks every trust-region token (M2PO, arXiv 2510.01161) |
| 6 | ``algo.loss.clip_low``, ``clip_high`` | ≥ 0, ``clip_low`` < 1 | E: 1 − ε_low must stay positive |
| 7 | ``algo.loss.dual_clip`` | ``None`` or > 1 | E: dual-clip constant c > 1 (Ye et al., arXiv 1912.09729) |
| 8 | ``algo.loss.name`` ∈ {m2po, unclipped} with ``clip_low``/``clip_high``/``dual_clip`` | W: ignored, these objectives do not clip |
| 9 | ``algo.correction.mode`` ≠ none with ``algo.old_logp_source`` = engine | E: bypass already makes the ratio π_θ/μ; correction weights would count the mismatch twice |
| 10 | ``algo.correction.high`` > 0, ``low`` ≥ 0, ``low`` < ``high`` | E |
| 11 | ``algo.correction.mode`` = truncate with ``high`` < 1 | W: TIS cap below 1 shrinks every weight |
| 12 | ``algo.routing.replay`` ∈ {r2, r3, pr2} on a dense model (``model_is_moe`` False) | E: nothing to replay |
| 13 | ``algo.routing.replay`` = r2 with ``algo.old_logp_source`` = engine | E: R2 records routes in the trainer's old-log-prob pass, which bypass skips |
| 14 | ``algo.routing.replay`` = r2 with ``trainer.updates_per_step`` = 1 | W: R2 only fixes drift across mini-steps (R3 paper, arXiv 2510.11370) |
| 15 | ``algo.routing.pr2_lr_mult`` > 0, ``pr2_feature_sample_rate`` ∈ (0, 1] | E |
| 16 | ``algo.loss.name`` = gspo with ``algo.loss.agg`` ∉ {None, seq-mean-token-mean} | W: token sums length-weight sequences (GSPO, arXiv 2507.18071; TRL #3823) |
| 17 | ``rollout.group_size`` < 2 with ``algo.loss.adv_norm`` = std | W: every group-normalised advantage is 0 |
| 18 | ``rollout.group_size``, ``prompts_per_step``, ``max_new_tokens``, ``batch_size`` ≥ 1 | E |
| 19 | ``rollout.temperature`` > 0, ``rollout.top_p`` ∈ (0, 1], ``rollout.router_noise`` ≥ 0 | E |
| 20 | ``rollout.router_noise`` > 0 on a dense model | W: no router to perturb |
| 21 | ``trainer.updates_per_step``, ``grad_accum``, ``log_every`` ≥ 1; ``steps``, ``eval_every``, ``checkpoint_every``, ``sft_warmup_steps`` ≥ 0 | E |
| 22 | ``trainer.updates_per_step`` × ``trainer.grad_accum`` ≤ sequences per step (``prompts_per_step`` × ``group_size``) | E: empty mini-batches |
| 23 | sequences per step divisible by ``updates_per_step`` × ``grad_accum`` | W: uneven mini-batches |
| 24 | ``buffer.staleness`` ≥ ``trainer.steps`` (> 0) | W: the first k steps only generate, so nothing is trained |
| 25 | ``optim.lr`` > 0, ``weight_decay`` ≥ 0, ``grad_clip`` ≥ 0, ``warmup_steps`` ≥ 0, ``betas`` two values in [0, 1) | E |
| 26 | ``algo.kl.coef`` ≥ 0 | E |
| 27 | ``model.top_k`` ∈ [1, ``model.num_experts``] for the built-in MoE preset | E |
| 28 | ``task.operators`` a non-empty subset of ``+-*``; ``min_digits`` ≤ ``max_digits``, both ≥ 1; ``num_terms`` ≥ 2 | E |
| 29 | ``task.name`` = arithmetic or ``jsonl:<path>``; ``model.preset`` a built-in preset unless ``model.path`` is set; ``model.path``/``task.name`` not a ``/path/to/`` placeholder | E |
| 30 | ``logging.loggers`` ⊆ {console, jsonl, wandb} | E |
| 31 | ``algo.routing.replay`` = pr2 with ``algo.loss.name`` = gspo | nothing: allowed (PR2 paper pairs it with GRPO; GSPO works too) |
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
BUILTIN_LOSSES = ("grpo", "gspo", "m2po", "unclipped")
LOGGERS = ("console", "jsonl", "wandb")

# dotted key -> allowed values (rule 1)
ENUMS: dict[str, tuple[str, ...]] = {
    "algo.routing.replay": ("none", "r2", "r3", "pr2"),
    "algo.correction.mode": ("none", "truncate", "mask"),
    "algo.correction.level": ("token", "sequence", "geometric"),
    "algo.old_logp_source": ("trainer", "engine", "proximal"),
    "algo.loss.m2po_variant": ("mask", "adaptive_clip"),
    "algo.loss.m2po_scope": ("global", "local"),
    "algo.loss.adv_norm": ("std", "none"),
    "algo.kl.kind": ("k1", "k2", "k3", "k3+"),
    "buffer.mode": ("fixed", "bounded", "async"),
    "buffer.on_stale": ("wait", "drop"),
    "rollout.on_worker_death": ("restart", "stop"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "rollout.dtype": ("float32", "bfloat16", "float16"),
    "rollout.engine": ("hf",),
    "rollout.sampler": ("native", "hf"),
    "task.reward": ("exact", "partial"),
    "optim.scheduler": ("constant", "cosine", "linear"),
    "trainer.on_nan": ("skip", "stop"),
    "logging.wandb_mode": ("offline", "online", "disabled"),
}


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending keys (and the file or override)."""


def validate(cfg: Any, *, model_is_moe: Optional[bool] = None) -> list[str]:
    """Check the cross-field rules of the module docstring table.

    Returns the warnings (strings naming their keys). Raises :class:`ConfigError` listing every error found.
    """
    errors: list[str] = []
    warnings: list[str] = []
    E, W = errors.append, warnings.append
    a, loss, corr, rt = cfg.algo, cfg.algo.loss, cfg.algo.correction, cfg.algo.routing
    if model_is_moe is None:
        model_is_moe = infer_model_is_moe(cfg)

    # 1. enums
    for key, allowed in ENUMS.items():
        value = _get(cfg, key)
        if value not in allowed:
            E(f"{key}: unknown value {value!r}; expected one of {', '.join(allowed)}")

    # 2./3. loss name and aggregation
    if not _loss_is_registered(loss.name):
        E(f"algo.loss.name: unknown loss {loss.name!r}; registered: {', '.join(sorted(_registered_losses()))}")
    if loss.agg is not None and loss.agg not in AGG_MODES:
        E(f"algo.loss.agg: unknown aggregation {loss.agg!r}; expected one of {', '.join(AGG_MODES)} (or null)")

    # 4.-8. objective parameters
    if cfg.buffer.staleness < 0:
        E(f"buffer.staleness: must be >= 0, got {cfg.buffer.staleness}")
    if not loss.m2po_tau > 0:
        E(f"algo.loss.m2po_tau: the M2 budget tau must be > 0, got {loss.m2po_tau}")
    for name in ("clip_low", "clip_high"):
        v = getattr(loss, name)
        if v is not None and v < 0:
            E(f"algo.loss.{name}: clip ranges must be >= 0, got {v}")
    if loss.clip_low is not None and loss.clip_low >= 1:
        E(f"algo.loss.clip_low: must be < 1 (the lower bound 1 - clip_low must stay positive), got {loss.clip_low}")
    if loss.dual_clip is not None and not loss.dual_clip > 1:
        E(f"algo.loss.dual_clip: the dual-clip constant must be > 1 (or null), got {loss.dual_clip}")
    if loss.name in ("m2po", "unclipped"):
        set_clips = [n for n in ("clip_low", "clip_high", "dual_clip") if getattr(loss, n) is not None]
        if set_clips:
            W(f"algo.loss.{'/'.join(set_clips)}: ignored with algo.loss.name={loss.name} (no ratio clipping)")

    # 9.-11. mismatch correction
    if corr.mode != "none" and a.old_logp_source == "engine":
        E(
            f"algo.correction.mode={corr.mode} with algo.old_logp_source=engine (bypass): the PPO ratio is already "
            "pi_theta/mu, so TIS/MIS weights would correct the mismatch twice; use old_logp_source=trainer or "
            "correction.mode=none"
        )
    if not corr.high > 0:
        E(f"algo.correction.high: must be > 0, got {corr.high}")
    if corr.low is not None:
        if corr.low < 0:
            E(f"algo.correction.low: must be >= 0 (or null), got {corr.low}")
        elif corr.low >= corr.high:
            E(f"algo.correction.low ({corr.low}) must be < algo.correction.high ({corr.high})")
    if corr.mode == "truncate" and 0 < corr.high < 1:
        W(f"algo.correction.high={corr.high} < 1 with correction.mode=truncate: every TIS weight is capped below 1")

    # 12.-15. routing
    if rt.replay in ("r2", "r3", "pr2") and model_is_moe is False:
        E(
            f"algo.routing.replay={rt.replay} needs a Mixture-of-Experts model, but the model is dense "
            f"(model.preset={cfg.model.preset!r}, model.path={cfg.model.path!r})"
        )
    if rt.replay == "r2" and a.old_logp_source == "engine":
        E(
            "algo.routing.replay=r2 with algo.old_logp_source=engine: R2 records routes in the trainer's "
            "old-log-prob pass, which bypass mode skips; use old_logp_source=trainer, or replay=r3"
        )
    if rt.replay == "r2" and cfg.trainer.updates_per_step == 1:
        W("algo.routing.replay=r2 with trainer.updates_per_step=1: R2 only fixes routing drift across mini-steps")
    if not rt.pr2_lr_mult > 0:
        E(f"algo.routing.pr2_lr_mult: must be > 0, got {rt.pr2_lr_mult}")
    if not 0 < rt.pr2_feature_sample_rate <= 1:
        E(f"algo.routing.pr2_feature_sample_rate: must be in (0, 1], got {rt.pr2_feature_sample_rate}")

    # 16.-17. aggregation and advantages
    if loss.name == "gspo" and loss.agg not in (None, "seq-mean-token-mean"):
        W(
            f"algo.loss.agg={loss.agg} with algo.loss.name=gspo: token-level sums weight each sequence by its "
            "length; GSPO is defined with seq-mean-token-mean"
        )
    ro = cfg.rollout
    if ro.group_size < 2 and loss.adv_norm == "std":
        W(f"rollout.group_size={ro.group_size} with algo.loss.adv_norm=std: every group advantage is 0")

    # 18.-20. rollout
    for name in ("group_size", "prompts_per_step", "max_new_tokens", "batch_size"):
        if getattr(ro, name) < 1:
            E(f"rollout.{name}: must be >= 1, got {getattr(ro, name)}")
    if not ro.temperature > 0:
        E(f"rollout.temperature: must be > 0, got {ro.temperature}")
    if not 0 < ro.top_p <= 1:
        E(f"rollout.top_p: must be in (0, 1], got {ro.top_p}")
    if ro.router_noise < 0:
        E(f"rollout.router_noise: must be >= 0, got {ro.router_noise}")
    elif ro.router_noise > 0 and model_is_moe is False:
        W("rollout.router_noise > 0 on a dense model has no effect")

    # 21.-24. trainer
    tr = cfg.trainer
    for name in ("updates_per_step", "grad_accum", "log_every"):
        if getattr(tr, name) < 1:
            E(f"trainer.{name}: must be >= 1, got {getattr(tr, name)}")
    for name in ("steps", "eval_every", "checkpoint_every", "sft_warmup_steps"):
        if getattr(tr, name) < 0:
            E(f"trainer.{name}: must be >= 0, got {getattr(tr, name)}")
    n_seq = ro.prompts_per_step * ro.group_size
    parts = tr.updates_per_step * tr.grad_accum
    if n_seq >= 1 and parts >= 1:
        if parts > n_seq:
            E(
                f"trainer.updates_per_step x trainer.grad_accum = {parts} exceeds the {n_seq} sequences per step "
                f"(rollout.prompts_per_step x rollout.group_size): some mini-batches would be empty"
            )
        elif n_seq % parts:
            W(
                f"rollout.prompts_per_step x rollout.group_size = {n_seq} is not divisible by "
                f"trainer.updates_per_step x trainer.grad_accum = {parts}: mini-batches are uneven"
            )
    if tr.steps > 0 and cfg.buffer.staleness >= tr.steps:
        W(f"buffer.staleness={cfg.buffer.staleness} >= trainer.steps={tr.steps}: the first k steps only generate")

    # 25.-26. optimiser, KL
    op = cfg.optim
    if not op.lr > 0:
        E(f"optim.lr: must be > 0, got {op.lr}")
    for name in ("weight_decay", "grad_clip", "warmup_steps"):
        if getattr(op, name) < 0:
            E(f"optim.{name}: must be >= 0, got {getattr(op, name)}")
    betas = tuple(op.betas)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        E(f"optim.betas: expected two values in [0, 1), got {list(betas)}")
    if a.kl.coef < 0:
        E(f"algo.kl.coef: must be >= 0, got {a.kl.coef}")

    # 27. model
    m = cfg.model
    if m.path is None and model_is_moe is not False:
        if m.num_experts < 1:
            E(f"model.num_experts: must be >= 1, got {m.num_experts}")
        elif not 1 <= m.top_k <= m.num_experts:
            E(f"model.top_k: must be in [1, model.num_experts={m.num_experts}], got {m.top_k}")
    for name in ("num_layers", "hidden_size"):
        if getattr(m, name) < 1:
            E(f"model.{name}: must be >= 1, got {getattr(m, name)}")

    # 28.-29. task, placeholders
    t = cfg.task
    if t.name == "arithmetic":
        if not t.operators or set(t.operators) - set("+-*"):
            E(f"task.operators: must be a non-empty subset of '+-*', got {t.operators!r}")
        if t.min_digits < 1 or t.min_digits > t.max_digits:
            E(f"task.min_digits/task.max_digits: need 1 <= min_digits <= max_digits, got {t.min_digits}, {t.max_digits}")
        if t.num_terms < 2:
            E(f"task.num_terms: must be >= 2, got {t.num_terms}")
    elif not t.name.startswith("jsonl:") or t.name == "jsonl:":
        E(f"task.name: unknown task {t.name!r}; expected arithmetic or jsonl:<path>")
    if m.path is None and m.preset not in ("tiny-qwen3-moe", "tiny-dense") and m.preset not in _model_presets():
        E(f"model.preset: unknown preset {m.preset!r}; expected one of {', '.join(_model_presets())} or set model.path")
    for key, value in (("model.path", m.path), ("model.tokenizer_path", m.tokenizer_path), ("task.name", t.name)):
        if isinstance(value, str) and "/path/to/" in value:
            E(f"{key}: {value!r} is a placeholder; set it to a real path (e.g. {key}=...)")
    for name in ("train_size", "eval_size"):
        if getattr(t, name) < 1:
            E(f"task.{name}: must be >= 1, got {getattr(t, name)}")

    # 30. loggers
    bad = [x for x in cfg.logging.loggers if x not in LOGGERS]
    if bad:
        E(f"logging.loggers: unknown logger(s) {bad}; expected a subset of {', '.join(LOGGERS)}")

    if errors:
        head = f"invalid configuration ({len(errors)} problem{'s' if len(errors) > 1 else ''}):"
        raise ConfigError("\n  - ".join([head, *errors]))
    return warnings


def infer_model_is_moe(cfg: Any) -> Optional[bool]:
    """True/False when the config tells whether the policy is MoE, else ``None``.

    ``model.path`` with a ``config.json``: MoE iff it declares more than one expert (``num_experts``,
    ``num_local_experts`` or ``n_routed_experts``). Built-in presets: ``*dense*`` is dense; otherwise
    ``model.num_experts > 1``.
    """
    m = cfg.model
    if m.path:
        cj = Path(m.path) / "config.json"
        if not cj.is_file():
            return None
        try:
            hf = json.loads(cj.read_text())
        except (OSError, ValueError):
            return None
        for k in ("num_experts", "num_local_experts", "n_routed_experts"):
            v = hf.get(k) or (hf.get("text_config") or {}).get(k)
            if isinstance(v, int):
                return v > 1
        return False
    if "dense" in str(m.preset):
        return False
    return m.num_experts > 1


def _model_presets() -> tuple[str, ...]:
    builtin = ("tiny-qwen3-moe", "tiny-dense")
    try:
        from offpolicy_moe.models.presets import PRESETS
    except ImportError:
        return builtin
    return tuple(sorted(set(builtin) | set(PRESETS)))


def _loss_is_registered(name: str) -> bool:
    """Ask ``offpolicy_moe.losses.get_policy_loss`` when importable, else check the built-in names."""
    try:
        from offpolicy_moe.losses import get_policy_loss
    except ImportError:
        return name in _registered_losses()
    try:
        get_policy_loss(name)
    except (KeyError, ValueError, LookupError):
        return False
    return True


def _registered_losses() -> set[str]:
    try:
        from offpolicy_moe import losses as L  # floor 1; may not exist in a partial build
    except ImportError:
        return set(BUILTIN_LOSSES)
    for attr in ("available_policy_losses", "list_policy_losses", "registered_policy_losses"):
        fn = getattr(L, attr, None)
        if callable(fn):
            try:
                return set(fn())
            except Exception:  # noqa: BLE001 - fall through to the registry dict
                pass
    reg = getattr(L, "POLICY_LOSS_REGISTRY", None)
    if isinstance(reg, dict) and reg:
        return set(reg)
    return set(BUILTIN_LOSSES)


def _get(cfg: Any, dotted: str) -> Any:
    cur = cfg
    for part in dotted.split("."):
        cur = getattr(cur, part)
    return cur
