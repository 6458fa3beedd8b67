"""Bad input: clear errors before any compute; degenerate batches; import hygiene."""
import math
import subprocess
import sys

import pytest
import torch

from loss_refs import make_batch
from offpolicy_moe.losses import (
    AGG_MODES,
    aggregate,
    cispo_loss,
    grpo_loss,
    gspo_loss,
    m2po_loss,
    m2po_mask,
    metrics_to_floats,
    unclipped_loss,
    value_checks,
)

LOSSES = [grpo_loss, gspo_loss, m2po_loss, unclipped_loss]


@pytest.mark.parametrize("fn", LOSSES)
def test_shape_mismatch_names_both_shapes(fn):
    logp, old, adv, mask, w = make_batch(B=4, T=6)
    with pytest.raises(ValueError, match=r"old_logp.*\(4, 5\)|\(4, 6\).*\(4, 5\)"):
        fn(logp, old[:, :5], adv, mask)
    with pytest.raises(ValueError, match=r"\(4, 6\).*\(3, 6\)"):
        fn(logp, old, adv, mask[:3])
    with pytest.raises(ValueError, match=r"advantages.*\(3,\).*\(4, 6\)"):
        fn(logp, old, adv[:3], mask)
    with pytest.raises(ValueError, match=r"weights.*\(4, 5\)|\(4, 6\).*\(4, 5\)"):
        fn(logp, old, adv, mask, weights=w[:, :5])
    with pytest.raises(ValueError, match="2-D"):
        fn(logp[0], old[0], adv, mask[0])


@pytest.mark.parametrize("fn", LOSSES)
def test_bad_mask_agg_and_nan(fn):
    logp, old, adv, mask, _ = make_batch(B=4, T=6)
    with pytest.raises(ValueError, match="0 and 1"):
        fn(logp, old, adv, mask.double() * 2)
    with pytest.raises(ValueError, match="valid modes: " + ", ".join(AGG_MODES)):
        fn(logp, old, adv, mask, agg="token-sum")
    bad = old.clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="old_logp contains NaN"):
        fn(logp, bad, adv, mask)
    bad_adv = adv.clone()
    bad_adv[0] = math.inf
    with pytest.raises(ValueError, match="advantages contains NaN or Inf"):
        fn(logp, old, bad_adv, mask)
    # NaN at a masked-out position is ignored, and so is a 0/1 float mask
    ok = old.clone()
    m = mask.clone()
    m[0, 3] = False
    ok[0, 3] = math.nan
    loss, _ = fn(logp, ok, adv, m.float())
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    # value checks can be switched off inside a block (shape checks still run)
    with value_checks(False):
        fn(logp, old, adv, mask.double() * 2)
        with pytest.raises(ValueError, match="shape"):
            fn(logp, old[:, :2], adv, mask)


def test_negative_clip_and_bad_options():
    logp, old, adv, mask, _ = make_batch(B=4, T=6)
    for fn in (grpo_loss, gspo_loss):
        with pytest.raises(ValueError, match="clip_low"):
            fn(logp, old, adv, mask, clip_low=-0.1)
        with pytest.raises(ValueError, match="clip_high"):
            fn(logp, old, adv, mask, clip_high=-1e-4)
    with pytest.raises(ValueError, match="dual_clip"):
        grpo_loss(logp, old, adv, mask, dual_clip=0.9)
    for tau in (0.0, -0.04, math.nan):
        with pytest.raises(ValueError, match="tau"):
            m2po_loss(logp, old, adv, mask, tau=tau)
        with pytest.raises(ValueError, match="tau"):
            m2po_mask(logp.detach() - old, adv, mask, tau=tau)
    with pytest.raises(ValueError, match="variant"):
        m2po_loss(logp, old, adv, mask, variant="clip")
    with pytest.raises(ValueError, match="scope"):
        m2po_loss(logp, old, adv, mask, scope="rank")
    with pytest.raises(ValueError, match=r"m2po_keep.*\(4, 5\)|\(4, 6\).*\(4, 5\)"):
        m2po_loss(logp, old, adv, mask, m2po_keep=mask[:, :5])
    with pytest.raises(ValueError, match="list length"):
        m2po_mask([old, old], [adv], [mask, mask])


