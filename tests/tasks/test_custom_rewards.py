"""task.rewards: import paths (module and file), weighted sums, per-reward values, columns, failures."""
from __future__ import annotations

import math

import pytest

from offpolicy_moe.config.schema import TaskConfig
from offpolicy_moe.tasks import (RewardError, RewardImportError, RewardSet, RewardSpec, make_task, parse_reward_specs,
                                 resolve_reward)
from tests.tasks.reward_fixtures import length_bonus

FIX = "tests.tasks.reward_fixtures"


def _set(*entries, on_error="stop"):
    return RewardSet(parse_reward_specs(list(entries)), on_error=on_error)


def test_module_path_resolves_to_the_function():
    assert resolve_reward(f"{FIX}:length_bonus") is length_bonus


def test_file_path_resolves_outside_any_package(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def shout(completions, answers, **kw):\n    return [float(c.isupper()) for c in completions]\n")
    fn = resolve_reward(f"{f}:shout")
    assert fn(["AB", "ab"], ["", ""]) == [1.0, 0.0]
    assert resolve_reward(f"{f}:shout") is fn          # imported once per process


@pytest.mark.parametrize("path, needle", [
    ("no_such_pkg.mod:fn", "cannot import module 'no_such_pkg.mod'"),
    (f"{FIX}:missing", "has no attribute 'missing'"),
    (f"{FIX}:NOT_CALLABLE", "not a function"),
    ("nowhere/reward.py:fn", "does not exist"),
    ("justaname", "expected 'pkg.module:function'"),
])
def test_unresolvable_paths_are_one_line_errors_naming_the_path(path, needle):
    with pytest.raises(RewardImportError, match=needle) as err:
        resolve_reward(path, "task.rewards[0].fn")
    assert "\n" not in str(err.value) and path in str(err.value)


def test_a_module_that_fails_to_import_is_named(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardImportError, match="broken.py.*RuntimeError: boom"):
        resolve_reward(f"{f}:fn")


def test_weighted_sum_and_per_reward_values_are_exact():
    rs = _set({"fn": "exact", "weight": 2.0}, {"fn": f"{FIX}:length_bonus", "weight": -0.5})
    s = rs.score(["12", "3", "456"], ["12", "4", "456"])
    assert s.parts == {"exact": [1.0, 0.0, 1.0], "length_bonus": [pytest.approx(0.2), pytest.approx(0.1),
                                                                   pytest.approx(0.3)]}
    assert s.total == pytest.approx([2.0 - 0.1, -0.05, 2.0 - 0.15])
    m = s.metrics()
    assert m["reward/exact"] == pytest.approx(2 / 3) and m["reward/length_bonus"] == pytest.approx(0.2)
    assert m["reward/errors"] == 0.0 and m["reward/math_timeouts"] == 0.0


def test_columns_reach_the_function_aligned_with_rows():
    rs = _set({"fn": f"{FIX}:echo_column"})
    s = rs.score(["a", "b"], ["x", "y"], prompts=["p0", "p1"], columns={"level": [3, 5], "answers": ["shadowed"]})
    assert s.total == [3.0, 5.0]


@pytest.mark.parametrize("fn, needle", [
    ("raises_on_seven", r"reward 'raises_on_seven' \(tests.tasks.reward_fixtures:raises_on_seven\) raised "
                        r"ZeroDivisionError: seven is unlucky on row 1 \(prompt 'q1'\)"),
    ("nan_on_seven", r"returned nan \(not a finite number\) on row 1 \(prompt 'q1'\)"),
    ("one_short", r"returned 2 values for a batch of 3 rows"),
])
def test_a_failing_reward_raises_reward_error_naming_function_and_row(fn, needle):
    rs = _set({"fn": f"{FIX}:{fn}"})
    with pytest.raises(RewardError, match=needle) as err:
        rs.score(["1", "7", "2"], ["1", "7", "2"], prompts=["q0", "q1", "q2"])
    assert "\n" not in str(err.value) and err.value.fn == f"{FIX}:{fn}"
    assert err.value.row == (None if fn == "one_short" else 1)


@pytest.mark.parametrize("fn, values, errors", [
    ("raises_on_seven", [2.0, 0.0, 2.0], 1),      # the other rows keep their (exact) reward, the bad row scores 0
    ("nan_on_seven", [3.0, 0.0, 3.0], 1),
    ("one_short", [2.0, 0.0, 2.0], 3),        # the whole batch of that reward is zeroed
])
def test_on_reward_error_zero_scores_zero_and_counts(fn, values, errors):
    rs = _set({"fn": "exact", "weight": 2.0}, {"fn": f"{FIX}:{fn}"}, on_error="zero")
    s = rs.score(["1", "7", "2"], ["1", "8", "2"])
    assert s.total == values and s.errors == errors and s.metrics()["reward/errors"] == float(errors)


@pytest.mark.parametrize("entries, needle", [
    ([{"weight": 1.0}], r"task.rewards\[0\].fn"),
    ([{"fn": "exact", "weight": math.nan}], r"task.rewards\[0\].weight"),
    ([{"fn": "exact", "colour": 1}], "unknown key"),
    ([{"fn": "exact"}, {"fn": "exact"}], "used twice"),
    ([{"fn": "exact", "name": "mean"}], "taken by the metric reward/mean"),
    ([{"fn": "fuzzy"}], "expected 'pkg.module:function'"),
    ("exact", "expected a list"),
])
def test_malformed_entries_are_refused_naming_the_key(entries, needle):
    with pytest.raises(ValueError, match=needle):
        parse_reward_specs(entries)


def test_make_task_uses_task_rewards_and_keeps_the_default_reward_without_them():
    plain = make_task(TaskConfig(train_size=64, eval_size=8))
    assert [s.fn for s in plain.rewards.specs] == ["exact"]
    assert plain.reward(["3", "4"], ["3", "5"]) == [1.0, 0.0]
    assert plain.last_scores.metrics()["reward/exact"] == 0.5
    task = make_task(TaskConfig(train_size=64, eval_size=8, on_reward_error="zero",
                                rewards=[{"fn": f"{FIX}:length_bonus", "weight": 10.0, "name": "len"}]))
    assert task.reward(["12", "3"], ["0", "0"]) == pytest.approx([2.0, 1.0])
    assert task.rewards.on_error == "zero" and task.last_scores.metrics()["reward/len"] == pytest.approx(0.15)


def test_batch_context_recovers_the_rows_of_group_ids(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}", "level": {i}}}\n' for i in range(10)))
    task = make_task(TaskConfig(name=f"jsonl:{data}", eval_size=2, seed=5))
    P = 3
    group_ids = [0, 0, 2, 4, 5, 7]          # iterations 0, 0, 0, 1, 1, 2
    ctx = task.batch_context(group_ids, P)
    expect = [int(task.sample_indices(g // P, P)[g % P]) for g in group_ids]
    assert ctx["prompts"] == [task.train_prompts[i] for i in expect]
    assert ctx["columns"]["level"] == [int(p.split("+")[0]) for p in ctx["prompts"]]
    assert make_task(TaskConfig(train_size=16, eval_size=2)).batch_context([1], 2)["columns"] == {}


def test_a_sweep_run_keeps_its_rewards_through_the_saved_config(tmp_path):
    """A sweep saves each run's resolved config and starts `train <config.yaml>`: the rewards survive the round trip
    and resolve in the run's own task, per grid point."""
    from offpolicy_moe.config.load import load_config, save_resolved
    from offpolicy_moe.sweep.plan import parse_experiment, plan_runs

    user = tmp_path / "shaping.py"
    user.write_text("def plus_one(completions, answers, **kw):\n    return [1.0] * len(completions)\n")
    exp = parse_experiment({"name": "byo", "seeds": [0], "base": {"task": {"train_size": 32, "eval_size": 4}},
                            "grid": {"shaping": {
                                "off": {"task": {"rewards": [{"fn": "exact"}]}},
                                "on": {"task": {"rewards": [{"fn": "exact"},
                                                            {"fn": f"{user}:plus_one", "weight": 0.25}]}}}}})
    totals = {}
    for run in plan_runs(exp):
        cfg = load_config(save_resolved(run.config, tmp_path / run.name))
        assert cfg.task.rewards == run.config.task.rewards
        totals[run.axes["shaping"]] = make_task(cfg.task).score(["3", "4"], ["3", "5"]).total
    assert totals == {"off": [1.0, 0.0], "on": [1.25, 0.25]}
