"""Every invalid combination is refused with a message naming its keys; warnings name theirs."""
import json

import pytest

from offpolicy_moe.config import ConfigError, load_config
from offpolicy_moe.sources.modes import validate_run as validate
from offpolicy_moe.config.validate import infer_model_is_moe


def _err(overrides, presets=(), moe=True):
    cfg = load_config(overrides=overrides, presets=presets)
    with pytest.raises(ConfigError) as ei:
        validate(cfg, model_is_moe=moe)
    return str(ei.value)


def test_defaults_and_all_algorithm_combinations_valid():
    assert validate(load_config(), model_is_moe=True) == []
    corrs, routes = ((), ("tis",), ("mis",), ("icepop",)), ((), ("r2",), ("r3",), ("pr2",))
    for i, loss in enumerate(("grpo", "gspo", "m2po", "unclipped")):
        for j, corr in enumerate(corrs):  # every loss x correction, routing mechanisms cycled through
            presets = [loss, *corr, *routes[(i + j) % 4]]
            assert validate(load_config(presets=presets, overrides=["trainer.updates_per_step=4"]),
                            model_is_moe=True) == [], presets


@pytest.mark.parametrize(
    "overrides,presets,moe,keys",
    [
        (["algo.old_logp_source=engine"], ["tis"], True, ["algo.correction.mode", "algo.old_logp_source"]),
        (["algo.old_logp_source=engine"], ["icepop"], True, ["algo.correction.mode", "algo.old_logp_source"]),
        (["algo.old_logp_source=engine"], ["r2"], True, ["algo.routing.replay=r2", "algo.old_logp_source"]),
        ([], ["r3"], False, ["algo.routing.replay=r3", "model"]),
        ([], ["r2"], False, ["algo.routing.replay=r2"]),
        ([], ["pr2"], False, ["algo.routing.replay=pr2"]),
        (["algo.loss.options.tau=0"], ["m2po"], True, ["algo.loss.options", "tau"]),
        (["algo.loss.options.tau=-0.1"], ["m2po"], True, ["algo.loss.options", "tau"]),
        (["algo.loss.options.tua=0.1"], ["m2po"], True, ["algo.loss.options", "'m2po'", "'tua'", "did you mean 'tau'"]),
        (["algo.loss.options.variant=clip"], ["m2po"], True, ["algo.loss.options", "variant"]),
        (["algo.loss.options.tau=0.04"], [], True, ["algo.loss.options", "'grpo'", "'tau'"]),
        (["buffer.staleness=-1"], [], True, ["buffer.staleness"]),
        (["algo.loss.name=ppo2"], [], True, ["algo.loss.name", "ppo2"]),
        (["algo.routing.replay=r4"], [], True, ["algo.routing.replay", "r4"]),
        (["algo.correction.mode=clip"], [], True, ["algo.correction.mode"]),
        (["algo.correction.level=batch"], [], True, ["algo.correction.level"]),
        (["algo.old_logp_source=rollout"], [], True, ["algo.old_logp_source"]),
        (["buffer.mode=sometimes"], [], True, ["buffer.mode"]),
        (["algo.loss.agg=token-sum-mean"], [], True, ["algo.loss.agg"]),
        (["algo.loss.options.clip_low=-0.1"], [], True, ["algo.loss.options", "clip_low"]),
        (["algo.loss.options.clip_high=-0.2"], [], True, ["algo.loss.options", "clip_high"]),
        (["algo.loss.options.clip_low=1.0"], [], True, ["algo.loss.options", "clip_low"]),
        (["algo.loss.options.dual_clip=0.5"], [], True, ["algo.loss.options", "dual_clip"]),
        (["algo.loss.options.clip_low=1.0"], ["cispo"], True, ["algo.loss.options", "'cispo'", "clip_low"]),
        (["algo.correction.high=0"], [], True, ["algo.correction.high"]),
        (["algo.correction.low=3", "algo.correction.high=2"], [], True, ["algo.correction.low", "algo.correction.high"]),
        (["rollout.group_size=0"], [], True, ["rollout.group_size"]),
        (["rollout.temperature=0"], [], True, ["rollout.temperature"]),
        (["rollout.top_p=1.5"], [], True, ["rollout.top_p"]),
        (["trainer.updates_per_step=0"], [], True, ["trainer.updates_per_step"]),
        (["trainer.updates_per_step=64", "trainer.grad_accum=4"], [], True, ["trainer.updates_per_step", "trainer.grad_accum"]),
        (["optim.lr=0"], [], True, ["optim.lr"]),
        (["optim.betas=[0.9,1.5]"], [], True, ["optim.betas"]),
        (["algo.kl.coef=-1"], [], True, ["algo.kl.coef"]),
        (["algo.kl.kind=k9"], [], True, ["algo.kl.kind"]),
        (["model.top_k=9"], [], True, ["model.top_k"]),
        (["model.head_dim=1"], [], True, ["model.head_dim", "even"]),       # rotary pairs: a crash inside the run before
        (["task.operators=/"], [], True, ["task.operators"]),
        (["task.name=gsm8k"], [], True, ["task.name"]),
        (["model.preset=tiny-llama"], [], True, ["model.preset"]),
        (["model.path=/path/to/Qwen3-30B-A3B"], [], None, ["model.path", "placeholder"]),
        (["logging.loggers=[console,tensorboard]"], [], True, ["logging.loggers"]),
        (["algo.routing.pr2_feature_sample_rate=0"], [], True, ["algo.routing.pr2_feature_sample_rate"]),
        (["rollout.dtype=int8"], [], True, ["rollout.dtype"]),
    ],
)
def test_invalid_combination_refused_naming_keys(overrides, presets, moe, keys):
    msg = _err(overrides, presets, moe)
    for k in keys:
        assert k in msg, (k, msg)