@pytest.mark.parametrize("fn", LOSSES)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_all_masked_batch_gives_zero_loss_and_zero_grad(fn, agg):
    logp, old, adv, _, w = make_batch(B=4, T=6)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss, metrics = fn(logp, old, adv, mask, agg=agg, weights=w)
    (g,) = torch.autograd.grad(loss, logp)
    assert float(loss.detach()) == 0.0 and bool((g == 0).all())
    assert all(math.isfinite(v) for v in metrics_to_floats(metrics).values())


def test_metrics_are_detached_zero_dim_tensors():
    logp, old, adv, mask, w = make_batch()
    for fn in LOSSES:
        _, metrics = fn(logp, old, adv, mask, weights=w)
        for k, v in metrics.items():
            assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad, k
        floats = metrics_to_floats(metrics)
        assert list(floats) == list(metrics) and all(isinstance(v, float) for v in floats.values())


def test_losses_import_torch_only():
    code = (
        "import sys, offpolicy_moe.losses, offpolicy_moe.integrations.verl\n"
        "bad = [m for m in ('transformers', 'accelerate', 'datasets', 'verl', 'wandb', 'numpy.random._x') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"offpolicy_moe.losses imported {out.stdout.strip()}"


ALL_LOSSES = LOSSES + [cispo_loss]


@pytest.mark.parametrize("fn", ALL_LOSSES)
def test_bad_counts_and_norm_length_raise_naming_the_argument(fn):
    """Negative or NaN counts used to be treated as 1 (silently); they are refused before compute."""
    logp, old, adv, mask, _ = make_batch(B=4, T=6)
    for bad in (-1, -0.5, math.nan, math.inf, True):
        with pytest.raises(ValueError, match=r"^num_tokens must be a finite number >= 0"):
            fn(logp, old, adv, mask, num_tokens=bad)
        with pytest.raises(ValueError, match=r"^num_seqs must be a finite number >= 0"):
            fn(logp, old, adv, mask, num_seqs=bad, agg="seq-mean-token-mean")
    for bad in (torch.tensor(-3), torch.tensor(math.nan)):
        with pytest.raises(ValueError, match=r"^num_tokens must be a finite number >= 0"):
            fn(logp, old, adv, mask, num_tokens=bad)
    with pytest.raises(ValueError, match=r"num_tokens must be a number or a one-element tensor"):
        fn(logp, old, adv, mask, num_tokens=torch.tensor([3, 4]))
    for bad in (0, -2, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"^norm_length must be a finite number > 0"):
            fn(logp, old, adv, mask, norm_length=bad, agg="seq-mean-token-mean")
    fn(logp, old, adv, mask, num_tokens=torch.tensor(7), num_seqs=3)  # valid counts pass


def test_aggregate_refuses_bad_counts():
    logp, _, _, mask, _ = make_batch(B=3, T=4)
    with pytest.raises(ValueError, match=r"^num_tokens must be a finite number >= 0, got -1"):
        aggregate(logp, mask, num_tokens=-1)
    with pytest.raises(ValueError, match=r"^num_seqs must be a finite number >= 0, got nan"):
        aggregate(logp, mask, "seq-mean-token-mean", num_seqs=math.nan)


@pytest.mark.parametrize("fn", [grpo_loss, gspo_loss, cispo_loss])
@pytest.mark.parametrize("bad", [1.0, 1.5])
def test_clip_low_of_one_or_more_is_refused(fn, bad):
    logp, old, adv, mask, _ = make_batch(B=4, T=6)
    with pytest.raises(ValueError, match=r"^clip_low must be < 1"):
        fn(logp, old, adv, mask, clip_low=bad)


def test_negative_or_nan_m2po_cap_is_refused():
    logp, old, adv, mask, _ = make_batch(B=4, T=6)
    for bad in (-1.0, math.nan, torch.tensor(-0.5, dtype=torch.float64), torch.tensor(math.nan)):
        with pytest.raises(ValueError, match=r"^m2po_cap must be"):
            m2po_loss(logp, old, adv, mask, variant="adaptive_clip", m2po_cap=bad)
    for ok in (0.0, math.inf, torch.tensor(0.3, dtype=torch.float64)):
        loss, _ = m2po_loss(logp, old, adv, mask, variant="adaptive_clip", m2po_cap=ok)
        assert torch.isfinite(loss)
