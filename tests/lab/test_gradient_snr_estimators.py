"""Tests of the gradient-SNR candidates: estimator grouping, advantages and parsing by hand,
parameter subsets, the linear critic, and the shared-head backward against the direct one."""

from __future__ import annotations

import pytest
import torch

from policygrad.core.kl import kl_shaped_rewards
from policygrad.lab.common import tokenize_user_prompts
from policygrad.lab.gradient_snr_estimators import (
    RIDGE_GRID,
    EstimatorSpec,
    LinearCritic,
    estimator_advantages,
    estimator_gradients,
    estimator_group_index,
    parse_estimators,
    select_parameters,
)
from policygrad.rollout.base import decode_completions
from policygrad.rollout.hf import HFRolloutEngine
from tests.lab.test_gradient_snr import PROMPTS, even_first_char

pytestmark = pytest.mark.integration


def test_shared_head_backward_is_exact(tiny_lm):
    model, tokenizer = tiny_lm
    rollout = HFRolloutEngine(model, tokenizer).generate(
        tokenize_user_prompts(tokenizer, PROMPTS), group_size=4, max_new_tokens=3, generator_seed=0
    )
    scores = torch.tensor(even_first_char(None, decode_completions(tokenizer, rollout))) + 0.5
    zeros = torch.zeros_like(rollout.response_mask)
    token_rewards = kl_shaped_rewards(scores, zeros, zeros, rollout.response_mask, beta=0.0)
    tensors = [p for _, p in select_parameters(model, "last-layer")]
    specs = parse_estimators("none,rloo2,grpo")
    shared, _ = estimator_gradients(
        model, rollout, token_rewards, specs, tensors, samples_per_prompt=4, shared_head_backward=True
    )
    direct, _ = estimator_gradients(
        model, rollout, token_rewards, specs, tensors, samples_per_prompt=4, shared_head_backward=False
    )
    for a, b in zip(shared, direct):
        # Same math, float32 sums in another order: equal to rounding, relative to the vector.
        assert a.abs().max() > 0
        assert float((a - b).norm() / b.norm()) < 1e-5
    head = [p for _, p in select_parameters(model, "lm-head")]
    with pytest.raises(ValueError, match="outside the measured tensors"):
        estimator_gradients(
            model, rollout, token_rewards, specs, head, samples_per_prompt=4, shared_head_backward=True
        )


def test_group_index_by_hand():
    # B = 8, S = 4, k = 2: prompt 0 -> groups 0, 0, 1, 1; prompt 1 -> 2, 2, 3, 3.
    assert estimator_group_index(8, 4, 2, "cpu").tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert estimator_group_index(8, 4, 4, "cpu").tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_estimator_advantages_by_hand():
    # One prompt, S = 4, rewards [1, 0, 0, 1] on the last token of 1-token responses.
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    mask = torch.ones(4, 1)
    none = estimator_advantages(EstimatorSpec("no-baseline", "none"), rewards, mask, samples_per_prompt=4)
    assert none.flatten().tolist() == [1.0, 0.0, 0.0, 1.0]
    # rloo k=2: groups {1, 0} and {0, 1}: A = R_i - R_other = [1, -1, -1, 1].
    rloo2 = estimator_advantages(EstimatorSpec("rloo(k=2)", "rloo", k=2), rewards, mask, samples_per_prompt=4)
    assert rloo2.flatten().tolist() == [1.0, -1.0, -1.0, 1.0]
    # rloo k=4: A_0 = 1 - (0 + 0 + 1)/3 = 2/3; A_1 = 0 - 2/3 = -2/3.
    rloo4 = estimator_advantages(EstimatorSpec("rloo(k=4)", "rloo", k=4), rewards, mask, samples_per_prompt=4)
    torch.testing.assert_close(rloo4.flatten(), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    # gae lam=1 with values 0.25: A = R - V = [0.75, -0.25, -0.25, 0.75].
    values = torch.full((4, 1), 0.25)
    gae = estimator_advantages(
        EstimatorSpec("gae(lam=1)", "gae", lam=1.0), rewards, mask, samples_per_prompt=4, values=values
    )
    assert gae.flatten().tolist() == [0.75, -0.25, -0.25, 0.75]


def test_parse_estimators():
    specs = parse_estimators("none, rloo4 ,grpo,gae0.95")
    assert [s.name for s in specs] == ["no-baseline", "rloo(k=4)", "grpo", "gae(lam=0.95)"]
    assert specs[1].k == 4 and specs[3].lam == 0.95
    with pytest.raises(ValueError, match="unknown estimator 'ppo'; use none, rlooK"):
        parse_estimators("ppo")
    with pytest.raises(ValueError, match="k >= 2"):
        parse_estimators("rloo1")
    with pytest.raises(ValueError, match=r"lambda must be in \[0, 1\]"):
        parse_estimators("gae1.5")
    with pytest.raises(ValueError, match="listed twice"):
        parse_estimators("grpo,grpo")


def test_select_parameters(tiny_lm):
    model, _ = tiny_lm
    names = [n for n, _ in select_parameters(model, "last-layer")]
    assert names and all(".layers.1." in n for n in names)
    head = select_parameters(model, "lm-head")
    assert len(head) == 1 and head[0][1] is model.get_output_embeddings().weight
    assert [n for n, _ in select_parameters(model, r"^model\.norm\.weight$")] == ["model.norm.weight"]
    with pytest.raises(ValueError, match="matches no parameter"):
        select_parameters(model, "transformer.h")


def test_linear_critic_recovers_a_linear_function():
    # targets = 2 h_0 - h_1 + 3 exactly: ridge 1e-12 recovers the weights.
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 3, generator=g)
    y = 2 * h[:, 0] - h[:, 1] + 3
    critic = LinearCritic(ridge=1e-12).fit(h, y)
    torch.testing.assert_close(critic.predict(h), y, atol=1e-4, rtol=0)
    # The held-out choice: an exact linear target picks the smallest penalty of the grid, pure
    # noise (independent of the features) the largest.
    groups = torch.arange(50) // 5  # 10 "sequences" of 5 tokens
    assert LinearCritic().fit(h, y, groups).chosen_ridge == RIDGE_GRID[0]
    h = torch.randn(400, 30, generator=g)
    noise = torch.randn(400, generator=g)
    assert LinearCritic().fit(h, noise, torch.arange(400) // 4).chosen_ridge == RIDGE_GRID[-1]
    with pytest.raises(ValueError, match="groups must have shape"):
        LinearCritic().fit(h, noise, torch.arange(3))
