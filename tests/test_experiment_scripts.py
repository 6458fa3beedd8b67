"""Every benchmark / experiment script under experiments/ parses its command line (``--help`` exits 0 and names
its options), so a README command cannot silently rot into an import or argparse error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in [*(ROOT / "experiments").glob("*.py"), *(ROOT / "experiments" / "bench").glob("*.py"),
                             *(ROOT / "experiments" / "refactor_check").glob("*.py")]
                 if not p.name.startswith("_") and p.name != "runner.py")


def test_scripts_are_found():
    names = {p.name for p in SCRIPTS}
    assert {"bench_losses.py", "bench_routing.py", "bench_vs_trl.py", "bench_generation.py",
            "profile_step.py"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_help(script):
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout and "--" in r.stdout
