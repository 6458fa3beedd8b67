"""Every setting an engine refuses is refused first by the run's checks (``check_config``: ``train --dry-run`` and
a real start), in one line naming the key, before any engine, worker or actor starts.  The refusals are found, not
listed by hand: a static walk of the constructors' calls (tests/refusals.py) must reach no refusal that the checks
do not reach too, so a new one cannot be added to a constructor alone."""
from __future__ import annotations

import pytest
from transformers import BartConfig, Qwen3MoeConfig

from offpolicy_moe.cli import main
from offpolicy_moe.models.moe_shape import declares_moe
from offpolicy_moe.rollout.engine import ENGINES, EngineCapabilities, EngineNeeds, HFRolloutEngine, register_engine
from offpolicy_moe.rollout.worker import records_routes
from offpolicy_moe.trainer import trainer as trainer_module
from offpolicy_moe.trainer.checks import check_config, check_engine_settings
from tests.refusals import BUILT_IN, VLLM_CASES, constructors, error_lines, reachable, run_checks
from tests.tiny import tiny_config, tiny_policy


def test_every_refusal_of_a_constructor_is_made_first_by_the_runs_checks():
    built, checked = reachable(constructors()), reachable(run_checks())
    core = {"offpolicy_moe.rollout.engine.check_capabilities", "offpolicy_moe.rollout.vllm_engine.preflight",
            "offpolicy_moe.rollout.slots.check_slot_settings", "offpolicy_moe.rollout.vllm_start.route_source"}
    assert core <= set(built), sorted(built)              # the walk sees through the constructors
    missing = sorted(set(built) - set(checked))
    assert not missing, (f"refused by a constructor but not by check_config (train --dry-run): {missing}; move the "
                         "refusal into the engine's check_config, or into a function both call")


def test_every_refusing_function_has_a_setting_that_reaches_it():
    """A new refusing function needs its case in tests/refusals.py (and so a dry-run test in every mode)."""
    assert set(reachable(constructors())) == set(VLLM_CASES) | set(BUILT_IN)


@pytest.mark.parametrize("overrides, needs", [
    ((), EngineNeeds(records_routes="algo.routing.metrics=true")),
    (("preset=[grpo,tis,r3]", "rollout.top_p=0.9"), EngineNeeds(records_routes="algo.routing.replay=r3",
                                                                kept_tokens="rollout.top_p=0.9")),
    (("algo.routing.replay=pr2", "rollout.top_k=3"), EngineNeeds(records_routes="algo.routing.replay=pr2",
                                                                 router_offsets="algo.routing.replay=pr2",
                                                                 kept_tokens="rollout.top_k=3")),
    (("algo.routing.metrics=false", "rollout.router_noise=0.1"), EngineNeeds(router_offsets="rollout.router_noise=0.1")),
])
def test_the_checks_ask_the_named_engine_what_the_run_will_ask_of_it(tmp_path, overrides, needs):
    """``check_config`` dispatches to ``rollout.engine``'s own ``check_config`` with the run's needs, and those are
    what the trainer and the workers later ask ``make_engine`` for (same fields set, on the same model)."""
    seen = []

    class Probe(HFRolloutEngine):
        @classmethod
        def check_config(cls, rollout, model_config, needs=EngineNeeds()):
            seen.append(needs)

    register_engine("probe", Probe)
    try:
        cfg = tiny_config(tmp_path / "run", "rollout.engine=probe", *overrides)
        check_config(cfg)
    finally:
        del ENGINES["probe"]
    assert seen == [needs]
    model, _ = tiny_policy()
    asked = EngineNeeds.of_rollout(cfg.rollout, record_routes=records_routes(cfg, model),
                                   router_offsets={} if cfg.algo.routing.replay == "pr2" else None)
    assert [bool(getattr(asked, f)) for f in ("records_routes", "router_offsets", "kept_tokens")] == \
        [bool(getattr(needs, f)) for f in ("records_routes", "router_offsets", "kept_tokens")]
    assert declares_moe(model.config)


def test_a_model_the_native_sampler_cannot_run_is_refused_by_the_checks(tmp_path):
    bart = BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16)
    with pytest.raises(ValueError, match=r"^rollout.sampler=native needs a causal LM .* BartForCausalLM") as err:
        check_engine_settings(tiny_config(tmp_path, "rollout.sampler=native"), bart)
    assert "\n" not in str(err.value)
    check_engine_settings(tiny_config(tmp_path, "rollout.sampler=hf"), bart)         # generate() serves it


def test_a_model_the_stream_slots_cannot_cache_is_refused_by_the_checks(tmp_path):
    sliding = Qwen3MoeConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                             sliding_window=8, use_sliding_window=True)
    cfg = tiny_config(tmp_path, "buffer.mode=stream", "buffer.staleness=1")
    with pytest.raises(ValueError, match=r"^buffer.mode=stream needs full-attention KV-cache layers only") as err:
        check_engine_settings(cfg, sliding)
    assert "\n" not in str(err.value)
    check_engine_settings(tiny_config(tmp_path, "buffer.mode=async", "buffer.staleness=1"), sliding)


@pytest.mark.parametrize("mode", [(), ("buffer.mode=async", "buffer.staleness=1")])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_capability_the_engine_lacks_is_one_line_before_any_start(tmp_path, monkeypatch, capsys, mode, dry_run):
    """An engine without kept sets under top-p: ``train`` exits 2 with one line naming ``rollout.top_p``, and a real
    start never builds its run (no engine, no worker)."""
    class Plain(HFRolloutEngine):
        capabilities = EngineCapabilities(records_routes=True, router_offsets=True)

    def no_run(*args, **kwargs):
        raise AssertionError("the run was built: an engine or worker could start")

    monkeypatch.setattr(trainer_module, "build_run", no_run)      # what Trainer builds its run with
    register_engine("plain", Plain)
    try:
        rc = main(["train", "rollout.engine=plain", "rollout.top_p=0.9", *mode, "--run-dir", str(tmp_path / "run")]
                  + (["--dry-run"] if dry_run else []))
    finally:
        del ENGINES["plain"]
    lines = error_lines(capsys.readouterr().err)
    assert rc == 2 and len(lines) == 1 and "rollout.top_p=0.9" in lines[0], lines
    assert not (tmp_path / "run").exists()
