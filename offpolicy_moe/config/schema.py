"""Typed schema of a training run.

Every key a user can set lives in one of these dataclasses.  YAML presets, the user's YAML and
``key=value`` overrides are merged on top of these defaults (see :mod:`offpolicy_moe.config.load`),
so a misspelt key or a wrong type fails before any compute, naming the key.

Each field declares its allowed range or choices next to its default (:func:`~offpolicy_moe.config.ranges.ranged`);
:func:`offpolicy_moe.config.validate.validate` checks them all, and that every number is finite, generically.
Vocabularies owned elsewhere are imported from their owners' torch-free ``vocabulary`` modules: KL kinds and
correction modes and levels (``losses.vocabulary``), reward kinds and task options (``tasks.vocabulary``), dtypes
(``models.vocabulary``); the settings a task carries for other keys come from ``tasks.settings``.  Importing the
schema imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from offpolicy_moe.config.ranges import ranged
from offpolicy_moe.losses.vocabulary import CORRECTION_LEVELS, CORRECTION_MODES, KL_KINDS
from offpolicy_moe.models.vocabulary import DTYPE_NAMES
from offpolicy_moe.tasks.settings import task_settings
from offpolicy_moe.tasks.vocabulary import ANSWER_FORMATS, CHAT_TEMPLATE_MODES, ON_REWARD_ERROR, REWARD_KINDS

# Vocabularies this package's config owns (no other module defines them).
REPLAY_MODES = ("none", "r2", "r3", "pr2")
OLD_LOGP_SOURCES = ("trainer", "engine", "proximal")
BUFFER_MODES = ("fixed", "bounded", "async", "stream")
STALE_POLICIES = ("wait", "drop")       # buffer.mode=async (docs/async.md)
ADMISSION_RULES = ("deadline", "first_finished")    # buffer.mode=stream: which complete groups a step trains
WORKER_DEATH = ("restart", "stop")
SAMPLERS = ("native", "hf")
DECODE_ATTENTION = ("single_query", "sdpa")
DECODE_FORWARD = ("lean", "model")
SCHEDULERS = ("constant", "cosine", "linear")
ON_NAN = ("skip", "stop")
DYNAMIC_SAMPLING = ("none", "drop")       # DAPO's dynamic sampling: drop groups whose rewards do not vary
PROXIMAL_LOGP = ("exact", "loglinear")    # decoupled PPO's proximal log-probs: a pass, or AReaL's approximation
WANDB_MODES = ("offline", "online", "disabled")
VLLM_ROUTES = ("auto", "native", "hooks")  # engine=vllm: where the routes come from (rollout/vllm_start.py)
LOGGERS = ("console", "jsonl", "wandb")


@dataclass
class TaskConfig:
    """The procedural arithmetic task (or a local dataset on disk)."""

    # arithmetic | reverse (digit strings, long answers) | chain (sums with worked steps, long answers) |
    # longtail (chain sums, a long-tailed number of terms) | dataset:<folder or file> | jsonl:<path> (docs/tasks.md)
    name: str = "arithmetic"
    min_digits: int = ranged(1, ge=1)
    max_digits: int = ranged(1, ge=1)
    # operands per problem (1-digit, 3 terms: 1,000 problems, SFT generalises)
    num_terms: int = ranged(3, ge=2)
    # longtail: the most terms of a problem, the tail's reach (6, 8, 11: max/median reference length 2.4, 4.4, 8.5)
    max_terms: int = ranged(15, ge=5, le=15)
    # longtail: alpha of the truncated Zipf law of the number of terms, P(n) ~ (n - 3) ** -alpha (0: uniform)
    length_tail: float = ranged(2.0, ge=0)
    # longtail: the share of the SFT warm start's demonstrations whose teacher estimates (sum to tens, "=20"), not works
    estimate_share: float = ranged(0.0, ge=0, lt=1)
    operators: str = "+"              # subset of "+-*"
    reward: str = ranged("exact", choices=REWARD_KINDS)            # exact | partial (per-digit credit) | math
    train_size: int = ranged(4096, ge=1)
    eval_size: int = ranged(128, ge=1)
    seed: int = ranged(1234, ge=0, lt=2**32)
    # reward functions summed with weights, replacing `reward`: [{fn: "pkg.module:function" | "file.py:function" |
    # exact | partial | math, weight: 1.0, name: optional}, ...]; each logged as reward/<name>
    rewards: list = ranged(default_factory=list)
    on_reward_error: str = ranged("stop", choices=ON_REWARD_ERROR)  # stop (checkpoint, stop) | zero (score 0, count)
    math_timeout_s: float = ranged(5.0, gt=0)      # per-pair deadline of the `math` reward's math-verify process
    chat_template: str = ranged("auto", choices=CHAT_TEMPLATE_MODES)  # auto (if the tokenizer has one) | none
    # dataset:/jsonl: tasks
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    answer_format: str = ranged("plain", choices=ANSWER_FORMATS)   # plain | gsm8k (reference = text after ####)
    split: str = "train"
    eval_split: Optional[str] = ranged(None, optional=True)        # a named held-out split, else held out from split
    eval_fraction: float = ranged(0.0, ge=0, lt=1)  # > 0: hold out this fraction of the prompts (else eval_size)


# model.head_dim when the config leaves it out: the embedded model's, and its variant for rollout.engine=vllm
EMBEDDED_HEAD_DIM = 16
VLLM_HEAD_DIM = 32


@dataclass
class ModelConfig:
    """Which policy to train: an embedded tiny preset built from config, or a local checkpoint."""

    preset: str = "tiny-qwen3-moe"    # tiny-qwen3-moe | tiny-dense (no MoE, for refusal tests) | path
    path: Optional[str] = None        # local HF checkpoint directory (loaded offline); overrides preset
    tokenizer_path: Optional[str] = None
    num_layers: int = ranged(2, ge=1)
    hidden_size: int = ranged(64, ge=1)
    # attention head size of the presets; left out: 16, or 32 with rollout.engine=vllm (the smallest head vLLM's CPU
    # attention serves), resolved when the config loads
    head_dim: Optional[int] = ranged(None, ge=1, optional=True)
    num_experts: int = ranged(8, ge=1)
    top_k: int = ranged(2, ge=1)
    dtype: str = ranged("float32", choices=DTYPE_NAMES)           # trainer precision
    # auto (models/experts.py: the per-expert loop for large CPU calls, grouped_mm otherwise) | eager | a transformers name
    experts_implementation: str = "auto"
    gradient_checkpointing: bool = False


@dataclass
class RolloutConfig:
    """The rollout engine: its own copy of the policy, its own precision."""

    engine: str = "hf"                # a name in the rollout engine registry (offpolicy_moe.rollout.engine)
    dtype: str = ranged("bfloat16", choices=DTYPE_NAMES)          # bfloat16 (realistic mismatch) | float16 | float32
    router_noise: float = ranged(0.0, ge=0)        # std of Gaussian noise added to the engine's router logits
    # a FIXED perturbation of the engine's router weights (a systematic engine/trainer mismatch, as a different
    # kernel would give): logit offset h dW^T with dW ~ N(0, router_perturb^2 / H), seeded by `seed`
    router_perturb: float = ranged(0.0, ge=0)
    prompts_per_step: int = ranged(16, ge=1)
    group_size: int = ranged(8, ge=1)
    # the most tokens generated per response, eos included (the greedy evaluation generates as many); left out
    # (null): the task's own (tasks/settings.py: its longest reference + eos, at least 4; 4 for the default task and
    # a dataset on disk), resolved when the config loads, so a loaded config always holds a number (validation
    # refuses a null set afterwards)
    max_new_tokens: Optional[int] = ranged(None, ge=1)
    temperature: float = ranged(1.0, gt=0)
    top_p: float = ranged(1.0, gt=0, le=1)
    top_k: int = ranged(0, ge=0)                   # sample among the k most likely tokens (0: off), before top-p
    batch_size: int = ranged(128, ge=1)            # sequences per generate call
    # native (own KV-cache loop, shares each group's prompt prefill) | hf (model.generate)
    sampler: str = ranged("native", choices=SAMPLERS)
    compact_finished: bool = True     # native sampler: finished sequences leave the decode batch
    # native sampler on an "sdpa" model: single_query (decode steps as two batched matmuls, rollout/decode_attention.py)
    # | sdpa (transformers' kernel for every step)
    decode_attention: str = ranged("single_query", choices=DECODE_ATTENTION)
    # native sampler, stream slots and greedy evaluation: lean (decode steps without transformers' per-call layers
    # where the family is mirrored, bit-identical logits; rollout/decode_step.py) | model (model(...) every step)
    decode_forward: str = ranged("lean", choices=DECODE_FORWARD)
    # buffer.mode=async (docs/async.md): rollout worker processes per trainer process
    workers: int = ranged(1, ge=1)
    worker_threads: int = ranged(1, ge=1)          # torch threads of each worker
    # start the workers when the trainer first publishes its weights (they start while the trainer evaluates
    # step 0), and local workers' fork server as soon as the config is valid (sources/fork_server.py); false: at
    # the first batch request, after that evaluation
    early_start: bool = True
    # a sequence may continue across a weight update (each token keeps the version that sampled it)
    update_in_flight: bool = False
    # buffer.mode=stream: rows each worker decodes at once (continuous batching: a finished row's slot takes the
    # next sample at once; with rollout.engine=vllm, vLLM's max_num_seqs)
    stream_slots: int = ranged(64, ge=1)
    # restart (re-issue its iterations) | stop (checkpoint, then stop)
    on_worker_death: str = ranged("restart", choices=WORKER_DEATH)
    # the longest wait for a batch / a policy version before a timeout that names it
    worker_timeout_s: float = ranged(600.0, gt=0)
    # the trainer publishes its weights to generation every n trained steps (1 = every step); between
    # publications generation keeps the last published version, so batches are up to n - 1 versions staler
    publish_every: int = ranged(1, ge=1)
    # buffer.mode=async: where the rollout workers run: local (processes on this machine) | ray (actors on the Ray
    # cluster of rollout.ray_address, else RAY_ADDRESS, else ray.init()'s default; docs/scale-out.md)
    backend: str = ranged("local", choices=("local", "ray"))
    ray_address: Optional[str] = ranged(None, optional=True)       # e.g. "10.0.0.1:6379" (ray start --head)
    # backend=ray, a rollout node lost: continue (with the remaining actors) | stop (checkpoint, then stop)
    ray_on_node_loss: str = ranged("continue", choices=("continue", "stop"))
    # engine=vllm (docs/engines.md): the engine's KV cache (MiB of CPU memory, or of GPU memory on a GPU)
    vllm_kv_cache_mib: int = ranged(256, ge=16)
    vllm_eager: bool = True           # engine=vllm: no torch.compile / CUDA graphs (fast start; False on GPUs)
    # engine=vllm: after each weight sync, the engine's log-probs of a fixed probe are held against the trainer's
    # on the synced tensors, within a bound its precision allows (rollout/vllm_probe.py); a miss fails the sync
    vllm_check_sync: bool = True
    # engine=vllm on a GPU: the share of the device's memory the engine may take (vLLM refuses to start with less free)
    vllm_gpu_memory_utilization: float = ranged(0.5, gt=0, le=1)
    # engine=vllm: the longest sequence (prompt + response) it serves; None: the model's max_position_embeddings,
    # capped at what the KV cache (vllm_kv_cache_mib) holds
    vllm_max_model_len: Optional[int] = ranged(None, ge=2, optional=True)
    # engine=vllm: auto (vLLM's own routed_experts where this build returns them, else hooks in its worker) | native
    # | hooks
    vllm_routes: str = ranged("auto", choices=VLLM_ROUTES)
    # engine=vllm: the GPUs (as the trainer sees them) its engines take, engine of slot s on devices[s % len]
    # (rollout/devices.py); empty: every GPU the trainer sees
    vllm_devices: list = field(default_factory=list)
    # backend=ray: GPUs each rollout actor asks Ray for; None: 1 with engine=vllm when the trainer sees CUDA, else 0
    ray_num_gpus: Optional[float] = ranged(None, ge=0, optional=True)


@dataclass
class BufferConfig:
    """Staleness buffer (docs/algorithms.md, 'Staleness')."""

    staleness: int = ranged(0, ge=0)               # k: a batch generated at step v is consumed at step v + k
    # fixed (exact delay line) | bounded (drop batches older than k) | async (rollout worker processes) | stream
    # (workers with continuous batching, groups trained as they complete, weights loaded between tokens)
    mode: str = ranged("fixed", choices=BUFFER_MODES)
    # bounded mode: simulated arrival latency ~ U{0..max_delay} (None = k)
    max_delay: Optional[int] = ranged(None, ge=0, optional=True)
    # async: a worker that would exceed k waits | drop (generate ahead, drop stale batches, generate them again)
    on_stale: str = ranged("wait", choices=STALE_POLICIES)
    # async + drop: iterations handed out beyond k (None = rollout.workers)
    max_ahead: Optional[int] = ranged(None, ge=0, optional=True)
    # stream: deadline (the groups issued first, waiting for a late long one; none dropped) | first_finished (the
    # first complete groups; a group past the bound is dropped: the naive rule, biased to short answers)
    admission: str = ranged("deadline", choices=ADMISSION_RULES)


@dataclass
class LossConfig:
    """Policy objective and its options (docs/algorithms.md, docs/losses.md)."""

    name: str = "grpo"                # grpo | gspo | m2po | cispo | unclipped | any registered name
    agg: Optional[str] = None         # None = the objective's default aggregation
    # the loss's own options, checked against its signature (offpolicy_moe.losses.resolve_loss_options), e.g.
    # grpo {clip_low, clip_high, dual_clip}, m2po {tau, variant, scope}; a missing or null key = the loss's default
    options: dict[str, Any] = field(default_factory=dict)
    adv_norm: str = "std"             # std | none
    norm_length: Optional[int] = None # seq-mean-token-sum-norm constant (default: max_new_tokens)


@dataclass
class CorrectionConfig:
    """Train/inference mismatch correction weights (TIS / MIS / IcePop)."""

    mode: str = ranged("none", choices=("none", *CORRECTION_MODES))
    level: str = ranged("token", choices=CORRECTION_LEVELS)             # token | sequence | geometric
    high: float = ranged(2.0, gt=0)
    low: Optional[float] = ranged(None, ge=0, optional=True)
    # OPSM (off-policy sequence masking): with mode=opsm the KL threshold (None = 1e-4); with truncate or mask a
    # number adds the OPSM mask on top of those weights
    opsm_delta: Optional[float] = ranged(None, ge=0, optional=True)


@dataclass
class RoutingConfig:
    """Routing mechanism for MoE policies."""

    replay: str = ranged("none", choices=REPLAY_MODES)             # none | r2 | r3 | pr2
    # predictor lr = lr x this; the paper uses 1e3 with a policy lr of 1e-6
    pr2_lr_mult: float = ranged(3.0, gt=0)
    pr2_bias_in_weights: bool = True
    pr2_feature_sample_rate: float = ranged(0.125, gt=0, le=1)
    metrics: bool = True              # routing mismatch metrics even without replay
    # drift/*: the engine's recorded route vs the current router's own top-k at every off-policy mini-step
    drift_metrics: bool = False


@dataclass
class KLConfig:
    coef: float = ranged(0.0, ge=0)
    kind: str = ranged("k3", choices=KL_KINDS)


@dataclass
class AlgoConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    old_logp_source: str = ranged("trainer", choices=OLD_LOGP_SOURCES) # trainer | engine (bypass) | proximal
    router_aux_loss_coef: float = ranged(0.0, ge=0)
    # DAPO (arXiv 2503.14476): rows of groups whose rewards are all equal (zero advantage) leave the batch, and
    # the loss's token and sequence counts (drop); none keeps them
    dynamic_sampling: str = ranged("none", choices=DYNAMIC_SAMPLING)
    # old_logp_source=proximal: the proximal log-probs from a no-grad pass under the weights at consumption
    # (exact), or AReaL's log-linear interpolation between behaviour and current log-probs by version
    # (loglinear, arXiv 2505.24298), which needs no pass and is exact on the first update of a batch
    proximal_logp: str = ranged("exact", choices=PROXIMAL_LOGP)


@dataclass
class OptimConfig:
    lr: float = ranged(3e-4, gt=0)                 # RL lr; 1e-3 collapses the tiny default model, 3e-4 improves it
    weight_decay: float = ranged(0.0, ge=0)
    betas: tuple = (0.9, 0.999)
    grad_clip: float = ranged(1.0, ge=0)
    warmup_steps: int = ranged(0, ge=0)
    scheduler: str = ranged("constant", choices=SCHEDULERS)      # constant | cosine | linear


@dataclass
class TrainerConfig:
    steps: int = ranged(100, ge=1)     # trained steps; a run needs at least one
    updates_per_step: int = ranged(1, ge=1)        # optimizer updates per consumed batch (mini-batches)
    grad_accum: int = ranged(1, ge=1)              # micro-batches per update (at least)
    # more micro-batches when one would hold more padded token positions than this (null: no cap; rollout/batch.py);
    # the no-grad passes over a whole batch (old-logp, reference) run on the same micro-batches
    micro_batch_tokens: Optional[int] = ranged(16384, ge=1, optional=True)
    # one process: a batch of uneven lengths is cut into micro-batches of rows of like length when the forward's
    # cost model says that pays (logprobs/length_buckets.py); each micro-batch's forward skips its padding columns
    length_buckets: bool = True
    sft_warmup_steps: int = ranged(60, ge=0)       # SFT warm start -> partially solved default task (0 = none)
    sft_lr: float = ranged(3e-3, gt=0)
    sft_batch_size: int = ranged(64, ge=1)
    eval_every: int = ranged(25, ge=0)
    log_every: int = ranged(10, ge=1)
    checkpoint_every: int = ranged(50, ge=0)       # also at the last step; 0 = only at the end (a stop loses the run)
    # a NaN/Inf in any stage of a step (docs/faults.md): skip (drop the batch or update, count it in
    # actor/nan_skipped and nan/<stage>) | stop (checkpoint the last finite state, status diverged)
    on_nan: str = ranged("skip", choices=ON_NAN)
    max_nan_skips: int = ranged(10, ge=1)          # on_nan=skip: this many skips in a row end the run as diverged
    deterministic: bool = True
    threads: int = ranged(0, ge=0)                 # 0 = auto (commands/threads.py: 1 per process on <= 2 cores)
    # async/stream with local workers: the threads follow the cores the workers leave idle (trainer/thread_follower.py)
    follow_threads: bool = False
    fuse_old_logp: bool = True        # on-policy single update: take old_logp from the update forward (no extra pass)
    # rows whose advantage is 0 (and no KL, PR2 or fused old-logp term) skip the update's forward and backward:
    # their policy gradient is exactly zero; token counts keep them (docs/config.md: exact up to float summation order)
    skip_zero_advantage: bool = False
    share_prompt: bool = True         # trainer forwards run each distinct prompt once (no route replay/recording)
    keep_checkpoints: int = ranged(2, ge=0)        # newest checkpoints kept (0 = all)
    min_free_mb: float = ranged(50.0, ge=0)        # free disk space required in the run folder at start
    mismatch_metrics: bool = True     # recompute trainer log-probs for mismatch/* even in bypass mode
    eval_batch_size: int = ranged(128, ge=1)
    export_final: bool = True         # finished run -> RUN_DIR/export (Hugging Face folder); sweeps turn it off


@dataclass
class EvalConfig:
    """Sampled evaluation at each evaluation (docs/evaluation.md): ``samples`` responses per held-out problem, drawn by
    the built-in engine's batched sampler and scored as avg@n, pass@k, maj@k; greedy accuracy is unchanged."""

    samples: int = ranged(0, ge=0)                 # n per held-out problem (0: off, greedy evaluation only)
    # the evaluation's own sampling settings; null: the rollout's (rollout.temperature, rollout.top_p, rollout.top_k)
    temperature: Optional[float] = ranged(None, gt=0, optional=True)
    top_p: Optional[float] = ranged(None, gt=0, le=1, optional=True)
    top_k: Optional[int] = ranged(None, ge=0, optional=True)
    # the sampler's seed: the same seed and weights give the same samples (in training and in `offpolicy-moe eval`)
    seed: int = ranged(0, ge=0, lt=2**32)


@dataclass
class LoggingConfig:
    loggers: list = field(default_factory=lambda: ["console", "jsonl"])
    wandb_mode: str = ranged("offline", choices=WANDB_MODES)      # offline | online | disabled
    wandb_project: str = "offpolicy-moe"
    progress: bool = True


@dataclass
class TrainConfig:
    """A whole run."""

    seed: int = ranged(0, ge=0, lt=2**32)   # numpy and the data loaders refuse seeds outside [0, 2^32)
    run_dir: str = "runs/default"
    preset: list = field(default_factory=list)   # names of YAML presets merged in order
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        """Resolve the keys left out (``null``) whose default depends on other keys, so a loaded config (and the
        run's saved ``config.yaml``) holds their values: ``model.head_dim`` follows the engine, and
        ``rollout.max_new_tokens`` the task (:func:`~offpolicy_moe.tasks.settings.task_settings`).  A value the config
        sets is kept as it is (the checks refuse one that cannot work)."""
        if self.model.head_dim is None:
            self.model.head_dim = VLLM_HEAD_DIM if self.rollout.engine == "vllm" else EMBEDDED_HEAD_DIM
        if self.rollout.max_new_tokens is None:
            self.rollout.max_new_tokens = task_settings(self.task).max_new_tokens
