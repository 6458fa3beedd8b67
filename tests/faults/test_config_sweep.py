"""Issue 31, item 3: a config value that ``validate`` (and the start-up checks) accept must start a one-step run.

Each example sets ONE key of the schema to a value inside its declared range (``ranged(...)`` in
offpolicy_moe/config/schema.py, the loss keys of ``validate.LOSS_RULES``, every choice of an enumerated key) on top
of the tiny one-step job, then runs the CLI's checks and, if they accept it, the run itself in this process.  A
value is fine when it is refused before compute in one line (``ConfigError`` / ``RunDirError``), or the run
completes, or the run ends as ``diverged`` through the non-finite policy (e.g. ``optim.lr=1e30``: that is the
policy working, not a crash).  Anything else (a traceback from inside the run) is a key validation must refuse.

Sizes are drawn near the bottom of their range (a one-step run must stay a second or two); magnitudes of floats
without an upper bound span 1e-30 .. 1e30.  Keys left out, and why: ``run_dir``, ``preset``, ``model.path``,
``model.tokenizer_path``, ``task.name``, ``task.rewards``, the dataset column names (files and modules: the
preflight's business, tests/config); ``rollout.ray_address``, ``rollout.backend`` (a Ray cluster);
``buffer.mode=async`` and the keys only it reads (``rollout.workers``, ``worker_threads``, ``worker_timeout_s``,
``on_worker_death``, ``update_in_flight``, ``buffer.on_stale``, ``max_ahead``: worker processes, tests/sources);
``logging.*`` and ``trainer.threads`` (no effect on what is computed).

The default variant draws a few derandomised examples; ``-m slow`` runs every key's range boundaries and every
choice, then many random examples.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offpolicy_moe.config.load import load_config
from offpolicy_moe.config.ranges import Rule, declared_rules
from offpolicy_moe.config.schema import TrainConfig
from offpolicy_moe.config.validate import LOSS_RULES, ConfigError, vocabularies
from offpolicy_moe.run.faults import RunDirError
from offpolicy_moe.run.nonfinite import NonFiniteError
from tests.tiny import TINY

ONE_STEP = [*TINY, "trainer.steps=1", "trainer.threads=1", "trainer.checkpoint_every=0", "trainer.export_final=false"]

SKIPPED = {"run_dir", "preset", "model.path", "model.tokenizer_path", "task.name", "task.rewards", "task.split",
           "task.eval_split", "task.prompt_column", "task.answer_column", "rollout.ray_address", "rollout.backend",
           "buffer.mode", "rollout.workers", "rollout.worker_threads", "rollout.worker_timeout_s",
           "rollout.on_worker_death", "rollout.update_in_flight", "rollout.ray_on_node_loss", "buffer.on_stale",
           "buffer.max_ahead", "logging.loggers", "logging.wandb_mode", "logging.wandb_project", "logging.progress",
           "trainer.threads"}
#: the largest value drawn for an integer key without an upper bound (one step must stay cheap)
INT_SPAN = {"trainer.steps": 3, "trainer.sft_warmup_steps": 2, "rollout.prompts_per_step": 8,
            "rollout.group_size": 6, "rollout.max_new_tokens": 6, "task.train_size": 12, "task.eval_size": 8,
            "model.num_layers": 2, "model.hidden_size": 96, "model.num_experts": 8, "model.top_k": 8,
            "task.num_terms": 5, "task.min_digits": 3, "task.max_digits": 3, "trainer.min_free_mb": 1}
BIG_SEEDS = {"seed", "task.seed"}


def rules() -> dict[str, Rule]:
    """Every swept key's rule."""
    out = {**declared_rules(TrainConfig), **LOSS_RULES}
    vocab = vocabularies()
    for key, values in vocab.items():
        out[key] = Rule(choices=tuple(values))
    return {k: r for k, r in out.items() if k not in SKIPPED}


def value_strategy(key: str, rule: Rule) -> st.SearchStrategy:
    """Values inside ``rule``: one of its choices, or a number within its bounds (sizes near the bottom)."""
    if rule.choices is not None:
        return st.sampled_from(rule.choices)
    base = _number_strategy(key, rule)
    return st.one_of(st.none(), base) if rule.optional else base


def _is_int(key: str) -> bool:
    return isinstance(_default(key), int) or key in ("buffer.max_delay", "trainer.micro_batch_tokens",
                                                      "algo.loss.norm_length")


def _default(key: str) -> Any:
    obj: Any = TrainConfig()
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _number_strategy(key: str, rule: Rule) -> st.SearchStrategy:
    lo = rule.ge if rule.ge is not None else rule.gt
    hi = rule.le if rule.le is not None else rule.lt
    if _is_int(key):
        low = int(lo if rule.ge is not None else (lo or 0) + 1) if lo is not None else 0
        if key in BIG_SEEDS:
            return st.integers(low, int(hi) - 1)
        return st.integers(low, low + INT_SPAN.get(key, 4))
    low = float(lo) if lo is not None else -1e30
    if hi is not None:
        return st.floats(low, float(hi), exclude_min=rule.gt is not None, exclude_max=rule.lt is not None,
                         allow_nan=False, allow_subnormal=False)
    magnitudes = st.integers(-30, 30).map(lambda e: 10.0 ** e)
    return st.one_of(magnitudes, st.floats(low, low + 10.0, exclude_min=rule.gt is not None, allow_nan=False,
                                           allow_subnormal=False)).filter(lambda v: v > low or rule.gt is None)