def test_all_errors_reported_at_once():
    msg = _err(["buffer.staleness=-1", "algo.loss.options.tau=0"], ["m2po"])
    assert "2 problems" in msg and "buffer.staleness" in msg and "algo.loss.options" in msg and "tau" in msg


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    "overrides,presets,keys",
    [
        (["algo.loss.agg=seq-mean-token-sum"], ["gspo"], ["algo.loss.agg", "gspo"]),
        (["algo.loss.agg=token-mean"], ["gspo"], ["algo.loss.agg", "gspo"]),
        (["rollout.group_size=1"], [], ["rollout.group_size", "adv_norm"]),
        ([], ["r2"], ["r2", "trainer.updates_per_step"]),
        (["trainer.updates_per_step=3"], [], ["trainer.updates_per_step"]),
        (["algo.correction.high=0.5"], ["tis"], ["algo.correction.high"]),
        (["algo.routing.drift_metrics=true"], [], ["algo.routing.drift_metrics", "off-policy"]),
    ],
)
def test_warnings_name_keys(overrides, presets, keys):
    warnings = validate(load_config(overrides=overrides, presets=presets), model_is_moe=True)
    assert len(warnings) == 1, warnings
    for k in keys:
        assert k in warnings[0], (k, warnings)


def test_gspo_default_agg_has_no_warning():
    assert validate(load_config(presets=["gspo"], overrides=["trainer.updates_per_step=4"]), model_is_moe=True) == []


def test_infer_model_is_moe(tmp_path):
    assert infer_model_is_moe(load_config()) is True
    assert infer_model_is_moe(load_config(overrides=["model.preset=tiny-dense"])) is False
    assert infer_model_is_moe(load_config(overrides=[f"model.path={tmp_path}/missing"])) is None
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps({"num_experts": 128, "num_experts_per_tok": 8}))
    (tmp_path / "dense").mkdir()
    (tmp_path / "dense" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    assert infer_model_is_moe(load_config(overrides=[f"model.path={tmp_path}/moe"])) is True
    assert infer_model_is_moe(load_config(overrides=[f"model.path={tmp_path}/dense"])) is False
    # inferred dense -> replay refused without passing model_is_moe
    cfg = load_config(presets=["r3"], overrides=[f"model.path={tmp_path}/dense"])
    with pytest.raises(ConfigError, match="algo.routing.replay=r3"):
        validate(cfg)
    cfg = load_config(presets=["r3"], overrides=["model.preset=tiny-dense"])
    with pytest.raises(ConfigError, match="dense"):
        validate(cfg)


def test_router_aux_loss_coef_is_refused_not_ignored():
    """The trainer adds no load-balancing loss: a non-zero coefficient used to be accepted and silently ignored."""
    with pytest.raises(ConfigError, match="algo.router_aux_loss_coef"):
        validate(load_config(overrides=["algo.router_aux_loss_coef=0.01"]), model_is_moe=True)
    validate(load_config(overrides=["algo.router_aux_loss_coef=0"]), model_is_moe=True)


def test_float16_training_weights_are_refused_before_compute():
    """model.dtype=float16 used to pass validation and then fail at the first SFT step with a NaN loss."""
    with pytest.raises(ConfigError, match="model.dtype=float16"):
        validate(load_config(overrides=["model.dtype=float16"]), model_is_moe=True)
    validate(load_config(overrides=["rollout.dtype=float16"]), model_is_moe=True)     # the engine may run fp16


@pytest.mark.parametrize("overrides, key", [
    (["buffer.mode=async", "preset=[pr2]"], "replay=pr2"),
    (["buffer.mode=async", "preset=[r2]", "rollout.update_in_flight=true"], "update_in_flight"),
])
def test_async_combinations_it_cannot_run_are_refused_before_compute(overrides, key):
    """These passed --dry-run and failed only once the trainer had built the model and the pipeline."""
    with pytest.raises(ConfigError, match=key):
        validate(load_config(overrides=overrides), model_is_moe=True)


def test_drift_metrics_need_engine_routes():
    """drift/* compares the engine's recorded routes with the current router: without them it would log nothing."""
    with pytest.raises(ConfigError, match="drift_metrics=true needs the engine's routes"):
        validate(load_config(overrides=["algo.routing.drift_metrics=true", "algo.routing.metrics=false",
                                        "trainer.updates_per_step=2"]), model_is_moe=True)
    for preset in ("r3", "pr2"):     # replay records the engine's routes anyway
        validate(load_config(presets=[preset], overrides=["algo.routing.drift_metrics=true",
                                                          "algo.routing.metrics=false", "trainer.updates_per_step=2"]),
                 model_is_moe=True)
    warnings = validate(load_config(overrides=["algo.routing.drift_metrics=true", "trainer.updates_per_step=2"]),
                        model_is_moe=False)
    assert any("drift_metrics" in w and "dense" in w for w in warnings)
