"""MoE routing for Hugging Face models: route traces, R3/R2 replay, PR2 predictors, routing metrics (torch and
transformers only; any transformers 5.x MoE whose router returns ``(logits, weights, indices)``).

* R3 (Ma et al., arXiv:2510.11370): the engine records routes in ``generate``; the trainer replays them.
* R2 (Zheng et al., arXiv:2507.18071): the trainer records in its old-logprob pass and replays in the updates.
* PR2 (Dong et al., arXiv:2606.00395): engine routes on ``logits + h W_p``; features train ``W_p``.
* A fixed, seeded router-weight perturbation ``dW`` (``perturb.py``): the engine routes on ``logits + h dW^T``.
"""
from .adapters import (ROUTER_ADAPTERS, RouterAdapter, UnsupportedRouterError, get_router_adapter,
                       register_router_adapter)
from .capture import Recorder, RouterCapture
from .controller import RouterBypassError, RoutingController, UnsupportedGenerationError
from .metrics import (GUARDRAIL_METRICS, RouteComparison, compare_traces, replay_guardrails, routing_metrics,
                      zero_deviation)
from .perturb import perturbation_seed, router_perturbation
from .pr2 import FeatureCache, PR2Features, PR2Predictors, cat_features, pr2_param_group, pr2_predictor_loss
from .trace import (INT16_SENTINEL, UINT8_SENTINEL, RouteTrace, TraceValidationError, cat_traces, pack_tokens,
                    repad, sentinel_for, storage_dtype, unpack_tokens)

__all__ = [
    "RouteTrace", "TraceValidationError", "cat_traces", "repad", "pack_tokens", "unpack_tokens", "storage_dtype",
    "sentinel_for", "UINT8_SENTINEL", "INT16_SENTINEL",
    "RoutingController", "Recorder", "RouterCapture", "RouterBypassError", "UnsupportedGenerationError",
    "UnsupportedRouterError", "RouterAdapter", "ROUTER_ADAPTERS", "register_router_adapter", "get_router_adapter",
    "PR2Predictors", "FeatureCache", "PR2Features", "cat_features", "pr2_predictor_loss", "pr2_param_group",
    "RouteComparison", "compare_traces", "routing_metrics", "zero_deviation", "replay_guardrails", "GUARDRAIL_METRICS",
    "router_perturbation",
    "perturbation_seed",
]
