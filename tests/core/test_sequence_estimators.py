"""Tests of policygrad.core.sequence_estimators: REINFORCE (and the baseline identity), RLOO,
GRPO / Dr.GRPO and ReMax, called through the registry as the trainer calls them."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.core.advantages import estimate_advantages, group_mean_std, sequence_rewards

pytestmark = pytest.mark.unit

NAN = float("nan")


def one_token(rewards, dtype=torch.float64):
    """Rows with a single valid token holding the sequence reward: (token_rewards [B,1], mask)."""
    r = torch.tensor(rewards, dtype=dtype)[:, None]
    return r, torch.ones_like(r, dtype=torch.long)


def right_padded_mask(lengths, steps):
    return (torch.arange(steps)[None, :] < torch.as_tensor(lengths)[:, None]).long()


# ---------------------------------------------------------------------------------------------
# The baseline identity, by exact enumeration
# ---------------------------------------------------------------------------------------------


def _expected_gradient(logits, rewards, baseline):
    """sum_s sum_a p(s) pi(a|s) A(s,a) grad log pi(a|s), with A from the `reinforce` estimator.

    logits: [S, K] leaf tensor; rewards: [S, K]; baseline: float, [S] state baseline or [S, K].
    Each (s, a) pair is one single-token "sequence"; p(s) is uniform.
    """
    num_states, k = rewards.shape
    token_rewards = rewards.reshape(-1, 1)
    if isinstance(baseline, torch.Tensor) and baseline.dim() == 1:
        baseline = baseline.repeat_interleave(k)  # a state baseline, the same for every action
    elif isinstance(baseline, torch.Tensor):
        baseline = baseline.reshape(-1)  # depends on the action: allowed to bias
    a, _ = estimate_advantages(
        "reinforce",
        token_rewards,
        torch.ones_like(token_rewards),
        group_index=torch.arange(num_states).repeat_interleave(k),
        baseline=baseline,
    )
    logp = torch.log_softmax(logits, dim=-1)
    weights = logp.exp().detach() / num_states  # p(s) pi(a|s), a constant of the sum
    surrogate = (weights * a.reshape(num_states, k) * logp).sum()
    (grad,) = torch.autograd.grad(surrogate, logits)
    return grad


def test_constant_baseline_leaves_the_expected_gradient_unchanged():
    logits = torch.tensor([[0.3, -1.2, 0.8]], dtype=torch.float64, requires_grad=True)
    rewards = torch.tensor([[1.0, 3.0, -2.0]], dtype=torch.float64)
    g0 = _expected_gradient(logits, rewards, 0.0)
    # The exact gradient of E[R] = sum_a pi(a) R(a) w.r.t. the logits is pi * (R - E[R]).
    pi = torch.softmax(logits.detach(), -1)
    torch.testing.assert_close(g0, pi * (rewards - (pi * rewards).sum()), rtol=0, atol=1e-14)
    for b in (5.0, -3.0, 100.0):
        torch.testing.assert_close(_expected_gradient(logits, rewards, b), g0, rtol=0, atol=1e-12)
    # An action-dependent baseline does move it (b = R zeroes every advantage): the check can fail.
    assert _expected_gradient(logits, rewards, rewards).abs().max().item() == 0.0
    assert g0.abs().max().item() > 0.1


def test_state_only_baseline_leaves_the_expected_gradient_unchanged():
    logits = torch.tensor([[0.3, -1.2, 0.8], [2.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    rewards = torch.tensor([[1.0, 3.0, -2.0], [0.5, 0.0, 4.0]], dtype=torch.float64)
    g0 = _expected_gradient(logits, rewards, 0.0)
    state_baseline = torch.tensor([7.0, -2.5], dtype=torch.float64)
    torch.testing.assert_close(_expected_gradient(logits, rewards, state_baseline), g0, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Sequence-level estimators
# ---------------------------------------------------------------------------------------------


def test_sequence_reward_is_the_sum_of_valid_token_rewards_spread_on_valid_tokens():
    # row 0: -0.1 - 0.1 + 1.0 = 0.8 ; row 1: -0.2 + 0.5 = 0.3 (position 2 is padding)
    r = torch.tensor([[-0.1, -0.1, 1.0], [-0.2, 0.5, 99.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    torch.testing.assert_close(sequence_rewards(r, m), torch.tensor([0.8, 0.3], dtype=torch.float64))
    a, ret = estimate_advantages("reinforce", r, m, group_index=torch.tensor([0, 0]), baseline=0.5)
    expected = torch.tensor([[0.3, 0.3, 0.3], [-0.2, -0.2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(a, expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(ret, torch.tensor([[0.8] * 3, [0.3, 0.3, 0.0]], dtype=torch.float64))


def test_reinforce_baseline_forms():
    r, m = one_token([1.0, 2.0, 4.0])
    gi = torch.tensor([0, 1, 2])
    a, _ = estimate_advantages("reinforce", r, m, group_index=gi)
    assert torch.equal(a[:, 0], torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64))  # default b = 0
    a, _ = estimate_advantages("reinforce", r, m, group_index=gi, baseline=torch.tensor([1.0, 1.0, 5.0]))
    assert torch.equal(a[:, 0], torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="baseline"):
        estimate_advantages("reinforce", r, m, group_index=gi, baseline=torch.ones(2))
    with pytest.raises(TypeError, match="baseline"):
        estimate_advantages("reinforce", r, m, group_index=gi, baseline="mean")


def test_rloo_hand_values():
    # group {1, 2, 6}: others' means 4, 3.5, 1.5 -> -3, -1.5, 4.5; group {5, 5}: 0, 0
    r, m = one_token([1.0, 2.0, 6.0, 5.0, 5.0])
    a, ret = estimate_advantages("rloo", r, m, group_index=torch.tensor([0, 0, 0, 1, 1]))
    assert torch.equal(a[:, 0], torch.tensor([-3.0, -1.5, 4.5, 0.0, 0.0], dtype=torch.float64))
    assert torch.equal(ret, r)


def test_rloo_group_of_one_is_an_error():
    r, m = one_token([1.0, 2.0, 6.0])
    with pytest.raises(ValueError, match="group_size must be >= 2.*\\[7\\]"):
        estimate_advantages("rloo", r, m, group_index=torch.tensor([3, 3, 7]))


def test_group_mean_difference_is_scaled_rloo():
    # RLOO (Kool et al. 2019): R_i - mean(R) = (k-1)/k * (R_i - mean of the others), for each k.
    gen = torch.Generator().manual_seed(0)
    sizes = [2, 3, 4, 5, 8]
    gi = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    r = torch.randn(len(gi), 1, generator=gen, dtype=torch.float64)
    m = torch.ones_like(r)
    rloo, _ = estimate_advantages("rloo", r, m, group_index=gi)
    centred, _ = estimate_advantages("grpo", r, m, group_index=gi, scale="none")
    k = torch.tensor(sizes, dtype=torch.float64).repeat_interleave(torch.tensor(sizes))[:, None]
    torch.testing.assert_close(centred, (k - 1) / k * rloo, rtol=0, atol=1e-14)
    # and rloo itself is the leave-one-out difference, checked with a plain loop
    for i in range(len(gi)):
        others = [r[j, 0].item() for j in range(len(gi)) if gi[j] == gi[i] and j != i]
        assert rloo[i, 0].item() == pytest.approx(r[i, 0].item() - sum(others) / len(others), abs=1e-14)


def test_grpo_bug_report_case_in_any_row_order_and_micro_batch():
    # Bug-report case 5: groups [1, 0 | 1, 1]. Group 0: mean 0.5, unbiased std
    # sqrt((0.25 + 0.25) / 1) = 0.70711 -> 0.5 / (0.70711 + 1e-4) = 0.70700; group 1: all equal -> 0.
    r, m = one_token([1.0, 0.0, 1.0, 1.0])
    gi = torch.tensor([0, 0, 1, 1])
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / (math.sqrt(0.5) + 1e-4)
    a, ret = estimate_advantages("grpo", r, m, group_index=gi, eps=1e-4)
    torch.testing.assert_close(a[:, 0], expected, rtol=0, atol=1e-15)
    assert abs(a[0, 0].item() - 0.707) < 5e-4
    assert torch.equal(ret, r)
    for perm in ([2, 0, 3, 1], [1, 3, 2, 0], [3, 2, 1, 0]):
        perm = torch.tensor(perm)
        a_perm, _ = estimate_advantages("grpo", r[perm], m[perm], group_index=gi[perm], eps=1e-4)
        torch.testing.assert_close(a_perm[:, 0], expected[perm], rtol=0, atol=1e-15)
    for rows in ([0, 1], [2, 3]):  # each group as its own micro-batch
        a_mb, _ = estimate_advantages("grpo", r[rows], m[rows], group_index=gi[rows], eps=1e-4)
        torch.testing.assert_close(a_mb[:, 0], expected[rows], rtol=0, atol=1e-15)
    # Dr.GRPO centred advantage: R - group mean
    a, _ = estimate_advantages("grpo", r, m, group_index=gi, scale="none")
    assert torch.equal(a[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64))


def test_grpo_batch_scale_and_population_std():
    r, m = one_token([1.0, 0.0, 1.0, 1.0])
    gi = torch.tensor([0, 0, 1, 1])
    # batch mean 0.75; deviations .25, -.75, .25, .25; squares sum 0.75; unbiased var 0.25 -> std 0.5
    # group-centred [0.5, -0.5, 0, 0] / 0.5 = [1, -1, 0, 0]
    a, _ = estimate_advantages("grpo", r, m, group_index=gi, scale="batch", eps=0.0)
    assert torch.equal(a[:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64))
    # population std: group 0 std 0.5 -> [1, -1]; batch std sqrt(0.75 / 4) = 0.43301
    a, _ = estimate_advantages("grpo", r, m, group_index=gi, unbiased=False, eps=0.0)
    assert torch.equal(a[:, 0], torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64))
    a, _ = estimate_advantages("grpo", r, m, group_index=gi, scale="batch", unbiased=False, eps=0.0)
    torch.testing.assert_close(
        a[:, 0],
        torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / math.sqrt(0.1875),
        rtol=0,
        atol=1e-15,
    )


def test_grpo_all_equal_group_is_exactly_zero_in_float32():
    # In float32 the group mean of seven 0.1s or three 0.9s is not exactly 0.1 / 0.9 (checked
    # below), so a naive (R - mean) / (std + eps) is a rounding-error ratio, not 0.
    r, m = one_token([0.1] * 7 + [0.9] * 3, dtype=torch.float32)
    gi = torch.tensor([0] * 7 + [1] * 3)
    for rows in (slice(0, 7), slice(7, 10)):
        assert (r[rows] - r[rows].sum() / r[rows].numel()).abs().max().item() > 0  # the premise
    for scale in ("group", "batch", "none"):
        for eps in (1e-6, 0.0):
            a, _ = estimate_advantages("grpo", r, m, group_index=gi, scale=scale, eps=eps)
            assert torch.equal(a, torch.zeros_like(a)), (scale, eps)
    a, _ = estimate_advantages("rloo", r, m, group_index=gi)
    assert torch.equal(a, torch.zeros_like(a))


def test_grpo_errors():
    r, m = one_token([1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        estimate_advantages("grpo", r, m, group_index=torch.tensor([0, 0, 1]))
    # a lone sample is allowed without a group std: its centred advantage is 0
    a, _ = estimate_advantages("grpo", r, m, group_index=torch.tensor([0, 0, 1]), scale="none")
    assert torch.equal(a[:, 0], torch.tensor([0.5, -0.5, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="group, batch, none"):
        estimate_advantages("grpo", r, m, group_index=torch.tensor([0, 0, 0]), scale="prompt")
    with pytest.raises(ValueError, match="eps"):
        estimate_advantages("grpo", r, m, group_index=torch.tensor([0, 0, 0]), eps=-1.0)


def test_group_statistics_never_mix_prompts():
    gen = torch.Generator().manual_seed(1)
    gi = torch.tensor([4, 9, 4, 2, 9, 2, 4, 9])  # non-contiguous, not 0..K-1
    r = torch.randn(8, 1, generator=gen, dtype=torch.float64)
    m = torch.ones_like(r)
    for name, opts in (("rloo", {}), ("grpo", {}), ("grpo", {"scale": "none"})):
        a, _ = estimate_advantages(name, r, m, group_index=gi, **opts)
        # changing the other groups' rewards leaves group 4's advantages unchanged
        r2 = r.clone()
        r2[gi != 4] = torch.randn(int((gi != 4).sum()), 1, generator=gen, dtype=torch.float64) * 50
        a2, _ = estimate_advantages(name, r2, m, group_index=gi, **opts)
        assert torch.equal(a2[gi == 4], a[gi == 4]), name
        # the advantages of a group equal those of the group alone
        alone, _ = estimate_advantages(name, r[gi == 9], m[gi == 9], group_index=gi[gi == 9], **opts)
        torch.testing.assert_close(a[gi == 9], alone, rtol=0, atol=1e-15)
        # shuffling rows together with group_index permutes the advantages
        perm = torch.randperm(8, generator=gen)
        a_perm, _ = estimate_advantages(name, r[perm], m[perm], group_index=gi[perm], **opts)
        torch.testing.assert_close(a_perm, a[perm], rtol=0, atol=1e-15)


def test_group_mean_std_helper():
    # group 0: {1, 3} mean 2, unbiased std sqrt(2); group 1: {4} (size 1) std NaN unbiased, 0 population
    rewards = torch.tensor([1.0, 4.0, 3.0], dtype=torch.float64)
    gi = torch.tensor([0, 1, 0])
    centred, std, size = group_mean_std(rewards, gi)
    assert torch.equal(centred, torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64))
    assert std[0].item() == pytest.approx(math.sqrt(2), abs=1e-15) and math.isnan(std[1].item())
    assert torch.equal(size, torch.tensor([2, 1, 2]))
    _, std, _ = group_mean_std(rewards, gi, unbiased=False)
    assert torch.equal(std, torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64))


def test_remax_hand_values_and_missing_baseline():
    r, m = one_token([1.0, 0.0, 0.5])
    gi = torch.tensor([0, 0, 1])
    a, _ = estimate_advantages(
        "remax", r, m, group_index=gi, baseline_rewards=torch.tensor([0.25, 0.25, 1.0])
    )
    assert torch.equal(a[:, 0], torch.tensor([0.75, -0.25, -0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="baseline_rewards is required"):
        estimate_advantages("remax", r, m, group_index=gi)
    with pytest.raises(ValueError, match="baseline_rewards"):
        estimate_advantages("remax", r, m, group_index=gi, baseline_rewards=torch.zeros(2))


