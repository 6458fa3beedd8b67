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
``on_worker_death``, ``update_in_flight``, ``early_start``, ``buffer.on_stale``, ``max_ahead``: worker processes, tests/sources);
``logging.*`` and ``trainer.threads`` (no effect on what is computed).

The default variant draws a few derandomised examples; ``-m slow`` runs every key's range boundaries and every
choice, then many random examples.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offpolicy_moe.config.load import load_config
from offpolicy_moe.config.ranges import Rule, declared_rules
from offpolicy_moe.config.schema import TrainConfig
from offpolicy_moe.config.validate import LOSS_RULES, ConfigError, vocabularies
from offpolicy_moe.run.run_dir_checks import RunDirError
from offpolicy_moe.run.nonfinite import NonFiniteError
from tests.tiny import TINY

ONE_STEP = [*TINY, "trainer.steps=1", "trainer.threads=1", "trainer.checkpoint_every=0", "trainer.export_final=false"]

SKIPPED = {"run_dir", "preset", "model.path", "model.tokenizer_path", "task.name", "task.rewards", "task.split",
           "task.eval_split", "task.prompt_column", "task.answer_column", "rollout.ray_address", "rollout.backend",
           "buffer.mode", "rollout.workers", "rollout.worker_threads", "rollout.worker_timeout_s",
           "rollout.on_worker_death", "rollout.update_in_flight", "rollout.early_start", "rollout.ray_on_node_loss", "buffer.on_stale",
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
    """An integer key: its schema annotation is ``int`` or ``Optional[int]`` (a null default says nothing), or its
    default is an integer (the loss options, which have no annotation here)."""
    *parents, leaf = key.split(".")
    obj: Any = TrainConfig()
    for part in parents:
        obj = getattr(obj, part)
    annotation = typing.get_type_hints(type(obj)).get(leaf) if dataclasses.is_dataclass(obj) else None
    if annotation is not None:
        return annotation is int or (int in typing.get_args(annotation) and float not in typing.get_args(annotation))
    return isinstance(_default(key), int)


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
                                           allow_subnormal=False)).filter(lambda v: v > low if rule.gt is not None
                                                                          else v >= low)


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


@settings(max_examples=300, deadline=None, database=None)
@given(pair=PAIRS)
def test_every_drawn_value_is_inside_its_rule_and_integer_keys_draw_integers(pair):
    """The sweep draws only accepted values (a magnitude below a ``ge`` bound was drawn: vllm_max_model_len=1.0),
    and a key annotated ``Optional[int]`` with a null default draws integers."""
    key, value = pair
    assert RULES[key].problem(value) is None, (key, value)
    if _is_int(key) and value is not None and RULES[key].choices is None:
        assert isinstance(value, int), (key, value)


def test_integer_keys_are_read_from_the_schema():
    assert _is_int("rollout.vllm_max_model_len") and _is_int("eval.top_k") and _is_int("buffer.max_delay")
    assert not _is_int("optim.lr") and not _is_int("rollout.top_p")


def test_nan_is_never_drawn():
    assert not any(isinstance(v, float) and math.isnan(v) for k, r in RULES.items() for v in boundary_values(k, r))


def test_caught_experts_kernels_are_refused_before_compute_naming_the_key():
    # found by the boundary sweep: both passed validation, then the first forward raised inside transformers
    # (deepgemm: "requires bfloat16 hidden states"; sonicmoe: "requires the `kernels` package")
    import torch

    from offpolicy_moe.sources.modes import validate_run as validate
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


# ---------------------------------------------------------------------------------------------------------------
# Options that a run would ignore or cap without a word (issue 37, item 4): every key of validate.UNREAD_UNLESS is
# measured both ways on the one-step job: with its switch off a non-default value is warned about by name AND leaves
# the run bit-identical (so the warning is true), with its switch on the same value changes the run (so the switch is
# the right one). buffer.max_delay is refused outside bounded mode and warned about above the staleness, whose
# meaning (drops, never staler batches) the bounded buffer itself pins.
from offpolicy_moe.config.validate import UNREAD_UNLESS  # noqa: E402
from offpolicy_moe.sources.modes import validate_run as validate  # noqa: E402

#: PR2 trains its predictors at off-policy mini-steps: two updates per step, one step stale
PR2_ON = ["algo.routing.replay=pr2", "trainer.updates_per_step=2", "buffer.staleness=1", "trainer.steps=3",
          "trainer.log_every=1"]
