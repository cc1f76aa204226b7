"""Tests of policygrad.core.policy_losses: vanilla, PPO (clip-higher, dual clip), GSPO and CISPO,
values and gradients worked by hand, and the metrics every policy loss shares."""

from __future__ import annotations

import pytest
import torch

from policygrad.core.losses import get_policy_loss
from policygrad.core.masking import aggregate
from policygrad.core.policy_losses import cispo_loss, gspo_loss, ppo_loss, vanilla_loss

pytestmark = pytest.mark.unit

NAN = float("nan")
F64 = torch.float64


def _from_ratios(ratios, old=-1.0):
    """logprobs (leaf, float64, requires grad) with exp(logprobs - old) = ratios; old_logprobs."""
    r = torch.tensor(ratios, dtype=F64)
    old_lp = torch.full_like(r, old)
    lp = (r.log() + old_lp).requires_grad_(True)
    return lp, old_lp


def _token_grads(loss_matrix, lp):
    (grad,) = torch.autograd.grad(loss_matrix.sum(), lp)
    return grad


def test_the_registered_losses_are_these_functions():
    assert [get_policy_loss(n) for n in ("vanilla", "ppo", "gspo", "cispo")] == [
        vanilla_loss,
        ppo_loss,
        gspo_loss,
        cispo_loss,
    ]


# ------------------------------------------------------------------------------------------
# vanilla / PPO


def test_vanilla_hand_value():
    # loss = -A * logprob: [-(2)(-0.5), -(-1)(-2)] = [1.0, -2.0]; gradient d/dlp = -A = [-2, 1]
    lp = torch.tensor([[-0.5, -2.0, NAN]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = get_policy_loss("vanilla")(lp, lp.detach(), adv, mask)
    torch.testing.assert_close(loss, torch.tensor([[1.0, -2.0, 0.0]], dtype=F64))
    torch.testing.assert_close(_token_grads(loss, lp), torch.tensor([[-2.0, 1.0, 0.0]], dtype=F64))
    assert metrics["clipfrac"].item() == 0.0
    assert metrics["ratio_mean"].item() == 1.0
    assert metrics["approx_kl"].item() == 0.0
    assert metrics["num_tokens"].item() == 2


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo"])
def test_ratio_one_gives_exactly_the_vanilla_gradient(name):
    # Fresh samples (pi = pi_old): ratio = exp(0) = 1 exactly; every surrogate's gradient is -A grad log pi.
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 6, generator=g)).requires_grad_(True)
    adv = torch.randn(4, 1, generator=g).expand(4, 6).contiguous()  # per-sequence advantage (GSPO)
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [1] * 5 + [0], [1] + [0] * 5])
    ref_loss, _ = get_policy_loss("vanilla")(lp, lp.detach(), adv, mask)
    loss, metrics = get_policy_loss(name)(lp, lp.detach(), adv, mask)
    for mode in ("token-mean", "seq-mean-token-mean"):
        (g_ref,) = torch.autograd.grad(aggregate(ref_loss, mask, mode), lp, retain_graph=True)
        (g_new,) = torch.autograd.grad(aggregate(loss, mask, mode), lp, retain_graph=True)
        assert torch.equal(g_ref, g_new)
    assert metrics["clipfrac"].item() == 0.0
    assert metrics["ratio_mean"].item() == 1.0


