"""The presets are package data: a built wheel carries them, and an installed (non-editable) copy finds them."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from offpolicy_moe.config import available_presets

REPO = Path(__file__).resolve().parents[1]
SOURCE_PRESETS = sorted(p.name for p in (REPO / "offpolicy_moe" / "presets").glob("*.yaml"))


def test_presets_are_found_in_the_package_folder():
    found = available_presets()
    assert SOURCE_PRESETS, "no presets in offpolicy_moe/presets"
    assert sorted(f"{n}.yaml" for n in found) == SOURCE_PRESETS
    for path in found.values():
        assert path.parent == REPO / "offpolicy_moe" / "presets"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")       # a copy: the build's build/ and egg-info stay out of the checkout
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "offpolicy_moe", src / "offpolicy_moe", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        capture_output=True, text=True, cwd=out,
    )
    if proc.returncode != 0 and "No module named pip" in proc.stderr:
        pytest.skip("pip is not available")
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = list(out.glob("offpolicy_moe-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contains_every_preset(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    inside = sorted(Path(n).name for n in names if n.startswith("offpolicy_moe/presets/") and n.endswith(".yaml"))
    assert inside == SOURCE_PRESETS


def test_installed_wheel_finds_its_presets(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("OFFPOLICY_MOE_PRESETS", None)
    code = ("import offpolicy_moe, json; from offpolicy_moe.config import available_presets; "
            "print(json.dumps([offpolicy_moe.__file__, sorted(available_presets())]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    module_file, names = json.loads(proc.stdout)
    assert Path(module_file).is_relative_to(site), module_file   # the installed copy, not the source tree
    assert sorted(f"{n}.yaml" for n in names) == SOURCE_PRESETS
