"""Every other file the project reads back refuses a payload unrun, naming the file: config YAML (a run's
``config.yaml``, experiment files, a sweep's ``experiment.yaml``), JSON files (``summary.json``, ``metrics.jsonl``)
and the weights of a local ``model.path``."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from offpolicy_moe.config.load import load_config
from offpolicy_moe.config.validate import ConfigError
from offpolicy_moe.run.checkpoint import CheckpointError, restore_metrics
from offpolicy_moe.run.export import export_run
from offpolicy_moe.models import load_policy
from offpolicy_moe.models.presets import tiny_qwen3_moe_config
from offpolicy_moe.sweep.plan import load_experiment
from offpolicy_moe.report.runs import RunRecord
from offpolicy_moe.report.spec import report_spec
from offpolicy_moe.sweep.execute import read_status
from offpolicy_moe.tasks.tokenizer import build_char_tokenizer


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def yaml_payload(marker: Path) -> str:
    """A YAML document whose unsafe loading runs ``touch marker``."""
    return f'seed: 1\nx: !!python/object/apply:os.system ["touch {marker}"]\n'


@pytest.fixture
def marker(tmp_path):
    m = tmp_path / "pwned"
    yield m
    assert not m.exists(), "a payload ran"


def test_config_yaml_payload_is_refused(tmp_path, marker):
    f = tmp_path / "config.yaml"
    f.write_text(yaml_payload(marker))
    with pytest.raises(ConfigError) as err:
        load_config(f)
    assert "config.yaml" in str(err.value)


def test_run_config_yaml_payload_is_refused_by_export(tmp_path, marker):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml_payload(marker))
    with pytest.raises(ConfigError, match="config.yaml"):
        export_run(run, tmp_path / "out")


def test_experiment_file_payload_is_refused(tmp_path, marker):
    f = tmp_path / "exp.yaml"
    f.write_text(yaml_payload(marker))
    with pytest.raises(ConfigError, match="exp.yaml"):
        load_experiment(f)


def test_sweep_experiment_yaml_payload_is_refused(tmp_path, marker):
    (tmp_path / "experiment.yaml").write_text(yaml_payload(marker))
    with pytest.raises(ValueError, match="experiment.yaml"):
        report_spec(tmp_path)


def test_report_run_config_yaml_payload_is_refused(tmp_path, marker):
    (tmp_path / "config.yaml").write_text(yaml_payload(marker))
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="config.yaml"):
        RunRecord("r", tmp_path).config


def test_json_files_carry_no_code(tmp_path, marker):
    blob = pickle.dumps(Payload(marker))
    (tmp_path / "summary.json").write_bytes(blob)
    (tmp_path / "metrics.jsonl").write_bytes(blob + b"\n")
    assert read_status(tmp_path) is None
    assert RunRecord("r", tmp_path).rows == []
    with pytest.raises(CheckpointError, match="metrics.jsonl"):      # resume: the recorded offset does not fit
        restore_metrics(tmp_path / "metrics.jsonl", 7)


def test_model_path_pickle_weights_are_refused(tmp_path, marker):
    tok = build_char_tokenizer()
    conf = tiny_qwen3_moe_config(len(tok), num_layers=1, hidden_size=32, num_experts=4, top_k=2)
    conf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    torch.save({"model.embed_tokens.weight": Payload(marker)}, tmp_path / "pytorch_model.bin")
    cfg = load_config(None, [f"model.path={tmp_path}"])
    with pytest.raises(Exception) as err:
        load_policy(cfg.model)
    assert "pytorch_model.bin" in str(err.value)
