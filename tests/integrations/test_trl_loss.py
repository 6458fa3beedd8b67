"""The TRL plug-in's loss and gradients equal this library's loss functions applied as the project's trainer applies
them: global token / sequence counts over the optimizer step's micro-batches, M2PO's selection over all of them,
correction weights from the generation-time log-probs, the same advantages."""
from __future__ import annotations

import pytest
import torch

from offpolicy_moe.losses import (correction_weights, get_loss_spec, get_policy_loss, global_counts,
                                  list_policy_losses, m2po_mask)
from offpolicy_moe.routing import RouteTrace, RoutingController
from tests.losses import aggregation_table
from trl_fixtures import trainer

GA = 2


def _generation_batch(tr):
    """TRL's buffered micro-batches of one generation (its own ``_prepare_inputs`` at step 0)."""
    tr.model.train()
    raw = next(iter(tr.get_train_dataloader()))
    tr._step = 0
    tr._prepare_inputs(raw)
    return list(tr._buffered_inputs)


def _reference_logp(model, p, routes):
    """log pi(token) of the completion columns by a plain forward (logits / temperature), replaying ``routes``."""
    ids = torch.cat([p["prompt_ids"], p["completion_ids"]], 1)
    att = torch.cat([p["prompt_mask"], p["completion_mask"]], 1)
    width = p["completion_ids"].shape[1]
    ctx = RoutingController(model).replay(routes) if routes is not None else torch.enable_grad()
    with ctx:
        logits = model(input_ids=ids, attention_mask=att).logits[:, -width - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, p["completion_ids"].unsqueeze(-1)).squeeze(-1)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss,options,agg,replay,corr", [
    ("m2po", {"tau": 0.03}, None, "r3", "truncate"),
    ("grpo", {"clip_low": 0.1, "clip_high": 0.1}, "seq-mean-token-mean", "none", "mask"),
    ("cispo", {}, "seq-mean-token-sum-norm", "r3", "none"),
    ("gspo", {}, "token-mean", "r3", "opsm"),
])
def test_plugin_loss_and_grads_equal_library_loss(tmp_path, loss, options, agg, replay, corr):
    tr = trainer(tmp_path, gradient_accumulation_steps=GA, per_device_train_batch_size=4, num_generations=4,
                 policy_loss=loss, policy_loss_options=options, loss_agg=agg, routing_replay=replay,
                 correction_mode=corr, correction_high=1.001, router_perturb=1.0)
    parts = _generation_batch(tr)
    assert len(parts) == GA
    model = tr.model
    with torch.no_grad():          # the policy moved since generation: ratios != 1, M2PO has something to select
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.zero_grad(set_to_none=True)
    plugin_losses = []
    for j, p in enumerate(parts):
        tr._step = j
        loss_j = tr.compute_loss(model, p)
        loss_j.backward()
        plugin_losses.append(loss_j.detach())
    plugin_grads = _grads(model)

    # the reference: the library's functions, as the project's trainer calls them
    model.zero_grad(set_to_none=True)
    c = RoutingController(model)
    routes = [RouteTrace(p["route_ids"], c.num_experts, c.top_k, c.layer_ids) if replay == "r3" else None
              for p in parts]
    masks = [p["completion_mask"] for p in parts]
    n_tok, n_seq = global_counts(masks)
    olds = [p["old_per_token_logps"] for p in parts]
    sel = [{} for _ in parts]
    if loss == "m2po":
        with torch.no_grad():
            lrs = [_reference_logp(model, p, r) - o for p, r, o in zip(parts, routes, olds)]
        keeps = m2po_mask(lrs, [p["advantages"] for p in parts], masks, tau=options["tau"])
        trust_dropped = sum(int((m.bool() & ~k).sum()) for m, k in zip(masks, keeps))
        assert trust_dropped > 0, "the test needs M2PO to drop tokens"
        local = [m2po_mask(lr, p["advantages"], m, tau=options["tau"]) for lr, p, m in zip(lrs, parts, masks)]
        assert any(not torch.equal(lo, k) for lo, k in zip(local, keeps)), "global and per-micro-batch agree"
        sel = [{"m2po_keep": k} for k in keeps]
    fn = get_policy_loss(loss)
    ref_losses = []
    for p, r, o, m, s in zip(parts, routes, olds, masks, sel):
        w = None
        if corr != "none":
            w, _ = correction_weights(o, p["sampling_per_token_logps"], m, mode=corr, high=1.001,
                                      advantages=p["advantages"])
            assert torch.equal(w, p["correction_weights"])
            if corr != "opsm":
                assert bool((w != m.float()).any()), "the test needs weights other than 1"
        lp = _reference_logp(model, p, r)
        ref, _ = fn(lp, o, p["advantages"], m, agg=agg, weights=w, num_tokens=n_tok, num_seqs=n_seq,
                    norm_length=tr.args.max_completion_length, **options, **s)
        ref.backward()
        ref_losses.append(ref.detach())
    ref_grads = _grads(model)
    torch.testing.assert_close(torch.stack(plugin_losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    assert plugin_grads.keys() == ref_grads.keys() and plugin_grads
    for name in ref_grads:
        torch.testing.assert_close(plugin_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(float(g.abs().max()) > 0 for g in ref_grads.values())


@pytest.mark.parametrize("name", list_policy_losses())
def test_every_registered_loss_matches_the_library(tmp_path, name):
    """Every loss of the registry, default options, through the plug-in: loss and gradients equal the registry
    function called with the global counts, the correction weights and (if the loss declares one) its
    mini-batch-wide selection pass over both micro-batches."""
    spec = get_loss_spec(name)
    tr = trainer(tmp_path, gradient_accumulation_steps=GA, policy_loss=name, routing_replay="r3",
                 correction_mode="truncate", correction_high=1.001, router_perturb=1.0)
    parts = _generation_batch(tr)
    model = tr.model
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.zero_grad(set_to_none=True)
    plugin_losses = []
    for j, p in enumerate(parts):
        tr._step = j
        loss_j = tr.compute_loss(model, p)
        loss_j.backward()
        plugin_losses.append(loss_j.detach())
    plugin_grads = _grads(model)

    model.zero_grad(set_to_none=True)
    c = RoutingController(model)
    routes = [RouteTrace(p["route_ids"], c.num_experts, c.top_k, c.layer_ids) for p in parts]
    masks = [p["completion_mask"] for p in parts]
    n_tok, n_seq = global_counts(masks)
    sel = [{} for _ in parts]
    if spec.wants_global_pass({}):
        with torch.no_grad():
            lrs = [_reference_logp(model, p, r) - p["old_per_token_logps"] for p, r in zip(parts, routes)]
        sel = spec.run_global_pass(lrs, [p["advantages"] for p in parts], masks, {})
    ref_losses = []
    for p, r, m, s in zip(parts, routes, masks, sel):
        w, _ = correction_weights(p["old_per_token_logps"], p["sampling_per_token_logps"], m, high=1.001)
        ref, _ = spec.fn(_reference_logp(model, p, r), p["old_per_token_logps"], p["advantages"], m, weights=w,
                         num_tokens=n_tok, num_seqs=n_seq, norm_length=tr.args.max_completion_length, **s)
        ref.backward()
        ref_losses.append(ref.detach())
    ref_grads = _grads(model)
    torch.testing.assert_close(torch.stack(plugin_losses), torch.stack(ref_losses), rtol=1e-5, atol=1e-6)
    assert plugin_grads.keys() == ref_grads.keys() and plugin_grads
    for key in ref_grads:
        torch.testing.assert_close(plugin_grads[key], ref_grads[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("row", aggregation_table.rows("TRL"), ids=lambda r: r.loss)
def test_plugin_gives_trls_own_loss_with_all_masked_rows(tmp_path, row):
    """Each TRL row of docs/losses.md's aggregation table, on micro-batches with all-masked rows
    (``mask_truncated_completions``, a tool mask): TRL's own ``_compute_loss`` (real TRL, that ``loss_type`` and
    settings) and the plug-in with the row's loss, options and aggregation agree in value and gradient by default
    (``count_masked_rows=True``: TRL's row means count every row, the table's "counted"); with
    ``count_masked_rows=False`` the row-mean losses differ (rows with a valid token only), the token-mean ones do
    not."""
    trl_loss, ours, agg = row.loss, row.ours, row.aggregation
    from trl import GRPOTrainer

    tr = trainer(tmp_path, gradient_accumulation_steps=GA, policy_loss=ours, loss_agg=agg,
                 policy_loss_options=row.options)
    parts = _generation_batch(tr)
    for p, rows in zip(parts, ([1, 3], [0])):          # all-masked rows, as mask_truncated_completions leaves them
        p["completion_mask"] = p["completion_mask"].clone()
        p["completion_mask"][rows] = 0
    tokens = sum(p["completion_mask"].sum() for p in parts)
    for p in parts:                                     # TRL's token count of the generation batch, as TRL makes it
        p["num_items_in_batch"] = tokens.clone()
    model = tr.model
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    tr.current_gradient_accumulation_steps = GA

    def run(fn):
        model.zero_grad(set_to_none=True)
        losses = []
        for j, p in enumerate(parts):
            tr._step = j
            loss = fn(p)
            loss.backward()
            losses.append(loss.detach())
        return torch.stack(losses), _grads(model)

    saved = {k: getattr(tr, k) for k in ("loss_type", *row.settings)}
    for k, v in {"loss_type": trl_loss, **row.settings}.items():
        setattr(tr, k, v)
    theirs, g_theirs = run(lambda p: GRPOTrainer._compute_loss(tr, model, p))
    for k, v in saved.items():
        setattr(tr, k, v)
    ours_loss, g_ours = run(lambda p: tr.compute_loss(model, p))
    torch.testing.assert_close(ours_loss, theirs, rtol=1e-5, atol=1e-7)
    assert any(float(x.abs()) > 0 for x in theirs)
    for name in g_theirs:
        torch.testing.assert_close(g_ours[name], g_theirs[name], rtol=1e-4, atol=1e-7, msg=name)
    tr.args.count_masked_rows = False
    tr._window = None
    valid_only, _ = run(lambda p: tr.compute_loss(model, p))
    assert (row.empty_rows == "counted") == (agg != "token-mean")
    if row.empty_rows != "counted":
        torch.testing.assert_close(valid_only, theirs, rtol=1e-5, atol=1e-7)
    else:      # 8 rows of which 3 are empty: the row means are 8/5 of TRL's
        torch.testing.assert_close(valid_only.sum(), theirs.sum() * 8 / 5, rtol=1e-5, atol=1e-7)