def boundary_values(key: str, rule: Rule) -> list:
    """Every choice, or the range's edges (the first and last allowed values, and a huge one when unbounded)."""
    if rule.choices is not None:
        return list(rule.choices)
    lo = rule.ge if rule.ge is not None else rule.gt
    hi = rule.le if rule.le is not None else rule.lt
    out: list = [None] if rule.optional else []
    if _is_int(key):
        low = int(lo if rule.ge is not None else (lo or 0) + 1) if lo is not None else 0
        out += [low, low + 1] + ([int(hi) - (rule.lt is not None)] if hi is not None else [])
    else:
        eps = 1e-12
        low = float(lo) + (eps if rule.gt is not None else 0.0) if lo is not None else -1e30
        out += [low, 1e30 if hi is None else float(hi) - (eps if rule.lt is not None else 0.0)]
    return out


def outcome(key: str, value: Any, run_dir) -> Optional[str]:
    """None when ``key=value`` is refused in one line or runs one step (completed or diverged); else what went
    wrong."""
    from offpolicy_moe.trainer.checks import check_config
    from offpolicy_moe.trainer.trainer import Trainer

    cfg = load_config(None, ONE_STEP)
    cfg.run_dir = str(run_dir)
    obj, leaf = cfg, key.split(".")
    for part in leaf[:-1]:
        obj = getattr(obj, part)
    setattr(obj, leaf[-1], value)
    try:
        checked = check_config(cfg)
    except (ConfigError, RunDirError) as exc:
        return None if "\n" not in str(exc) else f"refused in several lines: {exc}"
    try:
        summary = Trainer(cfg, checked=checked).run()
    except NonFiniteError:
        return None
    except (ConfigError, RunDirError):
        return None
    except Exception as exc:     # noqa: BLE001 - the finding
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None if summary["status"] == "completed" else f"status {summary['status']}"


RULES = rules()
PAIRS = st.sampled_from(sorted(RULES)).flatmap(lambda k: st.tuples(st.just(k), value_strategy(k, RULES[k])))


def test_the_sweep_covers_the_schema():
    assert {"optim.lr", "trainer.max_nan_skips", "rollout.top_p", "algo.loss.name", "seed"} <= set(RULES)
    assert "rollout.workers" not in RULES
    for key, rule in RULES.items():
        for v in boundary_values(key, rule):
            assert rule.problem(v) is None, (key, v)


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(pair=PAIRS)
def test_every_accepted_value_runs_one_step(pair, tmp_path_factory):
    key, value = pair
    assert outcome(key, value, tmp_path_factory.mktemp("sweep") / "run") is None, f"{key}={value!r}"


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(RULES))
def test_every_boundary_value_runs_one_step(key, tmp_path):
    bad = {repr(v): outcome(key, v, tmp_path / f"run{i}") for i, v in enumerate(boundary_values(key, RULES[key]))}
    assert not {v: why for v, why in bad.items() if why}, key


@pytest.mark.slow
@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(pair=PAIRS)
def test_every_accepted_value_runs_one_step_exhaustive(pair, tmp_path_factory):
    key, value = pair
    assert outcome(key, value, tmp_path_factory.mktemp("sweep") / "run") is None, f"{key}={value!r}"


def test_nan_is_never_drawn():
    assert not any(isinstance(v, float) and math.isnan(v) for k, r in RULES.items() for v in boundary_values(k, r))


def test_caught_experts_kernels_are_refused_before_compute_naming_the_key():
    # found by the boundary sweep: both passed validation, then the first forward raised inside transformers
    # (deepgemm: "requires bfloat16 hidden states"; sonicmoe: "requires the `kernels` package")
    import torch

    from offpolicy_moe.config.validate import validate
    from offpolicy_moe.trainer.checks import check_config

    cfg = TrainConfig()
    cfg.model.experts_implementation = "deepgemm"
    with pytest.raises(ConfigError, match=r"^invalid configuration: model.experts_implementation=deepgemm runs "
                                          r"bfloat16 hidden states only .* but model.dtype=float32; set both"):
        validate(cfg)
    cfg.model.dtype = cfg.rollout.dtype = "bfloat16"
    assert validate(cfg) == []
    if torch.cuda.is_available():
        pytest.skip("the GPU half of the check needs a machine without CUDA")
    cfg = load_config(None, ONE_STEP + ["model.experts_implementation=sonicmoe"])
    with pytest.raises(ConfigError, match=r"model.experts_implementation=sonicmoe is a GPU kernel and needs a CUDA "
                                          r"GPU"):
        check_config(cfg)