def test_case9_ppo_four_regions_and_clipfrac():
    # eps = 0.2, band [0.8, 1.2]. loss = -min(r A, clip(r) A); d loss / d logprob = -A r where the
    # unclipped term is selected, 0 where the clipped (constant) term is selected:
    #   (0.5, +1): min(0.5, 0.8) = 0.5 unclipped   -> loss -0.5, grad -0.5
    #   (1.5, +1): min(1.5, 1.2) = 1.2 clipped     -> loss -1.2, grad 0      (clipfrac_high)
    #   (0.5, -1): min(-0.5, -0.8) = -0.8 clipped  -> loss  0.8, grad 0      (clipfrac_low)
    #   (1.5, -1): min(-1.5, -1.2) = -1.5 unclipped -> loss 1.5, grad +1.5   (undo a mistake)
    lp, old = _from_ratios([[0.5, 1.5, 0.5, 1.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 4)
    loss, metrics = get_policy_loss("ppo")(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.2, 0.8, 1.5]], dtype=F64))
    grad = _token_grads(loss, lp)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.0, 0.0, 1.5]], dtype=F64))
    assert grad[0, 1].item() == 0.0 and grad[0, 2].item() == 0.0
    assert metrics["clipfrac"].item() == pytest.approx(0.5, abs=1e-7)
    assert metrics["clipfrac_low"].item() == pytest.approx(0.25, abs=1e-7)
    assert metrics["clipfrac_high"].item() == pytest.approx(0.25, abs=1e-7)
    assert metrics["clipfrac_dual"].item() == 0.0
    # ratio_mean = (0.5 + 1.5 + 0.5 + 1.5) / 4 = 1.0; ratio_max 1.5
    # approx_kl = mean of (r - 1) - log r = 2 * (-0.5 + 0.693147) + 2 * (0.5 - 0.405465) = 0.575364 / 4
    assert metrics["ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)
    assert metrics["ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert metrics["approx_kl"].item() == pytest.approx(0.143841, abs=1e-6)


def test_ppo_inside_band_and_clip_higher():
    # Inside the band both signs flow: (1.1, +1) -> grad -1.1; (0.9, -1) -> grad +0.9.
    # Clip-higher 0.28 (DAPO): (1.25, +1) is inside [0.8, 1.28] -> grad -1.25, loss -1.25;
    # (1.3, +1) is above -> loss -1.28, grad 0.
    lp, old = _from_ratios([[1.1, 0.9, 1.25, 1.3]])
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]], dtype=F64)
    loss, metrics = get_policy_loss("ppo")(lp, old, adv, torch.ones(1, 4), clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([[-1.1, 0.9, -1.25, -1.28]], dtype=F64))
    torch.testing.assert_close(_token_grads(loss, lp), torch.tensor([[-1.1, 0.9, -1.25, 0.0]], dtype=F64))
    assert metrics["clipfrac"].item() == pytest.approx(0.25, abs=1e-7)
    assert metrics["clipfrac_high"].item() == pytest.approx(0.25, abs=1e-7)


def test_ppo_dual_clip():
    # c = 3, A = -1: loss = min(max(-rA, -clip(r)A), -cA) = min(r, 3) for r above the band.
    #   r = 5   -> 3 (capped, grad 0, clipfrac_dual)
    #   r = 2   -> 2 (grad +2, not clipped)
    #   r = 0.5 -> 0.8 (lower clip, grad 0)
    # A = +2, r = 5 -> -1.2 * 2 = -2.4 (upper clip; the dual clip only acts on A < 0)
    lp, old = _from_ratios([[5.0, 2.0, 0.5, 5.0]])
    adv = torch.tensor([[-1.0, -1.0, -1.0, 2.0]], dtype=F64)
    loss, metrics = get_policy_loss("ppo")(lp, old, adv, torch.ones(1, 4), dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, 0.8, -2.4]], dtype=F64))
    torch.testing.assert_close(_token_grads(loss, lp), torch.tensor([[0.0, 2.0, 0.0, 0.0]], dtype=F64))
    assert metrics["clipfrac_dual"].item() == pytest.approx(0.25, abs=1e-7)
    assert metrics["clipfrac_low"].item() == pytest.approx(0.25, abs=1e-7)
    assert metrics["clipfrac_high"].item() == pytest.approx(0.25, abs=1e-7)
    assert metrics["clipfrac"].item() == pytest.approx(0.75, abs=1e-7)
    # without the dual clip the r = 5, A = -1 token costs 5 and keeps its gradient
    loss_nd, _ = get_policy_loss("ppo")(lp, old, adv, torch.ones(1, 4))
    assert loss_nd[0, 0].item() == pytest.approx(5.0, abs=1e-12)


def test_ppo_matches_min_formula_on_random_inputs():
    # Value identity against the textbook expression -min(rA, clip(r)A) (no ties in random data).
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(8, 16, generator=g, dtype=F64) * 3).requires_grad_(True)
    old = lp.detach() + 0.4 * torch.randn(8, 16, generator=g, dtype=F64)
    adv = torch.randn(8, 16, generator=g, dtype=F64)
    mask = torch.rand(8, 16, generator=g) > 0.2
    loss, metrics = get_policy_loss("ppo")(lp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    r = torch.exp(lp - old)
    ref = -torch.minimum(r * adv, r.clamp(0.8, 1.3) * adv)
    ref = torch.where(mask, ref, torch.zeros((), dtype=F64))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    (g1,) = torch.autograd.grad(loss.sum(), lp)
    (g2,) = torch.autograd.grad(ref.sum(), lp)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)
    rd = r.detach()
    clipped = ((adv > 0) & (rd > 1.3)) | ((adv < 0) & (rd < 0.8))
    assert metrics["clipfrac"].item() == pytest.approx(
        (clipped & mask).sum().item() / mask.sum().item(), abs=1e-6
    )
    assert 0.05 < metrics["clipfrac"].item() < 0.95  # the data exercises both clipped and free tokens


