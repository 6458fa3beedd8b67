"""docs/config.md documents every key of the schema, with the schema's own default and declared range.

Each key has one table row ``| `dotted.key` | default | range | meaning |``.  The default and range cells are
compared with :mod:`offpolicy_moe.config.schema` and its declared rules, so a new key, a removed key or a changed
default fails here, naming the row to write.  ``python -m tests.test_docs_config`` prints the expected first three
cells of every row.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterator

from offpolicy_moe.config.ranges import RULE, Rule
from offpolicy_moe.config.schema import TrainConfig
from offpolicy_moe.config.validate import LOSS_RULES
from offpolicy_moe.losses import get_loss_spec, list_policy_losses

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
ROW = re.compile(r"^\| `([a-z0-9_.]+)` \| (.*?) \| (.*?) \| (.+) \|$")


def schema_keys(cls: type = TrainConfig, prefix: str = "") -> Iterator[tuple[str, Any, Rule | None]]:
    """``(dotted key, default, rule or None)`` of every leaf field of the schema, in declaration order; the rule is
    the one declared on the field, else the validator's table for the loss keys (``LOSS_RULES``)."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if f.default_factory is not dataclasses.MISSING:
            sub = f.default_factory
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                yield from schema_keys(sub, f"{key}.")
                continue
            default = sub()
        else:
            default = f.default
        yield key, default, f.metadata.get(RULE) or LOSS_RULES.get(key)


def fmt_default(value: Any) -> str:
    """A default as YAML would spell it, in backticks."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(fmt_default(v).strip("`") for v in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {fmt_default(v).strip('`')}" for k, v in value.items()) + "}"
    else:
        text = str(value)
    return f"`{text}`"


def fmt_rule(rule: Rule | None) -> str:
    """The declared range in words (``–`` when the field declares none)."""
    if rule is None:
        return "–"
    if rule.choices is not None:
        text = "one of " + ", ".join(f"`{c}`" for c in rule.choices)
    else:
        text = rule.describe()
    return text + (" or null" if rule.optional else "")


def documented_rows() -> dict[str, tuple[str, str, str]]:
    """``{key: (default cell, range cell, meaning)}`` of the key tables of docs/config.md."""
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line.strip())
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip(), m.group(4).strip())
    return rows


def expected_rows() -> dict[str, tuple[str, str]]:
    return {key: (fmt_default(default), fmt_rule(rule)) for key, default, rule in schema_keys()}


def test_every_schema_key_is_documented_with_its_default_and_range():
    doc, want = documented_rows(), expected_rows()
    missing = [f"| `{k}` | {d} | {r} | ... |" for k, (d, r) in want.items() if k not in doc]
    assert not missing, "docs/config.md lacks rows for:\n" + "\n".join(missing)
    stale = [f"{k}: doc says default {doc[k][0]} range {doc[k][1]}, schema says {d} / {r}"
             for k, (d, r) in want.items() if (doc[k][0], doc[k][1]) != (d, r)]
    assert not stale, "docs/config.md is stale:\n" + "\n".join(stale)


def test_no_documented_key_is_missing_from_the_schema():
    want = expected_rows()
    loss_opts = {f"algo.loss.options.{o}" for n in list_policy_losses() for o in get_loss_spec(n).options}
    extra = [k for k in documented_rows() if k not in want and k not in loss_opts]
    assert not extra, f"docs/config.md documents keys the schema does not have: {extra}"


def test_every_meaning_is_a_sentence():
    short = [k for k, (_, _, meaning) in documented_rows().items() if len(meaning.split()) < 3]
    assert not short, f"docs/config.md rows without a real explanation: {short}"


def test_every_builtin_loss_option_is_documented():
    text = DOC.read_text(encoding="utf-8")
    for name in list_policy_losses():
        for opt in get_loss_spec(name).options:
            assert f"`algo.loss.options.{opt}`" in text, f"docs/config.md: option {opt!r} of loss {name!r} missing"


def test_the_row_parser_sees_a_row_and_the_formatters_match_the_schema():
    # the check must be able to fail: a row is parsed, and a wrong default would differ from the schema's
    assert ROW.match("| `trainer.steps` | `100` | >= 1 | trained steps of the run |")
    assert fmt_default((0.9, 0.999)) == "`[0.9, 0.999]`" and fmt_default(None) == "`null`"
    assert fmt_rule(Rule(gt=0, le=1)) == "in (0, 1]" and fmt_rule(Rule(ge=0, optional=True)) == ">= 0 or null"
    assert expected_rows()["trainer.steps"] != ("`99`", ">= 1")


if __name__ == "__main__":
    for key, (d, r) in expected_rows().items():
        print(f"| `{key}` | {d} | {r} | |")
