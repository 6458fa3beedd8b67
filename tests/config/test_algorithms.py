"""The shelf of named algorithms (top-level algorithms/): each file names its papers and setting in a header,
composes only mechanisms, is listed by `offpolicy-moe presets`, and trains as it stands (`train FILE --dry-run`
passes every check a run makes before compute)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from offpolicy_moe.cli import main
from offpolicy_moe.config import load_config
from offpolicy_moe.config.load import mechanisms_dir

REPO = Path(__file__).resolve().parents[2]
FILES = sorted((REPO / "algorithms").glob("*.yaml"))
REQUIRED = {"grpo", "grpo_tis", "grpo_r3", "grpo_tis_r3", "gspo", "gspo_r3", "m2po", "m2po_r3", "m2po_tis_r3", "cispo",
            "grpo_pr2"}


def test_the_shelf_holds_the_named_combinations():
    assert REQUIRED <= {f.stem for f in FILES}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_each_algorithm_names_its_papers_and_composes_mechanisms(path):
    text = path.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("Paper" in line for line in header) and any("Setting:" in line for line in header), path.name
    names = yaml.safe_load(text)["preset"]
    mechanisms = {p.stem for p in mechanisms_dir().glob("*.yaml")}
    assert names and set(names) <= mechanisms, names
    assert "+".join(names) == path.stem.replace("_", "+") or path.stem in mechanisms


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_each_algorithm_resolves_to_its_mechanisms(path):
    names = yaml.safe_load(path.read_text())["preset"]
    assert load_config(path) == load_config(presets=names)


def test_presets_lists_both_shelves():
    out = subprocess.run([sys.executable, "-m", "offpolicy_moe", "presets"], capture_output=True, text=True,
                         check=True).stdout
    assert "algorithms (" in out and "mechanisms (" in out
    for f in FILES:
        assert f.stem in out


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_each_algorithm_dry_runs_from_the_cli(path, tmp_path, capsys):
    """The CLI's own entry point, in this process (a subprocess per file costs a torch import each)."""
    code = main(["train", str(path), "--dry-run", "--run-dir", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err[-1500:]
    assert "config OK" in capsys.readouterr().err