@pytest.mark.parametrize("name", ["vanilla", "ppo", "gspo", "cispo"])
def test_nan_at_masked_positions_never_leaks(name):
    lp = torch.tensor([[-1.0, NAN, -0.5], [NAN, NAN, NAN]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.0, NAN, float("inf")], [NAN, -1.0, NAN]], dtype=F64)
    adv = torch.tensor([[1.0, NAN, -1.0], [NAN, NAN, NAN]], dtype=F64)
    mask = torch.tensor([[1, 0, 0], [0, 0, 0]])
    loss, metrics = get_policy_loss(name)(lp, old, adv, mask)
    assert torch.isfinite(loss).all()
    assert (loss[mask == 0] == 0).all()
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[mask == 0] == 0).all()
    assert lp.grad[0, 0].item() != 0.0
    for key, value in metrics.items():
        assert torch.isfinite(value.float()).all(), key
        assert not value.requires_grad, key
    assert metrics["num_tokens"].item() == 1


def test_empty_batch_metrics_are_zero():
    a = torch.zeros(2, 3)
    loss, metrics = get_policy_loss("ppo")(a, a, a, torch.zeros(2, 3))
    assert torch.equal(loss, a)
    assert metrics["num_tokens"].item() == 0
    assert metrics["ratio_max"].item() == 0.0
    assert metrics["clipfrac"].item() == 0.0


