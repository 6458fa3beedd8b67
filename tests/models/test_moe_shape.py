"""``moe_shape`` reads every MoE family's expert count and top-k, from config objects and from ``config.json``."""
import json

import pytest
import transformers

from offpolicy_moe.config import load_config
from offpolicy_moe.config.validate import infer_model_is_moe
from offpolicy_moe.models import declares_moe, moe_shape

# (config class, kwargs naming 6 routed experts and top-3 in the family's own words)
FAMILIES = [
    ("Qwen3MoeConfig", {"num_experts": 6, "num_experts_per_tok": 3}),
    ("Qwen2MoeConfig", {"num_experts": 6, "num_experts_per_tok": 3}),
    ("OlmoeConfig", {"num_experts": 6, "num_experts_per_tok": 3}),
    ("JambaConfig", {"num_experts": 6, "num_experts_per_tok": 3}),
    ("MixtralConfig", {"num_local_experts": 6, "num_experts_per_tok": 3}),
    ("PhimoeConfig", {"num_local_experts": 6, "num_experts_per_tok": 3}),
    ("GraniteMoeConfig", {"num_local_experts": 6, "num_experts_per_tok": 3}),
    ("GptOssConfig", {"num_local_experts": 6, "num_experts_per_tok": 3}),
    ("DeepseekV3Config", {"n_routed_experts": 6, "num_experts_per_tok": 3, "n_group": 1, "topk_group": 1}),
    ("Glm4MoeConfig", {"n_routed_experts": 6, "num_experts_per_tok": 3, "n_group": 1, "topk_group": 1}),
    ("Ernie4_5_MoeConfig", {"moe_num_experts": 6, "moe_k": 3}),
    ("HunYuanMoEV1Config", {"num_experts": 6, "moe_topk": 3}),
    ("DbrxConfig", {"ffn_config": {"moe_num_experts": 6, "moe_top_k": 3}}),
    ("Llama4Config", {"text_config": {"num_local_experts": 6, "num_experts_per_tok": 3}}),
]


@pytest.mark.parametrize("name,kwargs", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_every_family_object_and_json(name, kwargs, tmp_path):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers has no {name}")
    config = cls(**kwargs)
    assert moe_shape(config) == (6, 3)
    as_json = json.loads(json.dumps(config.to_dict(), default=str))
    assert moe_shape(as_json) == (6, 3)
    assert declares_moe(config) and declares_moe(as_json)
    # validation reads the same function from model.path/config.json
    (tmp_path / "config.json").write_text(json.dumps(as_json))
    assert infer_model_is_moe(load_config(overrides=[f"model.path={tmp_path}"])) is True


def test_deepseek_v3_routed_experts_not_missed():
    """The checkpoint signature used num_experts/num_local_experts only: DeepSeek-V3 gave None."""
    cfg = transformers.DeepseekV3Config(n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1)
    assert moe_shape(cfg) == (256, 8)


def test_dense_and_degenerate_configs():
    assert moe_shape(transformers.Qwen3Config()) == (None, None)
    assert not declares_moe(transformers.Qwen3Config())
    assert moe_shape({"hidden_size": 8}) == (None, None)
    assert moe_shape({"num_experts": 0, "num_local_experts": 4, "num_experts_per_tok": True, "top_k": 2}) == (4, 2)
    assert not declares_moe({"num_experts": 1, "num_experts_per_tok": 1})


#: routers that choose among more ids than the config's routed experts: LongCat-Flash adds ``zero_expert_num``
#: zero-computation experts, Zaya one more id than ``num_experts``
EXTRA_CHOICES = {"longcat_flash", "zaya"}


@pytest.mark.slow
def test_moe_shape_agrees_with_the_routing_controller_on_every_scanned_family():
    """The config reader and the router discovery see the same (experts, top-k) on every supported MoE family of the
    installed transformers (found by scan); Gemma 4's ``top_k_experts`` was missed before."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "routing"))
    from family_models import make_family_model

    from offpolicy_moe.routing import RoutingController, UnsupportedRouterError
    from offpolicy_moe.routing.families import scan_moe_families

    checked = 0
    for fam in scan_moe_families():
        model = make_family_model(fam.model_type)
        try:
            ctl = RoutingController(model)
        except UnsupportedRouterError:
            continue
        n, k = moe_shape(model.config)
        assert k == ctl.top_k, fam.model_type
        assert n == ctl.num_experts or (fam.model_type in EXTRA_CHOICES and n < ctl.num_experts), fam.model_type
        checked += 1
    assert checked >= 57
