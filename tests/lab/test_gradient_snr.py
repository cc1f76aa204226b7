"""Tests of the gradient-SNR lab on a tiny model: a reward offset ruins the no-baseline estimator
and leaves every baseline-corrected one unchanged; grouping, parsing, parameter subsets."""

from __future__ import annotations

import json

import pytest
import torch

from policygrad.core.kl import kl_shaped_rewards
from policygrad.lab.common import tokenize_user_prompts
from policygrad.lab.gradient_snr import (
    RIDGE_GRID,
    EstimatorSpec,
    LinearCritic,
    estimator_advantages,
    estimator_gradients,
    estimator_group_index,
    parse_estimators,
    run_gradient_snr,
    select_parameters,
)
from policygrad.rollout.base import decode_completions
from policygrad.rollout.hf import HFRolloutEngine

pytestmark = pytest.mark.integration

PROMPTS = ["What is 2+3?", "Say hi."]


def even_first_char(_prompts, completions, **_fields):
    """1.0 when the completion's first character has an even code point: a reward decided by the
    first sampled token, so the policy gradient is large next to its noise."""
    return [float(len(c) > 0 and ord(c[0]) % 2 == 0) for c in completions]


SETTINGS = dict(
    estimators="none,rloo2,rloo4,grpo,gae0,gae1",
    samples_per_prompt=8,
    draws=24,
    reference_draws=12,
    critic_draws=2,
    max_new_tokens=2,
    params="last-layer",
    seed=0,
)


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory):
    model, tokenizer = tiny_lm
    out = tmp_path_factory.mktemp("snr")
    plain = run_gradient_snr(model, tokenizer, PROMPTS, even_first_char, output_dir=None, **SETTINGS)
    offset = run_gradient_snr(
        model, tokenizer, PROMPTS, even_first_char, reward_offset=10.0, output_dir=str(out), **SETTINGS
    )
    return plain, offset


def test_offset_makes_no_baseline_noisier_than_rloo(runs):
    _, offset = runs
    # A constant c adds about c^2 E||grad log p||^2 to the no-baseline variance and nothing to
    # RLOO's, whose leave-one-out baseline (Kool et al. 2019) cancels it.
    assert offset.stats("no-baseline").snr < offset.stats("rloo(k=4)").snr
    assert offset.stats("no-baseline").noise > 20 * offset.stats("rloo(k=4)").noise


def test_baselines_are_invariant_to_the_offset(runs):
    plain, offset = runs
    # Same seeds -> same samples; RLOO and GRPO subtract the group mean and the critic's bias
    # absorbs the constant, so their gradients are unchanged up to float32 rounding.
    for name in ("rloo(k=2)", "rloo(k=4)", "grpo", "gae(lam=0)", "gae(lam=1)"):
        assert offset.stats(name).snr == pytest.approx(plain.stats(name).snr, rel=1e-3), name
        assert offset.stats(name).grad_norm == pytest.approx(plain.stats(name).grad_norm, rel=1e-3), name
    assert offset.stats("no-baseline").noise > plain.stats("no-baseline").noise
    assert offset.reward_mean == pytest.approx(plain.reward_mean + 10.0, abs=1e-5)


def test_result_fields_and_files(runs, tiny_lm):
    _, offset = runs
    model, _ = tiny_lm
    names = [e.name for e in offset.estimators]
    assert names == ["no-baseline", "rloo(k=2)", "rloo(k=4)", "grpo", "gae(lam=0)", "gae(lam=1)"]
    last = [p for n, p in model.named_parameters() if "layers.1." in n]
    assert offset.num_params == sum(p.numel() for p in last)
    for e in offset.estimators:
        assert e.draws == 24 and e.samples_per_batch == 16
        assert -1.0 <= e.cos_ref <= 1.0 and -1.0 <= e.cos_mean_ref <= 1.0
        assert e.snr >= 0.0 and e.snr_raw >= e.snr
    assert offset.critic_ev_fit is not None and offset.critic_ev_fit <= 1.0
    data = json.loads(open(offset.json_path).read())
    assert data["reward_offset"] == 10.0 and len(data["estimators"]) == 6
    assert open(offset.png_path, "rb").read(4) == b"\x89PNG"
    assert "rloo(k=4)" in offset.table
    # The model is left as it was: every parameter trainable (make_tiny_llama's default).
    assert all(p.requires_grad for p in model.parameters())


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


def test_bad_settings(tiny_lm):
    model, tokenizer = tiny_lm
    with pytest.raises(ValueError, match="not a multiple of k=4"):
        run_gradient_snr(
            model,
            tokenizer,
            PROMPTS,
            even_first_char,
            estimators="rloo4",
            samples_per_prompt=6,
            output_dir=None,
        )
    with pytest.raises(ValueError, match="draws must be >= 2"):
        run_gradient_snr(model, tokenizer, PROMPTS, even_first_char, draws=1, output_dir=None)
    with pytest.raises(ValueError, match="reward_fn returned 1 scores for 4 completions"):
        run_gradient_snr(
            model,
            tokenizer,
            ["Hi"],
            lambda _p, _c, **_f: [0.0],
            estimators="rloo2",
            samples_per_prompt=4,
            draws=2,
            reference_draws=2,
            max_new_tokens=2,
            output_dir=None,
        )