def test_metric_counts_give_exact_global_average():
    # Means over micro-batches weighted by num_tokens equal the full-batch metric.
    g = torch.Generator().manual_seed(4)
    lp = -torch.rand(6, 5, generator=g, dtype=F64)
    old = lp + 0.3 * torch.randn(6, 5, generator=g, dtype=F64)
    adv = torch.randn(6, 5, generator=g, dtype=F64)
    mask = torch.rand(6, 5, generator=g) > 0.4
    fn = get_policy_loss("ppo")
    _, full = fn(lp, old, adv, mask)
    parts = [fn(lp[s], old[s], adv[s], mask[s])[1] for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    total = sum(p["num_tokens"] for p in parts)
    assert total.item() == full["num_tokens"].item()
    for key in ("clipfrac", "clipfrac_low", "clipfrac_high", "approx_kl", "ratio_mean"):
        combined = sum(p[key] * p["num_tokens"] for p in parts) / total
        assert combined.item() == pytest.approx(full[key].item(), rel=1e-6, abs=1e-7), key
    assert max(p["ratio_max"].item() for p in parts) == pytest.approx(full["ratio_max"].item())


# ------------------------------------------------------------------------------------------
# GSPO


def test_gspo_hand_example():
    # Row 0: token ratios [2, 0.5] -> s = exp(mean(log 2, log 0.5)) = exp(0) = 1 (inside the band).
    #   loss = -A s = -1 per token; d loss / d logprob_t = -A s = -1 per token.
    # Row 1: token ratios [1.2, 1.2] -> s = 1.2 > 1 + 4e-4, A = +1: clipped per sequence.
    #   loss = -(1 + 4e-4) = -1.0004 per token, gradient 0.
    # Row 1, token 2 is padding (NaN).
    lp, old = _from_ratios([[2.0, 0.5, 1.0], [1.2, 1.2, 1.0]])
    with torch.no_grad():
        lp[1, 2] = NAN
    adv = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    loss, metrics = get_policy_loss("gspo")(lp, old, adv, mask)
    torch.testing.assert_close(loss, torch.tensor([[-1.0, -1.0, 0.0], [-1.0004, -1.0004, 0.0]], dtype=F64))
    torch.testing.assert_close(
        _token_grads(loss, lp), torch.tensor([[-1.0, -1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    )
    # clipfrac: the 2 tokens of the clipped sequence out of 4 valid tokens
    assert metrics["clipfrac"].item() == pytest.approx(0.5, abs=1e-7)
    assert metrics["clipfrac_high"].item() == pytest.approx(0.5, abs=1e-7)
    # ratio metrics of the sequence ratio: mean (1 + 1 + 1.2 + 1.2) / 4 = 1.1, max 1.2
    assert metrics["ratio_mean"].item() == pytest.approx(1.1, abs=1e-6)
    assert metrics["ratio_max"].item() == pytest.approx(1.2, abs=1e-6)
    # approx_kl from token ratios [2, 0.5, 1.2, 1.2]: (0.306853 + 0.193147 + 2 * 0.017678) / 4 = 0.133839
    assert metrics["approx_kl"].item() == pytest.approx(0.133839, abs=1e-6)


def test_gspo_token_form_equals_sequence_level_gradient():
    # With a per-sequence advantage and seq-mean-token-mean, the token-level form's gradient equals
    # that of the sequence objective -(1/B) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean log ratio).
    g = torch.Generator().manual_seed(5)
    B, T = 6, 7
    lp = (-torch.rand(B, T, generator=g, dtype=F64) * 2).requires_grad_(True)
    old = lp.detach() + 0.15 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T)
    lengths = torch.tensor([7, 1, 3, 5, 2, 6])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    loss, metrics = get_policy_loss("gspo")(lp, old, adv, mask, clip_low=0.05, clip_high=0.05)
    (g_token,) = torch.autograd.grad(aggregate(loss, mask, "seq-mean-token-mean"), lp)

    log_ratio = torch.where(mask, lp - old, torch.zeros((), dtype=F64))
    s = torch.exp(log_ratio.sum(-1) / lengths)
    a = adv[:, 0]
    seq_obj = -torch.minimum(s * a, s.clamp(0.95, 1.05) * a).mean()
    (g_seq,) = torch.autograd.grad(seq_obj, lp)
    torch.testing.assert_close(g_token, g_seq, rtol=1e-12, atol=1e-14)
    clipped_seqs = ((a > 0) & (s > 1.05)) | ((a < 0) & (s < 0.95))
    assert 0 < int(clipped_seqs.sum()) < B  # some sequences clipped, some not
    expected_clipfrac = lengths[clipped_seqs].sum().item() / lengths.sum().item()
    assert metrics["clipfrac"].item() == pytest.approx(expected_clipfrac, abs=1e-7)


# ------------------------------------------------------------------------------------------
# CISPO


def test_cispo_hand_example():
    # ratios [0.5, 1.5, 1.1], A [1, -1, 2], clip_high 0.28, no lower bound:
    #   weights sg(clip(r)) = [0.5, 1.28, 1.1]; loss = -w A logprob; d loss / d logprob = -w A
    #   = [-0.5, +1.28, -2.2] (no token loses its gradient)
    # logprob of token 0 = log 0.5 - 1 = -1.693147 -> loss_0 = -(0.5)(1)(-1.693147) = 0.846574
    lp, old = _from_ratios([[0.5, 1.5, 1.1]])
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=F64)
    mask = torch.ones(1, 3)
    loss, metrics = get_policy_loss("cispo")(lp, old, adv, mask)
    assert loss[0, 0].item() == pytest.approx(0.846574, abs=1e-6)
    torch.testing.assert_close(_token_grads(loss, lp), torch.tensor([[-0.5, 1.28, -2.2]], dtype=F64))
    assert metrics["clipfrac_high"].item() == pytest.approx(1 / 3, abs=1e-7)
    assert metrics["clipfrac_low"].item() == 0.0
    # with a lower bound 1 - 0.2 = 0.8: weight_0 = 0.8 -> gradient -0.8
    loss2, metrics2 = get_policy_loss("cispo")(lp, old, adv, mask, clip_low=0.2)
    torch.testing.assert_close(_token_grads(loss2, lp), torch.tensor([[-0.8, 1.28, -2.2]], dtype=F64))
    assert metrics2["clipfrac"].item() == pytest.approx(2 / 3, abs=1e-7)
    # no bounds at all: plain importance-weighted REINFORCE, gradient -r A
    loss3, _ = get_policy_loss("cispo")(lp, old, adv, mask, clip_high=None)
    torch.testing.assert_close(_token_grads(loss3, lp), torch.tensor([[-0.5, 1.5, -2.2]], dtype=F64))
