"""Model-loading errors name the key the user set (``model.path`` / ``model.tokenizer_path``) and what is missing
(issue 16 item 6): before, a folder that is not a model asked to "install sentencepiece or tiktoken", and a missing
``model.path`` was reported as ``model.tokenizer_path``."""
import json

import pytest

from offpolicy_moe.config.schema import ModelConfig
from offpolicy_moe.models import CheckpointNotFoundError, load_model_config, load_policy, load_tokenizer


def _error(**model) -> str:
    with pytest.raises(CheckpointNotFoundError) as ei:
        load_policy(ModelConfig(**model))
    msg = str(ei.value)
    assert "\n" not in msg and "install" not in msg and "sentencepiece" not in msg, msg
    return msg


def test_missing_model_path_names_model_path(tmp_path):
    msg = _error(path=str(tmp_path / "nope"))
    assert "model.path=" in msg and "tokenizer_path" not in msg and "not an existing directory" in msg


def test_folder_that_is_not_a_model_says_config_json(tmp_path):
    (tmp_path / "README.md").write_text("weights elsewhere")
    msg = _error(path=str(tmp_path))
    assert msg.startswith("model.path=") and "no config.json" in msg


def test_unreadable_config_json_names_model_path(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    msg = _error(path=str(tmp_path))
    assert msg.startswith("model.path=") and "config.json" in msg


def test_model_without_tokenizer_files_names_them(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 32}))
    msg = _error(path=str(tmp_path))
    assert msg.startswith("model.path=") and "tokenizer files" in msg and "tokenizer.json" in msg
    assert "model.tokenizer_path" in msg   # the way out: point it at a folder that has them


def test_explicit_tokenizer_path_is_named_when_it_is_the_problem(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": 32}))
    msg = _error(path=str(tmp_path / "m"), tokenizer_path=str(tmp_path / "tok"))
    assert msg.startswith("model.tokenizer_path=") and "not an existing directory" in msg
    (tmp_path / "tok").mkdir()
    msg = _error(path=str(tmp_path / "m"), tokenizer_path=str(tmp_path / "tok"))
    assert msg.startswith("model.tokenizer_path=") and "tokenizer files" in msg


def test_unusable_tokenizer_file_names_the_key(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizer"}))
    with pytest.raises(CheckpointNotFoundError) as ei:
        load_tokenizer(str(tmp_path), "model.path")
    assert str(ei.value).startswith("model.path=") and "no usable tokenizer" in str(ei.value)


def test_load_model_config_reads_a_real_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 4,
                                                      "num_experts_per_tok": 2}))
    cfg = load_model_config(str(tmp_path))
    assert type(cfg).__name__ == "MixtralConfig" and cfg.num_local_experts == 4
