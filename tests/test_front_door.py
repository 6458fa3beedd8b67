"""The CLI's front door imports no torch: building the parser (``offpolicy-moe --help``), loading and validating a
config (the first half of ``train --dry-run``), and reporting a config mistake all run without it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "scipy")


def _heavy_after(code: str) -> list[str]:
    """The heavy modules loaded after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [m for m in out.stdout.strip().splitlines()[-1].split(",") if m] if out.stdout.strip() else []


def test_building_the_parser_imports_no_torch():
    assert _heavy_after("from offpolicy_moe.cli import build_parser\nbuild_parser().format_help()") == []


def test_loading_and_validating_the_default_config_imports_no_torch():
    code = ("from offpolicy_moe.cli import build_parser\nbuild_parser()\n"
            "from offpolicy_moe.config import load_config, validate\n"
            "assert validate(load_config(None, [])) == []\n"
            "assert validate(load_config(None, ['algo.loss.name=m2po', 'algo.loss.options.scope=local'])) == []")
    assert _heavy_after(code) == []


def test_a_config_mistake_is_reported_before_torch_is_imported():
    code = ("import contextlib, io\nfrom offpolicy_moe.cli import main\n"
            "err = io.StringIO()\n"
            "with contextlib.redirect_stderr(err):\n"
            "    rc = main(['train', '--dry-run', 'algo.loss.options.tua=1'])\n"
            "assert rc == 2 and \"has no option 'tua'\" in err.getvalue(), (rc, err.getvalue())")
    assert _heavy_after(code) == []


@pytest.mark.parametrize("package", ["offpolicy_moe.losses", "offpolicy_moe.models", "offpolicy_moe.tasks"])
def test_importing_a_lower_package_imports_no_torch(package):
    assert _heavy_after(f"import {package}") == []


@pytest.mark.parametrize("package", ["offpolicy_moe.losses", "offpolicy_moe.models", "offpolicy_moe.tasks"])
def test_every_exported_name_resolves(package):
    module = __import__(package, fromlist=["__all__"])
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    assert set(module.__all__) <= set(dir(module))


def test_the_help_of_the_console_script_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "offpolicy_moe", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from offpolicy_moe.cli import COMMANDS

    assert all(name in out.stdout for name in COMMANDS)
