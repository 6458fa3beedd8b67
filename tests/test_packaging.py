"""The presets are package data: the mechanism fragments (offpolicy_moe/mechanisms/) and the shelf of named
algorithms (the top-level algorithms/, shipped as offpolicy_moe.algorithms); a built wheel carries them, and an
installed (non-editable) copy finds them.  The package list in pyproject.toml holds every package on disk."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import setuptools
import tomllib

from offpolicy_moe.config import available_presets

REPO = Path(__file__).resolve().parents[1]
MECHANISMS = sorted(p.name for p in (REPO / "offpolicy_moe" / "mechanisms").glob("*.yaml"))
ALGORITHMS = sorted(p.name for p in (REPO / "algorithms").glob("*.yaml"))
# a name that is both (grpo, gspo, m2po, cispo) resolves to the mechanism: the algorithm of that name is it alone
SOURCE_PRESETS = sorted(set(MECHANISMS) | set(ALGORITHMS))


def test_presets_are_found_in_the_package_folders():
    found = available_presets()
    assert MECHANISMS and ALGORITHMS
    assert sorted(f"{n}.yaml" for n in found) == SOURCE_PRESETS
    for name, path in found.items():
        folder = REPO / "offpolicy_moe" / "mechanisms" if f"{name}.yaml" in MECHANISMS else REPO / "algorithms"
        assert path.parent == folder, (name, path)


def test_the_package_list_holds_every_package_on_disk():
    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    on_disk = setuptools.find_packages(str(REPO), include=["offpolicy_moe*"]) + ["offpolicy_moe.algorithms"]
    assert sorted(listed) == sorted(on_disk)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")       # a copy: the build's build/ and egg-info stay out of the checkout
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in ("offpolicy_moe", "algorithms"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
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
    for folder, expected in (("offpolicy_moe/mechanisms/", MECHANISMS), ("offpolicy_moe/algorithms/", ALGORITHMS)):
        inside = sorted(Path(n).name for n in names if n.startswith(folder) and n.endswith(".yaml"))
        assert inside == expected, folder


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
