"""Typed schema of a training run.

Every key a user can set lives in one of these dataclasses.  YAML presets, the user's YAML and
``key=value`` overrides are merged on top of these defaults (see :mod:`offpolicy_moe.config.load`),
so a misspelt key or a wrong type fails before any compute, naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TaskConfig:
    """The procedural arithmetic task (or a local dataset on disk)."""

    name: str = "arithmetic"          # arithmetic | jsonl:<path> (prompt/answer records)
    min_digits: int = 1
    max_digits: int = 1
    num_terms: int = 3                # operands per problem (1-digit, 3 terms: 1,000 problems, SFT generalises)
    operators: str = "+"              # subset of "+-*"
    reward: str = "exact"             # exact | partial (per-digit credit)
    train_size: int = 4096
    eval_size: int = 128
    seed: int = 1234


@dataclass
class ModelConfig:
    """Which policy to train: an embedded tiny preset built from config, or a local checkpoint."""

    preset: str = "tiny-qwen3-moe"    # tiny-qwen3-moe | tiny-dense (no MoE, for refusal tests) | path
    path: Optional[str] = None        # local HF checkpoint directory (loaded offline); overrides preset
    tokenizer_path: Optional[str] = None
    num_layers: int = 2
    hidden_size: int = 64
    num_experts: int = 8
    top_k: int = 2
    dtype: str = "float32"            # trainer precision
    experts_implementation: str = "grouped_mm"
    gradient_checkpointing: bool = False


@dataclass
class RolloutConfig:
    """The rollout engine: its own copy of the policy, its own precision."""

    engine: str = "hf"
    dtype: str = "bfloat16"           # bfloat16 (realistic mismatch) | float16 | float32
    router_noise: float = 0.0         # std of Gaussian noise added to the engine's router logits
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 4           # answers of the default task are <= 2 characters, + eos
    temperature: float = 1.0
    top_p: float = 1.0
    batch_size: int = 128             # sequences per generate call
    sampler: str = "native"           # native (own KV-cache loop, shares each group's prompt prefill) | hf (model.generate)
    compact_finished: bool = True     # native sampler: finished sequences leave the decode batch
    # buffer.mode=async (docs/async.md): rollout worker processes per trainer process
    workers: int = 1
    worker_threads: int = 1           # torch threads of each worker
    update_in_flight: bool = False    # a sequence may continue across a weight update (each token keeps its version)
    on_worker_death: str = "restart"  # restart (re-issue its orders) | stop (checkpoint, then stop)
    worker_timeout_s: float = 600.0   # the longest wait for a batch / a policy version before a named timeout


@dataclass
class BufferConfig:
    """Staleness buffer (algorithms.md, 'Staleness')."""

    staleness: int = 0                # k: a batch generated at step v is consumed at step v + k
    mode: str = "fixed"               # fixed (exact delay line) | bounded (drop batches older than k) | async (workers)
    max_delay: Optional[int] = None   # bounded mode: simulated arrival latency ~ U{0..max_delay} (None = k)
    on_stale: str = "wait"            # async: a worker that would exceed k waits | drop (generate ahead, drop, redo)
    max_ahead: Optional[int] = None   # async + drop: iterations handed out beyond k (None = rollout.workers)


@dataclass
class LossConfig:
    """Policy objective and its options (algorithms.md)."""

    name: str = "grpo"                # grpo | gspo | m2po | unclipped | any registered name
    agg: Optional[str] = None         # None = the objective's default aggregation
    clip_low: Optional[float] = None  # None = the objective's default
    clip_high: Optional[float] = None
    dual_clip: Optional[float] = None
    m2po_tau: float = 0.04
    m2po_variant: str = "mask"        # mask | adaptive_clip
    m2po_scope: str = "global"        # global | local
    adv_norm: str = "std"             # std | none
    norm_length: Optional[int] = None # seq-mean-token-sum-norm constant (default: max_new_tokens)


@dataclass
class CorrectionConfig:
    """Train/inference mismatch correction weights (TIS / MIS / IcePop)."""

    mode: str = "none"                # none | truncate | mask
    level: str = "token"              # token | sequence | geometric
    high: float = 2.0
    low: Optional[float] = None


@dataclass
class RoutingConfig:
    """Routing mechanism for MoE policies."""

    replay: str = "none"              # none | r2 | r3 | pr2
    pr2_lr_mult: float = 3.0          # predictor lr = lr x this; the paper uses 1e3 with a policy lr of 1e-6
    pr2_bias_in_weights: bool = True
    pr2_feature_sample_rate: float = 0.125
    metrics: bool = True              # routing mismatch metrics even without replay


@dataclass
class KLConfig:
    coef: float = 0.0
    kind: str = "k3"


@dataclass
class AlgoConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    old_logp_source: str = "trainer"  # trainer | engine (bypass) | proximal
    router_aux_loss_coef: float = 0.0


@dataclass
class OptimConfig:
    lr: float = 3e-4                  # RL lr; 1e-3 collapses the tiny default model, 3e-4 improves it
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    grad_clip: float = 1.0
    warmup_steps: int = 0
    scheduler: str = "constant"       # constant | cosine | linear


@dataclass
class TrainerConfig:
    steps: int = 100
    updates_per_step: int = 1         # optimizer updates per consumed batch (mini-batches)
    grad_accum: int = 1               # micro-batches per update
    sft_warmup_steps: int = 60        # SFT warm start -> partially solved default task (0 = none)
    sft_lr: float = 3e-3
    sft_batch_size: int = 64
    eval_every: int = 25
    log_every: int = 10
    checkpoint_every: int = 0         # 0 = only at the end
    on_nan: str = "skip"              # skip (count in actor/nan_skipped) | stop
    deterministic: bool = True
    threads: int = 0                  # 0 = torch default
    fuse_old_logp: bool = True        # on-policy single update: take old_logp from the update forward (no extra pass)
    share_prompt: bool = True         # trainer forwards run each distinct prompt once (no route replay/recording)
    keep_checkpoints: int = 2         # newest checkpoints kept (0 = all)
    min_free_mb: float = 50.0         # free disk space required in the run folder at start
    mismatch_metrics: bool = True     # recompute trainer log-probs for mismatch/* even in bypass mode
    eval_batch_size: int = 128
    export_final: bool = True         # finished run -> RUN_DIR/export (Hugging Face folder); sweeps turn it off


@dataclass
class LoggingConfig:
    loggers: list = field(default_factory=lambda: ["console", "jsonl"])
    wandb_mode: str = "offline"       # offline | online | disabled
    wandb_project: str = "offpolicy-moe"
    progress: bool = True


@dataclass
class TrainConfig:
    """A whole run."""

    seed: int = 0
    run_dir: str = "runs/default"
    preset: list = field(default_factory=list)   # names of YAML presets merged in order
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
