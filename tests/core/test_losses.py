"""Tests of policygrad.core.losses: the policy-loss registry, PPO/GSPO/CISPO, value loss, entropy."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.core import losses
from policygrad.core.losses import (
    check_policy_loss_options,
    entropy_from_logits,
    get_policy_loss,
    list_policy_losses,
    policy_loss_options,
    register_policy_loss,
    value_loss,
)
from policygrad.core.masking import aggregate
from policygrad.specs import losses as loss_specs

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


# ------------------------------------------------------------------------------------------
# registry


def test_registry_lists_and_errors(monkeypatch):
    assert {"vanilla", "ppo", "gspo", "cispo", "clip_cov", "kl_cov"} <= set(list_policy_losses())
    assert get_policy_loss("ppo") is losses.ppo_loss
    with pytest.raises(ValueError, match="cispo, clip_cov, gspo, kl_cov, ppo, vanilla"):
        get_policy_loss("trpo")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo")

    monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(losses._POLICY_LOSSES))
    monkeypatch.setattr(loss_specs, "_OPTIONS", dict(loss_specs._OPTIONS))  # the declarations too

    @register_policy_loss("negated")
    def negated(logprobs, _old_logprobs, _advantages, _response_mask):
        return -logprobs, {}

    assert get_policy_loss("negated") is negated
    assert "negated" in list_policy_losses()
    with pytest.raises(ValueError, match="'negated' is already registered"):
        register_policy_loss("negated")


@pytest.mark.parametrize("name", ["vanilla", "ppo", "gspo", "cispo"])
def test_shape_errors_name_the_argument(name):
    fn = get_policy_loss(name)
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs"):
        fn(a, torch.zeros(2, 4), a, a)
    with pytest.raises(ValueError, match="advantages"):
        fn(a, a, torch.zeros(2), a)
    with pytest.raises(ValueError, match="response_mask"):
        fn(a, a, a, torch.ones(3, 3))
    with pytest.raises(ValueError, match="logprobs must be 2-D"):
        fn(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3))


def test_option_validation():
    a = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip"):
        get_policy_loss("ppo")(a, a, a, a, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        get_policy_loss("ppo")(a, a, a, a, clip_low=1.5)
    with pytest.raises(ValueError, match="clip_high"):
        get_policy_loss("gspo")(a, a, a, a, clip_high=-0.1)
    with pytest.raises(TypeError, match="clip_low"):
        get_policy_loss("cispo")(a, a, a, a, clip_low="0.2")
    with pytest.raises(TypeError, match="clip_high"):
        get_policy_loss("ppo")(a, a, a, a, clip_high=None)


# ------------------------------------------------------------------------------------------
# declared options


def test_losses_declare_their_options_with_the_papers_defaults():
    # PPO (Schulman et al. 2017): eps = 0.2 both sides, no dual clip; GSPO (Zheng et al. 2025,
    # section 5.1): 3e-4 / 4e-4; CISPO (MiniMax-M1): no lower bound, DAPO's 0.28 above.
    assert policy_loss_options("ppo") == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None}
    assert policy_loss_options("gspo") == {"clip_low": 3e-4, "clip_high": 4e-4}
    assert policy_loss_options("cispo") == {"clip_low": None, "clip_high": 0.28}
    assert policy_loss_options("vanilla") == {}
    # Clip-Cov / KL-Cov (Cui et al. 2025, section 5 and its 7B settings): detach 2e-4 of the tokens
    # with covariance in [1, 5] under PPO's 0.2 band; penalise the top 2e-3 with coefficient 1.
    # The trainer's ``selected`` keyword is not an option a config may set.
    assert policy_loss_options("clip_cov") == {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "clip_cov_ratio": 2e-4,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
    }
    assert policy_loss_options("kl_cov") == {"kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0}
    assert get_policy_loss("gspo").options == {"clip_low": 3e-4, "clip_high": 4e-4}
    # a copy: editing it changes nothing registered
    policy_loss_options("ppo")["clip_low"] = 0.5
    assert policy_loss_options("ppo")["clip_low"] == 0.2
    registered = "cispo, clip_cov, gspo, kl_cov, ppo, vanilla"
    with pytest.raises(ValueError, match=f"unknown policy loss 'trpo'; registered: {registered}"):
        policy_loss_options("trpo")


def test_check_policy_loss_options_names_the_loss_and_its_options():
    message = (
        "policy loss 'gspo' has no option 'dual_clip'; its options: clip_low (default 0.0003), "
        "clip_high (default 0.0004)"
    )
    with pytest.raises(ValueError) as info:
        check_policy_loss_options("gspo", {"dual_clip": 3.0})
    assert str(info.value) == message
    with pytest.raises(
        ValueError, match=r"policy loss 'vanilla' has no option 'clip_low'; its options: \(none\)"
    ):
        check_policy_loss_options("vanilla", {"clip_low": 0.2})
    with pytest.raises(ValueError, match="unknown policy loss 'trpo'"):
        check_policy_loss_options("trpo", {})
    with pytest.raises(TypeError, match="mapping"):
        check_policy_loss_options("ppo", [("clip_low", 0.2)])


def test_check_policy_loss_options_validates_the_values_now():
    with pytest.raises(ValueError, match=r"clip_low must be a finite number in \[0, 1.0\], got 1.5"):
        check_policy_loss_options("ppo", {"clip_low": 1.5})
    with pytest.raises(ValueError, match="dual_clip must be a finite number > 1"):
        check_policy_loss_options("ppo", {"dual_clip": 0.5})
    with pytest.raises(TypeError, match="clip_high must be a number"):
        check_policy_loss_options("gspo", {"clip_high": "4e-4"})
    with pytest.raises(TypeError, match="clip_high must be a number, got None"):
        check_policy_loss_options("ppo", {"clip_high": None})
    # an explicit None is passed on: CISPO without an upper bound is valid
    assert check_policy_loss_options("cispo", {"clip_high": None}) == {"clip_high": None}
    assert check_policy_loss_options("ppo", {"clip_high": 0.28, "dual_clip": 3}) == {
        "clip_high": 0.28,
        "dual_clip": 3,
    }
    assert check_policy_loss_options("vanilla", {}) == {}


def test_only_the_given_options_reach_the_loss(monkeypatch):
    monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(losses._POLICY_LOSSES))
    monkeypatch.setattr(loss_specs, "_OPTIONS", dict(loss_specs._OPTIONS))  # the declarations too
    calls = []

    @register_policy_loss("recording")
    def recording(logprobs, _old_logprobs, _advantages, _response_mask, *, a=1, b=None):
        calls.append({"shape": tuple(logprobs.shape), "a": a, "b": b})
        return torch.zeros_like(logprobs), {}

    assert recording.options == {"a": 1, "b": None}
    assert check_policy_loss_options("recording", {"b": 5}) == {"b": 5}
    assert calls == [{"shape": (1, 2), "a": 1, "b": 5}]  # a kept the function's default


def test_registration_requires_declared_options(monkeypatch):
    monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(losses._POLICY_LOSSES))
    monkeypatch.setattr(loss_specs, "_OPTIONS", dict(loss_specs._OPTIONS))  # the declarations too

    def open_options(logprobs, old_logprobs, advantages, response_mask, **options):  # noqa: ARG001 (a signature to refuse)
        return logprobs, {}

    def no_default(logprobs, old_logprobs, advantages, response_mask, *, clip):  # noqa: ARG001 (a signature to refuse)
        return logprobs, {}

    def three_tensors(logprobs, old_logprobs, advantages):  # noqa: ARG001 (a signature to refuse)
        return logprobs, {}

    with pytest.raises(TypeError, match="declared by name"):
        register_policy_loss("open")(open_options)
    with pytest.raises(TypeError, match="option 'clip' needs a default"):
        register_policy_loss("no_default")(no_default)
    with pytest.raises(TypeError, match="signature"):
        register_policy_loss("three")(three_tensors)
    assert not {"open", "no_default", "three"} & set(list_policy_losses())


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


# ------------------------------------------------------------------------------------------
# value loss


def test_value_loss_clipping_hand_example():
    # clip_range 0.2, old values 1.0 (clip window [0.8, 1.2]):
    #   t0: V=1.5, G=2: unclipped (1.5-2)^2 = 0.25; V_clip = 1.2: (1.2-2)^2 = 0.64 -> max 0.64,
    #       loss 0.32, clipped branch, gradient 0 (V outside the window)
    #   t1: V=0.5, G=2: 2.25 vs V_clip 0.8: 1.44 -> 2.25, loss 1.125, gradient V - G = -1.5
    #   t2: V=2.0, G=1: 1.0 vs V_clip 1.2: 0.04 -> 1.0, loss 0.5, gradient 1.0
    #   t3: V=1.1, G=2: inside the window, V_clip = V: equal errors, loss 0.405, gradient -0.9
    #   t4: padding (NaN)
    values = torch.tensor([[1.5, 0.5, 2.0, 1.1, NAN]], dtype=F64, requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 1.0, 1.0, NAN]], dtype=F64)
    returns = torch.tensor([[2.0, 2.0, 1.0, 2.0, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = value_loss(values, old_values, returns, mask, clip_range=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.32, 1.125, 0.5, 0.405, 0.0]], dtype=F64))
    torch.testing.assert_close(
        _token_grads(loss, values), torch.tensor([[0.0, -1.5, 1.0, -0.9, 0.0]], dtype=F64)
    )
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.25, abs=1e-7)
    assert metrics["num_tokens"].item() == 4
    # unclipped: 0.5 * [0.25, 2.25, 1.0, 0.81]
    loss_u, metrics_u = value_loss(values, old_values, returns, mask)
    torch.testing.assert_close(loss_u, torch.tensor([[0.125, 1.125, 0.5, 0.405, 0.0]], dtype=F64))
    assert metrics_u["vf_clipfrac"].item() == 0.0


def test_value_loss_errors():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="returns"):
        value_loss(a, a, torch.zeros(3, 2), a)
    with pytest.raises(ValueError, match="old_values"):
        value_loss(a, torch.zeros(2, 2), a, a)
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(a, a, a, a, clip_range=0.0)


# ------------------------------------------------------------------------------------------
# entropy


def _reference_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_uniform_and_exact_formula():
    # uniform over V = 7: H = log 7 = 1.945910
    h = entropy_from_logits(torch.zeros(2, 3, 7))
    assert h.dtype == torch.float32 and h.shape == (2, 3)
    torch.testing.assert_close(h, torch.full((2, 3), math.log(7)), rtol=0, atol=1e-6)
    # [0, 0, -inf]: a banned token has probability 0 -> H = log 2, finite gradient
    x = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    hx = entropy_from_logits(x)
    assert hx.item() == pytest.approx(math.log(2), abs=1e-6)
    hx.sum().backward()
    assert torch.isfinite(x.grad).all()
    # two-point [log 3, 0]: p = [0.75, 0.25], H = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.562335
    two = entropy_from_logits(torch.tensor([math.log(3.0), 0.0]))
    assert two.item() == pytest.approx(0.562335, abs=1e-6)


def test_entropy_matches_reference_values_gradients_and_chunks():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 5, 11, generator=g, dtype=F64) * 3
    ref = _reference_entropy(logits / 0.7)
    for chunk in (1, 4, 15, None):
        torch.testing.assert_close(entropy_from_logits(logits, temperature=0.7, chunk_size=chunk), ref)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: entropy_from_logits(t, temperature=0.7, chunk_size=4), (x,))
    # float32 gradient against autograd through the reference
    x32 = logits.float().requires_grad_(True)
    w = torch.randn(3, 5, generator=g)
    (g_new,) = torch.autograd.grad((entropy_from_logits(x32, chunk_size=2) * w).sum(), x32)
    (g_ref,) = torch.autograd.grad((_reference_entropy(x32) * w).sum(), x32)
    torch.testing.assert_close(g_new, g_ref, rtol=1e-5, atol=1e-6)


def test_entropy_bf16_keeps_no_float32_copy():
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 6, 32, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    h = entropy_from_logits(logits, chunk_size=5)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, _reference_entropy(logits.detach().float()), rtol=1e-5, atol=1e-5)
    # what the backward keeps alive: the bf16 logits themselves and [N] float32 vectors only
    saved = h.grad_fn.saved_tensors
    assert any(t.data_ptr() == logits.data_ptr() for t in saved)
    assert sum(t.numel() for t in saved if t.dtype == torch.float32) <= 2 * 4 * 6
    h.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    x32 = logits.detach().float().requires_grad_(True)
    _reference_entropy(x32).sum().backward()
    torch.testing.assert_close(logits.grad.float(), x32.grad, rtol=2e-2, atol=2e-3)


def test_entropy_non_contiguous_input():
    g = torch.Generator().manual_seed(8)
    full = torch.randn(5, 3, 9, generator=g)
    view = full.transpose(0, 1)[:, 1:]  # [3, 4, 9], not flattenable without a copy
    torch.testing.assert_close(entropy_from_logits(view, chunk_size=5), _reference_entropy(view))
