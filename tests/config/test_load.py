"""Config loading: precedence defaults < presets (in order) < YAML < key=value, errors naming keys and files."""
import pytest
from omegaconf import OmegaConf

from offpolicy_moe.config import (
    ConfigError,
    TrainConfig,
    available_presets,
    expand_presets,
    load_config,
    load_config_dict,
    preset_description,
    save_resolved,
    to_yaml,
)

ALL = ["grpo", "gspo", "m2po", "unclipped", "tis", "mis", "icepop", "r2", "r3", "pr2"]


@pytest.fixture
def preset_dir(tmp_path, monkeypatch):
    d = tmp_path / "presets"
    d.mkdir()
    monkeypatch.setenv("OFFPOLICY_MOE_PRESETS", str(d))
    return d


def _w(path, text):
    path.write_text(text)
    return path


def test_defaults_equal_schema():
    assert load_config() == TrainConfig()


def test_every_required_preset_exists_with_description_and_loads():
    names = available_presets()
    for n in ALL:
        assert n in names, n
        assert preset_description(n), n
        load_config(presets=[n])  # no error


def test_precedence_defaults_presets_yaml_overrides(preset_dir, tmp_path):
    _w(preset_dir / "pa.yaml", "optim: {lr: 0.1, weight_decay: 0.5}\nseed: 7\n")
    _w(preset_dir / "pb.yaml", "optim: {lr: 0.2}\ntrainer: {steps: 3}\n")
    user = _w(tmp_path / "u.yaml", "preset: [pa, pb]\ntrainer: {steps: 9, eval_every: 4}\n")
    cfg = load_config(user)
    assert cfg.optim.lr == 0.2  # later preset wins over earlier
    assert cfg.optim.weight_decay == 0.5  # earlier preset survives where not overridden
    assert cfg.seed == 7
    assert cfg.trainer.steps == 9  # YAML wins over presets
    assert cfg.trainer.eval_every == 4
    assert cfg.trainer.log_every == TrainConfig().trainer.log_every  # schema default
    assert cfg.preset == ["pa", "pb"]
    cfg2 = load_config(user, overrides=["trainer.steps=11", "+optim.lr=3e-4"])
    assert cfg2.trainer.steps == 11 and cfg2.optim.lr == 3e-4  # key=value wins over everything
    # order of presets matters
    user_rev = _w(tmp_path / "v.yaml", "preset: [pb, pa]\n")
    assert load_config(user_rev).optim.lr == 0.1


def test_argument_presets_come_after_yaml_presets_and_override_replaces_list(preset_dir, tmp_path):
    _w(preset_dir / "pa.yaml", "optim: {lr: 0.1}\n")
    _w(preset_dir / "pb.yaml", "optim: {lr: 0.2}\n")
    user = _w(tmp_path / "u.yaml", "preset: [pb]\n")
    cfg = load_config(user, presets=["pa"])
    assert cfg.optim.lr == 0.1 and cfg.preset == ["pb", "pa"]
    cfg = load_config(user, overrides=["preset=[pa]"])
    assert cfg.optim.lr == 0.1 and cfg.preset == ["pa"]


def test_nested_presets_compose_depth_first(preset_dir):
    _w(preset_dir / "inner.yaml", "optim: {lr: 0.1, weight_decay: 0.3}\n")
    _w(preset_dir / "outer.yaml", "preset: [inner]\noptim: {lr: 0.2}\n")
    srcs = [s for s, _ in expand_presets(["outer"])]
    assert "inner" in srcs[0] and "outer" in srcs[1]
    cfg = load_config(presets=["outer"])
    assert cfg.optim.lr == 0.2 and cfg.optim.weight_decay == 0.3


def test_preset_cycle_detected(preset_dir):
    _w(preset_dir / "a.yaml", "preset: [b]\n")
    _w(preset_dir / "b.yaml", "preset: [a]\n")
    with pytest.raises(ConfigError, match=r"cycle.*a -> b -> a"):
        load_config(presets=["a"])


def test_unknown_preset_suggests(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown preset 'm2p'.*'m2po'"):
        load_config(presets=["m2p"])


def test_algorithm_presets_compose_into_whole_algorithm():
    cfg = load_config(presets=["m2po", "tis", "r3"])
    assert cfg.algo.loss.name == "m2po" and cfg.algo.loss.options["tau"] == 0.04
    assert cfg.algo.correction.mode == "truncate" and cfg.algo.correction.high == 2.0
    assert cfg.algo.routing.replay == "r3"
    g = load_config(presets=["gspo"])
    assert g.algo.loss.options["clip_low"] == 3e-4 and isinstance(g.algo.loss.options["clip_low"], float)
    # later correction preset replaces every field of the earlier one
    c = load_config(presets=["icepop", "tis"])
    assert (c.algo.correction.mode, c.algo.correction.level, c.algo.correction.low) == ("truncate", "token", None)


def test_misspelt_key_error_names_key_file_and_suggests(tmp_path):
    user = _w(tmp_path / "bad.yaml", "algo:\n  loss:\n    adv_nrom: std\n")
    with pytest.raises(ConfigError) as ei:
        load_config(user)
    msg = str(ei.value)
    assert "bad.yaml" in msg and "algo.loss.adv_nrom" in msg and "adv_norm" in msg
    with pytest.raises(ConfigError, match=r"override 'algo.loss.agg_mode=token-mean'.*agg"):
        load_config(overrides=["algo.loss.agg_mode=token-mean"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"trainer.steps"):
        load_config(overrides=["trainer.steps=many"])


def test_scientific_notation_is_float(tmp_path):
    user = _w(tmp_path / "u.yaml", "optim:\n  lr: 3e-4\nalgo:\n  loss:\n    options:\n      clip_high: 4e-4\n")
    cfg = load_config(user, overrides=["algo.loss.options.clip_low=3e-4"])
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert isinstance(cfg.algo.loss.options["clip_high"], float) and cfg.algo.loss.options["clip_high"] == 4e-4
    assert cfg.algo.loss.options["clip_low"] == 3e-4


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(overrides=["trainer.steps"])
    with pytest.raises(ConfigError, match="not supported"):
        load_config(overrides=["~trainer.steps=1"])


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml.*not found"):
        load_config(tmp_path / "nope.yaml")
    lst = _w(tmp_path / "l.yaml", "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(lst)


def test_dotted_keys_in_yaml_and_dict(tmp_path):
    user = _w(tmp_path / "u.yaml", "trainer.steps: 5\nalgo.loss.name: gspo\n")
    cfg = load_config(user)
    assert cfg.trainer.steps == 5 and cfg.algo.loss.name == "gspo"
    cfg = load_config_dict({"preset": ["r3"], "buffer.staleness": 4, "buffer": {"mode": "bounded"}})
    assert cfg.buffer.staleness == 4 and cfg.buffer.mode == "bounded" and cfg.algo.routing.replay == "r3"


def test_save_resolved_roundtrip(tmp_path):
    cfg = load_config(presets=["gspo", "r2"], overrides=["optim.betas=[0.9,0.95]", "seed=3"])
    path = save_resolved(cfg, tmp_path / "run")
    assert path.name == "config.yaml" and path.read_text() == to_yaml(cfg)
    back = load_config(path)
    assert back == cfg
    assert OmegaConf.create(path.read_text()).algo.routing.replay == "r2"


def test_override_value_that_is_not_yaml_is_taken_as_text():
    """`task.operators=*` used to end in a YAML ScannerError traceback (read as an alias)."""
    assert load_config(overrides=["task.operators=*"]).task.operators == "*"
    assert load_config(overrides=["task.operators=+*"]).task.operators == "+*"
