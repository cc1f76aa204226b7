"""Tests of policygrad.core.kl: estimators, KL-shaped rewards, the KL loss term, placements."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.core.kl import (
    KL_KINDS,
    KL_PLACEMENTS,
    KLPlacement,
    get_kl_placement,
    kl_estimate,
    kl_loss,
    kl_shaped_rewards,
    last_token_rewards,
)
from policygrad.specs.kl import kl_placement_spec

pytestmark = pytest.mark.unit

NAN = float("nan")


# ------------------------------------------------------------------------------------------
# kl_estimate: hand values


def test_kl_estimate_hand_values():
    # pi = 0.5, pi_ref = 0.8: log(pi/pi_ref) = log 0.625 = -0.470004
    #   k1 = -0.470004; k2 = 0.5 * 0.470004^2 = 0.110452
    #   k3: r = pi_ref/pi = 1.6, (r - 1) - log r = 0.6 - 0.470004 = 0.129996
    # pi = 0.5, pi_ref = 0.2: log 2.5 = 0.916291
    #   k1 = 0.916291; k2 = 0.419794; k3: r = 0.4, -0.6 + 0.916291 = 0.316291
    lp = torch.tensor([math.log(0.5), math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.8), math.log(0.2)], dtype=torch.float64)
    expected = {
        "k1": [-0.470004, 0.916291],
        "k2": [0.110452, 0.419794],
        "k3": [0.129996, 0.316291],
    }
    for kind, values in expected.items():
        got = kl_estimate(lp, ref, kind)
        torch.testing.assert_close(got, torch.tensor(values, dtype=torch.float64), rtol=0, atol=1e-6)


def test_kl_estimates_are_zero_when_equal_and_k2_k3_nonnegative():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(1000, generator=g, dtype=torch.float64) * 5
    ref = -torch.rand(1000, generator=g, dtype=torch.float64) * 5
    for kind in KL_KINDS:
        assert torch.equal(kl_estimate(lp, lp, kind), torch.zeros_like(lp))
    assert bool((kl_estimate(lp, ref, "k2") >= 0).all())
    assert bool((kl_estimate(lp, ref, "k3") >= 0).all())
    # k1 goes negative on some samples (the "alarming to watch" estimator)
    assert bool((kl_estimate(lp, ref, "k1") < 0).any())


def test_kl_estimate_errors():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_estimate(a, torch.zeros(2, 4), "k1")
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(a, a, "k4")
    with pytest.raises(TypeError, match="ref_logprobs"):
        kl_estimate(a, [0.0], "k1")


# ------------------------------------------------------------------------------------------
# exact expected gradients by enumeration over one categorical token


def _expected_grad(theta: torch.Tensor, ref_probs: torch.Tensor, term_fn, sample_probs=None) -> torch.Tensor:
    """sum_a q(a) * grad_theta term(a), q = sampling distribution (pi detached by default)."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)
    q = logp.exp().detach() if sample_probs is None else sample_probs
    total = torch.zeros((), dtype=theta.dtype)
    for a in range(theta.shape[0]):
        total = total + q[a] * term_fn(logp[a : a + 1], torch.log(ref_probs[a : a + 1]), a)
    (grad,) = torch.autograd.grad(total, theta)
    return grad


def _exact_kl_grads(theta: torch.Tensor, ref_probs: torch.Tensor):
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)
    p = logp.exp()
    reverse = (p * (logp - ref_probs.log())).sum()  # KL(pi || ref)
    forward = (ref_probs * (ref_probs.log() - logp)).sum()  # KL(ref || pi)
    (g_rev,) = torch.autograd.grad(reverse, theta, retain_graph=True)
    (g_fwd,) = torch.autograd.grad(forward, theta)
    return reverse.detach(), g_rev, g_fwd


