"""``RoutingController.offsets(..., fixed=dW)``: a fixed router-weight perturbation composed with PR2 offsets, on an
adapter family (Qwen3-MoE) and generic-rule families (the probe path when selection and weights differ)."""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.routing import PR2Predictors, RoutingController, compare_traces, router_perturbation

from family_models import VOCAB, make_family_model


@pytest.mark.parametrize("family", ["qwen3_moe", "flex_olmo", "deepseek_v32"])
def test_fixed_offsets_compose_with_predictors_and_always_reach_the_weights(family):
    torch.manual_seed(0)
    model = make_family_model(family)
    ctl = RoutingController(model)
    pert = router_perturbation(ctl.hidden_size, ctl.num_experts, ctl.num_moe_layers, 1.0, seed=3)
    zero = PR2Predictors.from_controller(ctl)
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    out, routes = {}, {}
    with torch.no_grad():
        for name, kw in (("alone", dict(predictors=pert)), ("composed", dict(predictors=zero, fixed=pert)),
                         ("pr2_not_in_weights", dict(predictors=zero, fixed=pert, in_weights=False))):
            with ctl.offsets(**kw), ctl.record() as used, ctl.record("own") as own:
                out[name] = model(input_ids=ids).logits
            routes[name], routes[name + "/own"] = used.trace(), own.trace()
    # the perturbation alone through `predictors` or as `fixed` under zero predictors: the same routing; with the
    # PR2 bias kept out of the weights, the fixed part still enters them
    for name in ("composed", "pr2_not_in_weights"):
        assert torch.equal(routes[name].ids, routes["alone"].ids), name
        torch.testing.assert_close(out[name], out["alone"], rtol=0, atol=1e-5)
    differs = compare_traces(routes["alone"], routes["alone/own"]).differs
    assert float(differs.float().mean()) > 0.1                 # the perturbed choice is not the router's own
    with pytest.raises(ValueError, match=r"fixed have \(L, E, H\)"):
        with ctl.offsets(zero, fixed=PR2Predictors(ctl.hidden_size + 1, ctl.num_experts, ctl.num_moe_layers)):
            pass
