"""Tests of policygrad.core.token_estimators: REINFORCE++ and GAE, called through the registry as
the trainer calls them (VinePPO's are in tests/produce/test_vine.py with its inputs)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from policygrad.core.advantages import estimate_advantages
from policygrad.core.token_estimators import vineppo_advantages
from policygrad.specs.estimators import VINEPPO_DEFAULTS

pytestmark = pytest.mark.unit

NAN = float("nan")


def one_token(rewards, dtype=torch.float64):
    """Rows with a single valid token holding the sequence reward: (token_rewards [B,1], mask)."""
    r = torch.tensor(rewards, dtype=dtype)[:, None]
    return r, torch.ones_like(r, dtype=torch.long)


def right_padded_mask(lengths, steps):
    return (torch.arange(steps)[None, :] < torch.as_tensor(lengths)[:, None]).long()


# ---------------------------------------------------------------------------------------------
# REINFORCE++
# ---------------------------------------------------------------------------------------------


def test_reinforce_pp_reward_to_go_then_whitening():
    r = torch.tensor([[-0.1, -0.1, 1.0], [-0.2, 0.5, NAN]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    gi = torch.tensor([0, 0])
    a, ret = estimate_advantages("reinforce_pp", r, m, group_index=gi)
    # reward-to-go (gamma 1): row 0 [0.8, 0.9, 1.0], row 1 [0.3, 0.5]
    rtg = torch.tensor([[0.8, 0.9, 1.0], [0.3, 0.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(ret, rtg, rtol=0, atol=1e-15)
    # valid mean 3.5 / 5 = 0.7; deviations .1 .2 .3 -.4 -.2; squares sum .34; unbiased var .085
    dev = torch.tensor([[0.1, 0.2, 0.3], [-0.4, -0.2, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(a, dev / math.sqrt(0.085 + 1e-8), rtol=0, atol=1e-12)
    # gamma 0.5, row 0: t2 1.0; t1 -0.1 + 0.5 * 1.0 = 0.4; t0 -0.1 + 0.5 * 0.4 = 0.1
    _, ret = estimate_advantages("reinforce_pp", r, m, group_index=gi, gamma=0.5)
    torch.testing.assert_close(ret[0], torch.tensor([0.1, 0.4, 1.0], dtype=torch.float64), rtol=0, atol=1e-15)


def test_reinforce_pp_group_baseline():
    # rewards [1, 0 | 1, 1]; group means 0.5, 1 -> shifted [0.5, -0.5, 0, 0]; mean 0;
    # unbiased var (0.25 + 0.25) / 3 = 1/6 -> [0.5, -0.5, 0, 0] * sqrt(6) = [1.2247, -1.2247, 0, 0]
    r, m = one_token([1.0, 0.0, 1.0, 1.0])
    gi = torch.tensor([0, 0, 1, 1])
    a, ret = estimate_advantages("reinforce_pp", r, m, group_index=gi, group_baseline=True)
    expected = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / math.sqrt(1 / 6 + 1e-8)
    torch.testing.assert_close(a[:, 0], expected, rtol=0, atol=1e-12)
    assert torch.equal(ret, r)  # the returns are the unshifted reward-to-go


def test_reinforce_pp_needs_two_valid_tokens():
    with pytest.raises(ValueError, match="at least 2"):
        estimate_advantages(
            "reinforce_pp", torch.tensor([[1.0, 0.0]]), torch.tensor([[1, 0]]), group_index=torch.tensor([0])
        )


# ---------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------


def reference_gae(rewards, values, length, gamma, lam):
    """Plain loop over the first `length` tokens of one row (GAE, Schulman et al. 2015b, eq. 16)."""
    adv = [0.0] * length
    last = 0.0
    for t in reversed(range(length)):
        next_value = values[t + 1] if t + 1 < length else 0.0  # V = 0 after the last valid token
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def test_gae_never_bootstraps_from_padding_bug_report_case():
    # Bug-report case 4: mask [1, 1, 0], rewards [0, 1, 0], values [0, 0, 100], gamma 1, lam 0.95.
    # t=1: delta = 1 + 1 * 0 - 0 = 1 -> A = 1; t=0: delta = 0 + 0 - 0 = 0 -> A = 0 + 0.95 * 1 = 0.95.
    # (Bootstrapping from V=100 at the padded position would give [5.7, 6.0, 0].)
    r = torch.tensor([[0.0, 1.0, 0.0]])
    v = torch.tensor([[0.0, 0.0, 100.0]])
    m = torch.tensor([[1, 1, 0]])
    a, ret = estimate_advantages("gae", r, m, group_index=torch.tensor([0]), values=v, gamma=1.0, lam=0.95)
    torch.testing.assert_close(a, torch.tensor([[0.95, 1.0, 0.0]]), rtol=0, atol=1e-7)
    torch.testing.assert_close(ret, torch.tensor([[0.95, 1.0, 0.0]]), rtol=0, atol=1e-7)  # + V = 0


def test_gae_lambda_one_is_monte_carlo_minus_value_and_lambda_zero_is_td():
    r = torch.tensor([[0.1, -0.2, 0.3, 1.0, 7.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.4, -0.3, 0.2, 9.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 1, 0]])
    gi = torch.tensor([0])
    for gamma in (1.0, 0.9):
        a, _ = estimate_advantages("gae", r, m, group_index=gi, values=v, gamma=gamma, lam=1.0)
        # sum_l gamma^l r_{t+l} over the 4 valid tokens, minus V(s_t)
        mc = [sum(gamma**l * r[0, t + l].item() for l in range(4 - t)) for t in range(4)]
        expected = torch.tensor([mc[t] - v[0, t].item() for t in range(4)] + [0.0], dtype=torch.float64)
        torch.testing.assert_close(a[0], expected, rtol=0, atol=1e-14)
        a, ret = estimate_advantages("gae", r, m, group_index=gi, values=v, gamma=gamma, lam=0.0)
        # TD error r_t + gamma V_{t+1} - V_t with V = 0 after the last valid token
        next_v = [0.4, -0.3, 0.2, 0.0]
        td = [r[0, t].item() + gamma * next_v[t] - v[0, t].item() for t in range(4)]
        torch.testing.assert_close(a[0], torch.tensor(td + [0.0], dtype=torch.float64), rtol=0, atol=1e-14)
        torch.testing.assert_close(ret[0, :4], a[0, :4] + v[0, :4], rtol=0, atol=1e-15)


def _random_gae_inputs(seed, batch=6, steps=9):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, steps + 1, (batch,), generator=gen)
    lengths[0] = steps
    lengths[1] = 1
    m = right_padded_mask(lengths, steps)
    return r, v, m, lengths.tolist()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (1.0, 0.0)])
def test_gae_matches_the_reference_loop(seed, gamma, lam):
    r, v, m, lengths = _random_gae_inputs(seed)
    gi = torch.arange(r.shape[0])
    a, ret = estimate_advantages("gae", r, m, group_index=gi, values=v, gamma=gamma, lam=lam)
    for i, n in enumerate(lengths):
        ref = reference_gae(r[i].tolist(), v[i].tolist(), n, gamma, lam)
        expected = torch.tensor(ref + [0.0] * (r.shape[1] - n), dtype=torch.float64)
        torch.testing.assert_close(a[i], expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[i, :n], a[i, :n] + v[i, :n], rtol=0, atol=1e-14)
        assert torch.equal(ret[i, n:], torch.zeros(r.shape[1] - n, dtype=torch.float64))


@pytest.mark.parametrize("seed", range(3))
def test_gae_decoupled_critic_lambda_matches_the_reference_loop(seed):
    r, v, m, lengths = _random_gae_inputs(seed)
    gi = torch.arange(r.shape[0])
    a, ret = estimate_advantages("gae", r, m, group_index=gi, values=v, gamma=0.95, lam=0.9, critic_lam=1.0)
    for i, n in enumerate(lengths):
        policy = reference_gae(r[i].tolist(), v[i].tolist(), n, 0.95, 0.9)
        critic = reference_gae(r[i].tolist(), v[i].tolist(), n, 0.95, 1.0)
        torch.testing.assert_close(a[i, :n], torch.tensor(policy, dtype=torch.float64), rtol=0, atol=1e-12)
        expected_ret = torch.tensor(critic, dtype=torch.float64) + v[i, :n]
        torch.testing.assert_close(ret[i, :n], expected_ret, rtol=0, atol=1e-12)
    # critic_lam equal to lam gives the coupled estimator
    a2, ret2 = estimate_advantages("gae", r, m, group_index=gi, values=v, gamma=0.95, lam=0.9, critic_lam=0.9)
    a3, ret3 = estimate_advantages("gae", r, m, group_index=gi, values=v, gamma=0.95, lam=0.9)
    assert torch.equal(a2, a3) and torch.equal(ret2, ret3)


@pytest.mark.parametrize("seed", range(3))
def test_gae_length_adaptive_lambda_matches_the_reference_loop(seed):
    r, v, m, lengths = _random_gae_inputs(seed)
    gi = torch.arange(r.shape[0])
    alpha = 0.4
    a, ret = estimate_advantages("gae", r, m, group_index=gi, values=v, length_adaptive_alpha=alpha)
    for i, n in enumerate(lengths):
        lam_i = min(max(1 - 1 / (alpha * n), 0.0), 1.0)  # e.g. n = 9: 1 - 1/3.6 = 0.7222; n = 1: 0
        ref = reference_gae(r[i].tolist(), v[i].tolist(), n, 1.0, lam_i)
        torch.testing.assert_close(a[i, :n], torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12)
        torch.testing.assert_close(ret[i, :n], a[i, :n] + v[i, :n], rtol=0, atol=1e-14)


def test_gae_length_adaptive_hand_value():
    # alpha 0.5, length 4 -> lam = 1 - 1 / (0.5 * 4) = 0.5; rewards [0, 0, 0, 1], V = 0, gamma 1:
    # deltas [0, 0, 0, 1] -> A = [0.125, 0.25, 0.5, 1]
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    a, _ = estimate_advantages(
        "gae",
        r,
        torch.ones(1, 4),
        group_index=torch.tensor([0]),
        values=torch.zeros(1, 4),
        length_adaptive_alpha=0.5,
    )
    torch.testing.assert_close(a, torch.tensor([[0.125, 0.25, 0.5, 1.0]]), rtol=0, atol=0)


def test_gae_skips_masked_holes_like_a_compacted_sequence():
    # A mask with a hole (e.g. tool output inside a response) is the same as the row without it.
    r = torch.tensor([[0.3, 5.0, -0.2, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.1, 9.0, 0.4, -0.5]], dtype=torch.float64)
    m = torch.tensor([[1, 0, 1, 1]])
    a, _ = estimate_advantages("gae", r, m, group_index=torch.tensor([0]), values=v, gamma=0.9, lam=0.7)
    ref = reference_gae([0.3, -0.2, 1.0], [0.1, 0.4, -0.5], 3, 0.9, 0.7)
    torch.testing.assert_close(a[0, [0, 2, 3]], torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-14)
    assert a[0, 1].item() == 0.0


def test_gae_errors():
    r = torch.zeros(1, 2)
    gi = torch.tensor([0])
    with pytest.raises(ValueError, match="values"):
        estimate_advantages("gae", r, torch.ones(1, 2), group_index=gi)
    for opts in ({"lam": 1.5}, {"gamma": -0.1}, {"critic_lam": 2.0}, {"length_adaptive_alpha": 0.0}):
        with pytest.raises(ValueError, match=next(iter(opts))):
            estimate_advantages("gae", r, torch.ones(1, 2), group_index=gi, values=torch.zeros(1, 2), **opts)




def test_vineppo_defaults_are_the_declared_ones():
    # one definition: the function's defaults are read from policygrad.specs.estimators
    params = inspect.signature(vineppo_advantages).parameters.values()
    defaults = {p.name: p.default for p in params if p.name in VINEPPO_DEFAULTS}
    assert defaults == VINEPPO_DEFAULTS == {
        "rollouts": 9,
        "split": "newline",
        "segment_tokens": 64,
        "max_splits": 8,
        "prompt_value": "rollouts",
    }