def test_case7_expected_gradients_by_enumeration():
    # pi = softmax([0, 0]) = [0.5, 0.5], ref = [0.8, 0.2].
    # KL(pi||ref) = 0.5 log(0.5/0.8) + 0.5 log(0.5/0.2) = 0.5 (-0.470004 + 0.916291) = 0.223144
    # d KL(pi||ref) / d theta_j = pi_j (log(pi_j/ref_j) - KL):
    #   j=0: 0.5 (-0.470004 - 0.223144) = -0.346574;  j=1: 0.5 (0.916291 - 0.223144) = +0.346574
    # d KL(ref||pi) / d theta = pi - ref = [-0.3, 0.3]
    # E[grad k1] = sum_a pi(a) grad log pi(a) = 0
    theta = torch.zeros(2, dtype=torch.float64)
    ref = torch.tensor([0.8, 0.2], dtype=torch.float64)
    kl, g_rev, g_fwd = _exact_kl_grads(theta, ref)
    torch.testing.assert_close(kl, torch.tensor(0.223144, dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        g_rev, torch.tensor([-0.346574, 0.346574], dtype=torch.float64), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(g_fwd, torch.tensor([-0.3, 0.3], dtype=torch.float64), rtol=0, atol=1e-12)

    ones = torch.ones(1)

    def plain(kind):
        return lambda lp, rlp, _a: kl_loss(lp[None], rlp[None], ones[None], kind=kind).sum()

    def weighted(lp, rlp, _a):
        # w = pi / pi_old with pi_old = pi detached (on-policy, w == 1 numerically)
        return kl_loss(lp[None], rlp[None], ones[None], kind="k3", old_logprobs=lp.detach()[None]).sum()

    e_k1 = _expected_grad(theta, ref, plain("k1"))
    e_k2 = _expected_grad(theta, ref, plain("k2"))
    e_k3 = _expected_grad(theta, ref, plain("k3"))
    e_wk3 = _expected_grad(theta, ref, weighted)
    torch.testing.assert_close(e_k1, torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(
        e_k2, torch.tensor([-0.346574, 0.346574], dtype=torch.float64), rtol=0, atol=1e-6
    )
    torch.testing.assert_close(e_k3, torch.tensor([-0.3, 0.3], dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(e_wk3, g_rev, rtol=0, atol=1e-12)
    # and the reverse/forward KL gradients really differ here, so the test can tell them apart
    assert (e_k3 - g_rev).abs().max() > 0.04


def test_expected_gradient_identities_random_categorical():
    # Same identities on a 5-way categorical with random logits and reference, float64.
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(5, generator=g, dtype=torch.float64)
    ref = torch.softmax(torch.randn(5, generator=g, dtype=torch.float64), dim=-1)
    _, g_rev, g_fwd = _exact_kl_grads(theta, ref)
    ones = torch.ones(1, 1)

    def term(kind, weighted=False):
        def fn(lp, rlp, _a):
            old = lp.detach()[None] if weighted else None
            return kl_loss(lp[None], rlp[None], ones, kind=kind, old_logprobs=old).sum()

        return fn

    torch.testing.assert_close(_expected_grad(theta, ref, term("k1")), torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(_expected_grad(theta, ref, term("k2")), g_rev, rtol=0, atol=1e-12)
    torch.testing.assert_close(_expected_grad(theta, ref, term("k3")), g_fwd, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        _expected_grad(theta, ref, term("k3", weighted=True)), g_rev, rtol=0, atol=1e-12
    )


def test_weighted_k3_off_policy_is_reverse_kl_gradient():
    # Samples from pi_old != pi: E_{pi_old}[grad (w k3)] with w = pi/pi_old
    # = sum_a pi(a) log(pi(a)/ref(a)) grad log pi(a) = grad KL(pi||ref).
    g = torch.Generator().manual_seed(2)
    theta = torch.randn(4, generator=g, dtype=torch.float64)
    ref = torch.softmax(torch.randn(4, generator=g, dtype=torch.float64), dim=-1)
    old_probs = torch.softmax(torch.randn(4, generator=g, dtype=torch.float64), dim=-1)
    _, g_rev, _ = _exact_kl_grads(theta, ref)
    ones = torch.ones(1, 1)

    def fn(lp, rlp, a):
        old = old_probs[a : a + 1].log()[None]
        return kl_loss(lp[None], rlp[None], ones, kind="k3", old_logprobs=old).sum()

    torch.testing.assert_close(
        _expected_grad(theta, ref, fn, sample_probs=old_probs), g_rev, rtol=0, atol=1e-12
    )


# ------------------------------------------------------------------------------------------
# Schulman (2020): q = N(0, 1) sampling, p = N(0.1, 1), true KL(q||p) = 0.1^2 / 2 = 0.005


def test_schulman_gaussian_numbers():
    # With x ~ q: log(q/p)(x) = -(0.1 x - 0.005), so k1 = -(0.1 x - 0.005) has std 0.1 = 20 x 0.005.
    # Schulman's note reports std/KL of about 20 for k1 and 1.42 for k3, both unbiased.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2_000_000, generator=g, dtype=torch.float64)
    q = torch.distributions.Normal(0.0, 1.0)
    p = torch.distributions.Normal(0.1, 1.0)
    logprobs, ref_logprobs = q.log_prob(x), p.log_prob(x)  # "pi" = q samples, "pi_ref" = p
    true_kl = 0.005
    k1 = kl_estimate(logprobs, ref_logprobs, "k1")
    k3 = kl_estimate(logprobs, ref_logprobs, "k3")
    assert k1.std().item() / true_kl == pytest.approx(20.0, rel=0.10)
    assert k3.std().item() / true_kl == pytest.approx(1.4, rel=0.10)
    # Unbiased: standard errors of the mean are 0.1/sqrt(2e6) = 7e-5 (1.4%) and 5e-6 (0.1%).
    assert k1.mean().item() == pytest.approx(true_kl, rel=0.05)
    assert k3.mean().item() == pytest.approx(true_kl, rel=0.01)


# ------------------------------------------------------------------------------------------
# kl_shaped_rewards


def test_kl_shaped_rewards_hand_example():
    # beta = 0.1, k1. Row 0: mask [1, 1, 0]; k1 = lp - ref = [-1 - (-1.5), -2 - (-1)] = [0.5, -1.0]
    #   rewards = [-0.1 * 0.5, -0.1 * (-1.0) + score 1.0, 0] = [-0.05, 1.1, 0]
    # Row 1: mask [1, 0, 0]; k1 = [0]; rewards = [0 + score (-2.0), 0, 0]
    # NaN at masked positions must not leak.
    scores = torch.tensor([1.0, -2.0], dtype=torch.float64)
    lp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, NAN]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 5.0, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rewards = kl_shaped_rewards(scores, lp, ref, mask, beta=0.1)
    expected = torch.tensor([[-0.05, 1.1, 0.0], [-2.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-12)
    assert not rewards.requires_grad

    # k3 on row 0 token 0: log ratio 0.5 -> k3 = exp(-0.5) - 1 + 0.5 = 0.106531; reward -0.0106531
    rewards_k3 = kl_shaped_rewards(scores, lp, ref, mask, beta=0.1, kind="k3")
    assert rewards_k3[0, 0].item() == pytest.approx(-0.0106531, abs=1e-7)

    # beta = 0: only the score, on the last valid token
    torch.testing.assert_close(
        kl_shaped_rewards(scores, lp, ref, mask, beta=0.0),
        torch.tensor([[0.0, 1.0, 0.0], [-2.0, 0.0, 0.0]], dtype=torch.float64),
    )


def test_kl_shaped_rewards_last_valid_token_and_total():
    # A non-contiguous mask [1, 0, 1, 0]: the last valid token is position 2.
    # Sum of a row's rewards = score - beta * sum of its valid k1 (the sequence-level KL penalty).
    scores = torch.tensor([3.0])
    lp = torch.tensor([[-1.0, -7.0, -2.0, -9.0]])
    ref = torch.tensor([[-1.25, 0.0, -1.5, 0.0]])
    mask = torch.tensor([[True, False, True, False]])
    rewards = kl_shaped_rewards(scores, lp, ref, mask, beta=0.2)
    # k1 = [0.25, -, -0.5, -]; rewards = [-0.05, 0, 0.1 + 3, 0]
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.0, 3.1, 0.0]]), rtol=0, atol=1e-6)
    assert rewards.sum().item() == pytest.approx(3.0 - 0.2 * (0.25 - 0.5), abs=1e-6)


def test_kl_shaped_rewards_errors():
    lp = torch.zeros(2, 3)
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"row\(s\) \[1\]"):
        kl_shaped_rewards(torch.zeros(2), lp, lp, torch.tensor([[1, 0, 0], [0, 0, 0]]), beta=0.1)
    with pytest.raises(ValueError, match="scores"):
        kl_shaped_rewards(torch.zeros(3), lp, lp, mask, beta=0.1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_shaped_rewards(torch.zeros(2), lp, torch.zeros(2, 4), mask, beta=0.1)
    with pytest.raises(ValueError, match="response_mask"):
        kl_shaped_rewards(torch.zeros(2), lp, lp, torch.ones(3, 3), beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        kl_shaped_rewards(torch.zeros(2), lp, lp, mask, beta=-0.1)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_shaped_rewards(torch.zeros(2), lp, lp, mask, beta=0.1, kind="forward")


# ------------------------------------------------------------------------------------------
# kl_loss


def test_kl_loss_hand_value_and_masking():
    # Valid token: lp = -1, ref = -1.5, old = -1.2.
    #   k3: log ratio 0.5 -> exp(-0.5) - 1 + 0.5 = 0.106531
    #   w = exp(-1 - (-1.2)) = exp(0.2) = 1.221403 -> w k3 = 0.130117
    lp = torch.tensor([[-1.0, NAN]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, NAN]], dtype=torch.float64)
    old = torch.tensor([[-1.2, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 0]])
    plain = kl_loss(lp, ref, mask)
    weighted = kl_loss(lp, ref, mask, old_logprobs=old)
    torch.testing.assert_close(plain, torch.tensor([[0.106531, 0.0]], dtype=torch.float64), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        weighted, torch.tensor([[0.130117, 0.0]], dtype=torch.float64), rtol=0, atol=1e-6
    )
    (plain.sum() + weighted.sum()).backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1].item() == 0.0
    # d k3 / d lp = 1 - exp(-(lp - ref)) = 1 - exp(-0.5) = 0.393469
    # d (w k3) / d lp = w (k3 + 1 - exp(-0.5)) = w * log ratio = 1.221403 * 0.5 = 0.610701
    assert lp.grad[0, 0].item() == pytest.approx(0.393469 + 0.610701, abs=1e-6)


def test_kl_loss_errors():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs"):
        kl_loss(a, a, a, old_logprobs=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="response_mask"):
        kl_loss(a, a, torch.ones(2))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_loss(a, a, a, kind="low_var")


# ------------------------------------------------------------------------------------------
# placements


def _placement_batch():
    gen = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 5, generator=gen, dtype=torch.float64) - 2
    ref = torch.randn(3, 5, generator=gen, dtype=torch.float64) - 2
    old = lp.detach() + 0.1 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    scores = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    return scores, lp, ref, old, mask


def test_placements_are_registered_with_their_capabilities():
    assert KL_PLACEMENTS == ("none", "reward", "loss")
    got = {name: get_kl_placement(name) for name in KL_PLACEMENTS}
    assert all(isinstance(p, KLPlacement) and p.name == name for name, p in got.items())
    assert {n: p.needs_reference for n, p in got.items()} == {"none": False, "reward": True, "loss": True}
    # k1 in the reward (Ziegler et al. 2019), k3 in the loss (Shao et al. 2024, eq. 4)
    assert {n: p.default_kind for n, p in got.items()} == {"none": "k1", "reward": "k1", "loss": "k3"}
    assert all(p.default_kind in KL_KINDS for p in got.values())
    with pytest.raises(ValueError, match="unknown KL placement 'both'; valid placements: none, reward, loss"):
        get_kl_placement("both")
    with pytest.raises(TypeError):
        KLPlacement()  # abstract


@pytest.mark.parametrize("kind", KL_KINDS)
def test_placement_token_rewards_equal_the_direct_calls_bitwise(kind):
    scores, lp, ref, _, mask = _placement_batch()
    no_kl = kl_shaped_rewards(scores, lp, lp, mask, beta=0.0, kind="k1")
    # "none" and "loss" ignore beta, kind and the reference: the score on the last token only
    for name in ("none", "loss"):
        got = get_kl_placement(name).token_rewards(scores, lp, ref, mask, beta=0.3, kind=kind)
        assert torch.equal(got, no_kl), name
    got = get_kl_placement("none").token_rewards(scores, lp, None, mask, beta=0.3, kind=kind)
    assert torch.equal(got, no_kl)
    want = kl_shaped_rewards(scores, lp, ref, mask, beta=0.3, kind=kind)
    got = get_kl_placement("reward").token_rewards(scores, lp, ref, mask, beta=0.3, kind=kind)
    assert torch.equal(got, want)
    assert not torch.equal(want, no_kl)


@pytest.mark.parametrize("kind", KL_KINDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_placement_loss_term_equals_kl_loss_bitwise(kind, weighted):
    _, lp, ref, old, mask = _placement_batch()
    old_lp = old if weighted else None
    for name in ("none", "reward"):
        assert get_kl_placement(name).loss_term(lp, ref, mask, kind=kind, old_logprobs=old_lp) is None
    lp_a = lp.clone().requires_grad_(True)
    lp_b = lp.clone().requires_grad_(True)
    got = get_kl_placement("loss").loss_term(lp_a, ref, mask, kind=kind, old_logprobs=old_lp)
    want = kl_loss(lp_b, ref, mask, kind=kind, old_logprobs=old_lp)
    assert torch.equal(got, want)
    (grad_got,) = torch.autograd.grad(got.sum(), lp_a)
    (grad_want,) = torch.autograd.grad(want.sum(), lp_b)
    assert torch.equal(grad_got, grad_want)


def test_placements_implement_their_declarations():
    # the attributes the trainer reads are the torch-free declaration's (what the config checked)
    for name in KL_PLACEMENTS:
        placement, spec = get_kl_placement(name), kl_placement_spec(name)
        assert placement.spec is spec
        fields = ("name", "needs_reference", "shapes_rewards", "default_kind")
        assert [getattr(placement, f) for f in fields] == [getattr(spec, f) for f in fields]
    assert [get_kl_placement(n).shapes_rewards for n in KL_PLACEMENTS] == [False, True, False]


def test_placements_that_need_the_reference_say_so():
    scores, lp, _, _, mask = _placement_batch()
    with pytest.raises(ValueError, match="KL placement 'reward' needs ref_logprobs"):
        get_kl_placement("reward").token_rewards(scores, lp, None, mask, beta=0.1, kind="k1")
    with pytest.raises(ValueError, match="KL placement 'loss' needs ref_logprobs"):
        get_kl_placement("loss").loss_term(lp, None, mask, kind="k3", old_logprobs=None)


def test_last_token_rewards_put_each_score_on_its_rows_last_token():
    # row 0: tokens 0-2 valid -> 1.5 at t=2; row 1: tokens 0-3 valid -> -2.0 at t=3; zeros elsewhere
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
    out = last_token_rewards(torch.tensor([1.5, -2.0]), mask)
    assert out.tolist() == [[0.0, 0.0, 1.5, 0.0], [0.0, 0.0, 0.0, -2.0]]
    assert out.dtype == torch.float32 and not out.requires_grad


def test_last_token_rewards_equal_the_kl_shaping_with_beta_zero():
    torch.manual_seed(0)
    mask = (torch.rand(5, 7) < 0.7).float()
    mask[:, 0] = 1.0
    scores, logprobs = torch.randn(5), -torch.rand(5, 7)
    shaped = kl_shaped_rewards(scores, logprobs, logprobs - 0.1, mask, beta=0.0)
    assert torch.equal(last_token_rewards(scores, mask), shaped)


def test_last_token_rewards_name_an_empty_row_and_a_wrong_shape():
    with pytest.raises(ValueError, match=r"no valid token in row\(s\) \[1\]"):
        last_token_rewards(torch.zeros(2), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"scores must have shape \[B\] = \(2,\)"):
        last_token_rewards(torch.zeros(3), torch.ones(2, 2))