#: the longtail task (final-answer reward: the tiny job's partial credit is refused) with room for its short answers
LONGTAIL_ON = ["task.name=longtail", "task.reward=exact", "rollout.max_new_tokens=15"]
#: a non-default value of each unread key, and the switch that makes the run read it
UNREAD_CASES = {
    "algo.correction.level": ("sequence", ["algo.correction.mode=truncate", "algo.correction.high=1.001"]),
    "algo.correction.high": (1.001, ["algo.correction.mode=truncate"]),
    "algo.correction.low": (0.999, ["algo.correction.mode=mask", "algo.correction.high=1.5"]),
    "algo.correction.opsm_delta": (1e-9, ["algo.correction.mode=truncate"]),
    "algo.kl.kind": ("k1", ["algo.kl.coef=0.5"]),
    "algo.routing.pr2_lr_mult": (1e5, PR2_ON),
    "algo.routing.pr2_feature_sample_rate": (1.0, PR2_ON),
    "algo.routing.pr2_bias_in_weights": (False, PR2_ON),
    "task.max_terms": (8, LONGTAIL_ON),
    "task.length_tail": (0.5, LONGTAIL_ON),
    "task.estimate_share": (0.5, LONGTAIL_ON + ["trainer.sft_warmup_steps=3"]),   # read by the SFT warm start alone
    "eval.temperature": (0.5, ["eval.samples=4"]),
    "eval.top_p": (0.5, ["eval.samples=4"]),
    "eval.top_k": (2, ["eval.samples=4"]),
    "eval.seed": (7, ["eval.samples=4"]),
}


def _fingerprint(overrides: list[str], run_dir) -> list:
    """The policy's weights and the logged metrics (timings left out) after two steps of the tiny job with
    ``overrides`` (a bfloat16 engine, so that the behaviour log-probs differ from the trainer's and the correction
    keys have something to correct)."""
    from offpolicy_moe.trainer.checks import check_config
    from offpolicy_moe.trainer.trainer import Trainer

    cfg = load_config(None, ONE_STEP + ["rollout.dtype=bfloat16", "trainer.steps=2", "trainer.log_every=1"] + overrides)
    cfg.run_dir = str(run_dir)
    trainer = Trainer(cfg, checked=check_config(cfg))
    assert trainer.run()["status"] == "completed"
    import json
    import torch

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [torch.tensor([v for k, v in sorted(r.items()) if not k.startswith(("perf/", "time/"))
                              and not k.endswith(("_s", "_per_s"))]) for r in rows]
    return [p.detach().clone() for p in trainer.unwrapped.parameters()] + measured


def _same(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_every_unread_key_has_a_case():
    assert set(UNREAD_CASES) == set(UNREAD_UNLESS)


@pytest.mark.parametrize("key", sorted(UNREAD_CASES))
def test_an_unread_key_is_warned_about_and_really_unread(key, tmp_path):
    value, switch = UNREAD_CASES[key]
    setting = f"{key}={value}"
    warnings_ = validate(load_config(None, ONE_STEP + [setting]))
    assert any(w.startswith(f"{key}=") and UNREAD_UNLESS[key][0] in w for w in warnings_), warnings_
    assert validate(load_config(None, ONE_STEP + switch + [setting])) == [] or not any(
        w.startswith(f"{key}=") for w in validate(load_config(None, ONE_STEP + switch + [setting])))
    off = _fingerprint([], tmp_path / "a"), _fingerprint([setting], tmp_path / "b")
    assert _same(*off), f"{setting} changed the run although its switch is off: the warning would be wrong"
    on = _fingerprint(switch, tmp_path / "c"), _fingerprint(switch + [setting], tmp_path / "d")
    assert not _same(*on), f"{setting} did not change the run with {switch}"


def test_max_delay_outside_bounded_mode_is_refused_in_one_line(tmp_path, capsys):
    from offpolicy_moe.cli import main

    for mode in ("fixed", "async"):
        argv = ["train", "--dry-run", *ONE_STEP, "buffer.staleness=0", f"buffer.mode={mode}", "buffer.max_delay=3",
                "--run-dir", str(tmp_path / mode)]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"offpolicy-moe train: error: invalid configuration: buffer.max_delay=3 is read by "
                       f"buffer.mode=bounded only; buffer.mode={mode} ignores it: remove it, or set "
                       f"buffer.mode=bounded"]


def test_max_delay_above_the_staleness_is_said_and_means_drops_never_staler_batches(tmp_path, capsys):
    """buffer.max_delay=100 with buffer.staleness=1: the dry run says it in one line; the bounded buffer (the run's
    own, driven as the trainer drives it) then trains no batch more than 1 version stale and drops the late ones."""
    from types import SimpleNamespace

    from offpolicy_moe.cli import main
    from offpolicy_moe.sources.buffer import StalenessBuffer

    argv = ["train", "--dry-run", *ONE_STEP, "trainer.steps=40", "buffer.mode=bounded", "buffer.staleness=1",
            "buffer.max_delay=100", "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 0
    said = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert said == ["offpolicy-moe train: warning: buffer.max_delay=100 > buffer.staleness=1: a batch that arrives "
                    "after the trainer has moved more than 1 versions past it is dropped (offpolicy/dropped), so no "
                    "batch is trained more than 1 versions stale; raise buffer.staleness for staler data"]
    buf, trained, lags, delays = StalenessBuffer(1, True, max_delay=100, seed=0), 0, [], []
    for it in range(2000):
        buf.push(SimpleNamespace(version=trained, generated_at=it), it)
        batch, _ = buf.pop(it, trained)
        if batch is not None:
            lags.append(trained - batch.version)
            delays.append(it - batch.generated_at)
            trained += 1
    assert lags and max(lags) <= 1 and buf.dropped > 0 and max(delays) > 1
    assert validate(load_config(None, ONE_STEP + ["trainer.steps=40", "buffer.mode=bounded", "buffer.staleness=1",
                                                  "buffer.max_delay=1"])) == []
