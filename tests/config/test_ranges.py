"""The generic per-key check: every float key refuses NaN/±inf by name, every declared bound is enforced by name,
and each vocabulary has one home (its owner module)."""
import dataclasses
import math
import typing
from pathlib import Path

import pytest

import offpolicy_moe
from offpolicy_moe.config import ConfigError, load_config
from offpolicy_moe.sources.modes import validate_run as validate
from offpolicy_moe.config.ranges import Rule, declared_rules, field_problems
from offpolicy_moe.config.schema import TrainConfig
from offpolicy_moe.config.validate import LOSS_RULES, vocabularies


def _leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            yield from _leaves(t, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", t


FLOAT_KEYS = sorted(k for k, t in _leaves(TrainConfig) if float in (typing.get_args(t) or (t,)))
INT_KEYS = sorted(k for k, t in _leaves(TrainConfig) if int in (typing.get_args(t) or (t,)) and float not in
                  (typing.get_args(t) or (t,)))
RULES = {**declared_rules(TrainConfig), **LOSS_RULES}


def _errors(*overrides) -> str:
    try:
        validate(load_config(overrides=list(overrides)), model_is_moe=True)
    except ConfigError as exc:
        return str(exc)
    return ""


def test_the_walk_finds_the_keys():
    assert {"algo.kl.coef", "optim.lr", "rollout.router_noise", "optim.grad_clip"} <= set(FLOAT_KEYS)
    assert {"trainer.keep_checkpoints", "trainer.threads", "algo.loss.norm_length"} <= set(INT_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_key_refuses_non_finite(key, value):
    msg = _errors(f"{key}={value}")
    assert f"{key}: must be a finite number" in msg, msg


def test_non_finite_inside_a_list_is_refused():
    assert "optim.betas: must be a finite number, got nan" in _errors("optim.betas=[0.9,.nan]")


def _just_outside(rule: Rule, key: str):
    integer = key in INT_KEYS
    if rule.ge is not None:
        return rule.ge - 1 if integer else rule.ge - 1e-3
    if rule.gt is not None:
        return rule.gt
    return None


BOUNDED = sorted(k for k, r in RULES.items() if r.choices is None and (r.ge is not None or r.gt is not None))


@pytest.mark.parametrize("key", BOUNDED)
def test_every_lower_bound_is_enforced_naming_the_key(key):
    rule = RULES[key]
    bad = _just_outside(rule, key)
    assert f"{key}: must be {rule.describe()}" in _errors(f"{key}={bad}")
    if rule.ge is not None:     # the bound itself is allowed by this rule
        value = int(rule.ge) if key in INT_KEYS else rule.ge
        assert f"{key}: must be" not in _errors(f"{key}={value}")


@pytest.mark.parametrize("key", sorted(k for k, r in RULES.items() if r.le is not None or r.lt is not None))
def test_every_upper_bound_is_enforced_naming_the_key(key):
    rule = RULES[key]
    bad = (rule.le + (1 if key in INT_KEYS else 0.5)) if rule.le is not None else rule.lt
    assert f"{key}: must be {rule.describe()}" in _errors(f"{key}={bad}")


def test_loss_rules_name_real_schema_keys():
    keys = {k for k, _ in _leaves(TrainConfig)}
    assert set(LOSS_RULES) <= keys, set(LOSS_RULES) - keys


def test_rule_problem_and_describe():
    r = Rule(gt=0, le=1, optional=True)
    assert r.describe() == "in (0, 1]"
    assert r.problem(None) is None and r.problem(0.5) is None and r.problem(1) is None
    assert "in (0, 1]" in r.problem(0) and r.problem(float("nan")) is not None
    assert Rule(ge=1).problem(None) == "must be set (null is not allowed)"
    assert "expected one of a, b" in Rule(choices=("a", "b")).problem("c")


def test_field_problems_walks_nested_dataclasses():
    @dataclasses.dataclass
    class Inner:
        x: float = 1.0

    @dataclasses.dataclass
    class Outer:
        inner: Inner = dataclasses.field(default_factory=Inner)
        y: int = 0

    assert field_problems(Outer(Inner(math.nan), -1), "", {"y": Rule(ge=0)}) == \
        ["inner.x: must be a finite number, got nan", "y: must be >= 0, got -1"]


def test_vocabularies_are_imported_from_their_owners():
    from offpolicy_moe.losses import AGG_MODES, KL_KINDS, list_policy_losses
    from offpolicy_moe.losses.correction import LEVELS, MODES
    from offpolicy_moe.models import DTYPE_NAMES
    from offpolicy_moe.tasks import REWARD_KINDS

    v = vocabularies()
    assert v["algo.kl.kind"] is KL_KINDS and v["algo.loss.agg"] is AGG_MODES
    assert v["algo.correction.level"] is LEVELS and v["algo.correction.mode"] == ("none", *MODES)
    assert v["task.reward"] is REWARD_KINDS and v["model.dtype"] is v["rollout.dtype"] is DTYPE_NAMES
    assert v["algo.loss.name"] == tuple(list_policy_losses())


def test_one_resolve_dtype_in_the_package():
    root = Path(offpolicy_moe.__file__).parent
    defs = [p for p in root.rglob("*.py") if "def resolve_dtype" in p.read_text()]
    assert [p.relative_to(root).as_posix() for p in defs] == ["models/dtypes.py"]
    from offpolicy_moe.rollout.engine import resolve_dtype as engine_copy
    from offpolicy_moe.models import resolve_dtype

    assert engine_copy is resolve_dtype


def test_staleness_must_be_reachable():
    assert "buffer.staleness=4 >= trainer.steps=4" in _errors("buffer.staleness=4", "trainer.steps=4")
    assert _errors("buffer.staleness=3", "trainer.steps=4") == ""


def test_one_problem_is_one_line():
    msg = _errors("optim.lr=inf")
    assert msg == "invalid configuration: optim.lr: must be a finite number, got inf"
