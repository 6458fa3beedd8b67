"""``buffer.mode`` is read in one place (sources/modes.py); everything else asks the source class."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import offpolicy_moe
from offpolicy_moe.config import ConfigError, load_config
from offpolicy_moe.config.schema import BUFFER_MODES
from offpolicy_moe.rollout.worker import worker_main
from offpolicy_moe.sources.base import BatchSource
from offpolicy_moe.sources.modes import MODES, mode_of, source_class, validate_run
from offpolicy_moe.rollout.stream_worker import stream_main

PACKAGE = Path(offpolicy_moe.__file__).parent


def test_every_schema_mode_has_a_source_class():
    assert tuple(MODES) == BUFFER_MODES
    for name, mode in MODES.items():
        cls = mode.source_class()
        assert issubclass(cls, BatchSource) and mode.name == name
        assert cls.builds_engine is not mode.forks_workers          # exactly one side builds the engine
        assert (cls.worker_entry is not None) is mode.forks_workers


def test_an_unknown_mode_is_one_line_naming_the_key():
    cfg = load_config(None, [])
    cfg.buffer.mode = "sometimes"
    with pytest.raises(ValueError, match=r"^buffer\.mode must be one of .*'sometimes'$"):
        mode_of(cfg)


@pytest.mark.parametrize("overrides,keeps,on_policy,entry", [
    (["buffer.mode=fixed", "buffer.staleness=0"], 0, True, None),
    (["buffer.mode=fixed", "buffer.staleness=2", "trainer.steps=5"], 0, False, None),
    (["buffer.mode=fixed", "rollout.publish_every=2", "buffer.staleness=1", "trainer.steps=5"], 1, False, None),
    (["buffer.mode=bounded", "buffer.staleness=0"], 0, False, None),
    (["buffer.mode=async", "buffer.staleness=2", "trainer.steps=5"], 3, False, worker_main),
    (["buffer.mode=stream", "buffer.staleness=1", "trainer.steps=5"], 2, False, stream_main),
])
def test_the_class_says_what_the_run_needs(overrides, keeps, on_policy, entry):
    cfg = load_config(None, overrides)
    cls = source_class(cfg)
    assert cls.keeps_versions(cfg) == keeps
    assert cls.on_policy(cfg) is on_policy
    assert cls.worker_entry is entry


def test_a_key_only_the_stream_reads_is_warned_about_elsewhere():
    warnings = validate_run(load_config(None, ["buffer.mode=async", "rollout.stream_slots=7"]))
    assert any(w.startswith("rollout.stream_slots=7 has no effect with buffer.mode=async") and "buffer.mode=stream"
               in w for w in warnings), warnings
    assert not any("stream_slots" in w for w in validate_run(load_config(None, ["buffer.mode=stream",
                                                                               "rollout.stream_slots=7"])))


def test_the_source_rules_join_the_config_error():
    with pytest.raises(ConfigError) as err:
        validate_run(load_config(None, ["buffer.mode=stream", "rollout.backend=ray", "buffer.max_delay=1"]))
    text = str(err.value)
    assert "rollout.backend=local" in text and "buffer.max_delay=1 is read by buffer.mode=bounded only" in text


def _mode_tests(tree: ast.AST) -> list[int]:
    """Lines comparing ``<...>.buffer.mode`` (or ``b.mode`` of ``b = <...>.buffer``) with anything."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            if (isinstance(side, ast.Attribute) and side.attr == "mode"
                    and ((isinstance(side.value, ast.Attribute) and side.value.attr == "buffer")
                         or (isinstance(side.value, ast.Name) and side.value.id == "b"))):
                lines.append(node.lineno)
    return lines


def test_no_module_but_modes_tests_the_mode_name():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "modes.py" and path.parent.name == "sources":
            continue
        lines = _mode_tests(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(PACKAGE))] = lines
    assert found == {}


def test_the_scan_sees_a_mode_test():
    assert _mode_tests(ast.parse("if cfg.buffer.mode == 'stream':\n    pass\nb.mode in ('a',)")) == [1, 3]
