"""One process of the two-process TRL test (launched by torchrun, gloo on CPU): the plug-in's gradient, averaged
over processes as DDP does, against the library's loss over the union of both processes' micro-batches."""
from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[2]))     # the repository root: ``tests.*``

from offpolicy_moe.losses import correction_weights, get_policy_loss, global_counts, m2po_mask  # noqa: E402
from offpolicy_moe.routing import RouteTrace, RoutingController  # noqa: E402
from trl_fixtures import trainer  # noqa: E402
from test_trl_loss import _generation_batch, _reference_logp  # noqa: E402

GA, TAU = 2, 0.01


def main(out: pathlib.Path) -> None:
    tr = trainer(out, gradient_accumulation_steps=GA, policy_loss="m2po", policy_loss_options={"tau": TAU},
                 correction_mode="truncate", correction_high=1.001, routing_replay="r3", router_perturb=1.0,
                 ddp_backend="gloo")
    world, rank = tr.accelerator.num_processes, tr.accelerator.process_index
    parts = _generation_batch(tr)
    model = tr.accelerator.unwrap_model(tr.model)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)        # the same move on every process
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.zero_grad(set_to_none=True)
    for j, p in enumerate(parts):
        tr._step = j
        tr.compute_loss(model, p).backward()
    plugin = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.detach().clone()
            dist.all_reduce(grad)
            plugin[n] = grad / world                   # DDP's average

    gathered = [None] * world
    dist.all_gather_object(gathered, [{k: v for k, v in p.items()} for p in parts])
    union = [p for rank_parts in gathered for p in rank_parts]   # rank-major, as the distributed selection
    model.zero_grad(set_to_none=True)
    c = RoutingController(model)
    routes = [RouteTrace(p["route_ids"], c.num_experts, c.top_k, c.layer_ids) for p in union]
    masks = [p["completion_mask"] for p in union]
    n_tok, n_seq = global_counts(masks)
    with torch.no_grad():
        lrs = [_reference_logp(model, p, r) - p["old_per_token_logps"] for p, r in zip(union, routes)]
    keeps = m2po_mask(lrs, [p["advantages"] for p in union], masks, tau=TAU)
    mine = slice(rank * len(parts), (rank + 1) * len(parts))
    alone = m2po_mask(lrs[mine], [p["advantages"] for p in union[mine]], masks[mine], tau=TAU)
    differs = any(not torch.equal(a, k) for a, k in zip(alone, keeps[mine]))
    fn = get_policy_loss("m2po")
    for p, r, m, k in zip(union, routes, masks, keeps):
        w, _ = correction_weights(p["old_per_token_logps"], p["sampling_per_token_logps"], m, high=1.001)
        loss, _ = fn(_reference_logp(model, p, r), p["old_per_token_logps"], p["advantages"], m, weights=w,
                     num_tokens=n_tok, num_seqs=n_seq, norm_length=tr.args.max_completion_length, tau=TAU,
                     m2po_keep=k)
        loss.backward()
    worst = max(float((plugin[n] - p.grad).abs().max()) for n, p in model.named_parameters() if p.grad is not None)
    scale = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    dropped = sum(int((m.bool() & ~k).sum()) for m, k in zip(masks, keeps))
    (out / f"rank{rank}.json").write_text(json.dumps({"world": world, "worst": worst, "scale": scale,
                                                       "dropped": dropped, "differs": differs, "same_keys": sorted(plugin) == sorted(
                                                           n for n, p in model.named_parameters()
                                                           if p.grad is not None)}))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
