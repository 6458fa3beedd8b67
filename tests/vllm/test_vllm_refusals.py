"""Every setting the vLLM engine refuses (each case of tests/refusals.py, found by the static walk of the
constructors) ends ``train`` with exit code 2 and one line naming its key, in sync, async, stream and Ray modes,
with ``--dry-run`` and on a real start, before any engine, worker or actor starts."""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.cli import main
from offpolicy_moe.rollout.vllm_engine import cpu_has_amx
from offpolicy_moe.trainer import trainer as trainer_module
from tests.refusals import MODES, VLLM_CASES, error_lines

pytestmark = pytest.mark.vllm


def _machine_lacks(machine: str) -> str:
    if machine == "amx" and not cpu_has_amx():
        return "this CPU has no AMX"
    if machine == "gpu" and not torch.cuda.is_available():
        return "no CUDA device"
    return ""


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "start"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("function", list(VLLM_CASES))
def test_a_setting_vllm_refuses_is_one_line_in_every_mode_before_any_start(tmp_path, monkeypatch, capsys, function,
                                                                        mode, dry_run):
    case = VLLM_CASES[function]
    lacks = _machine_lacks(case.machine)
    if lacks:
        pytest.skip(f"{function}: {lacks}")
    if mode == "ray":
        pytest.importorskip("ray")

    def no_run(*args, **kwargs):
        raise AssertionError("the run was built: an engine, worker or actor could start")

    monkeypatch.setattr(trainer_module, "build_run", no_run)
    run = tmp_path / "run"
    rc = main(["train", *case.overrides, *MODES[mode], "--run-dir", str(run)] + (["--dry-run"] if dry_run else []))
    lines = error_lines(capsys.readouterr().err)
    assert rc == 2, lines
    assert len(lines) == 1 and case.key in lines[0], lines
    assert not run.exists()
