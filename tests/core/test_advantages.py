"""Tests of policygrad.core.advantages: the estimator registry and every registered estimator."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.core import advantages as adv_module
from policygrad.core.advantages import (
    EstimatorSpec,
    check_estimator_options,
    estimate_advantages,
    estimator_spec,
    get_advantage_estimator,
    group_mean_std,
    list_advantage_estimators,
    monte_carlo_returns,
    register_advantage_estimator,
    sequence_rewards,
)

pytestmark = pytest.mark.unit

NAN = float("nan")
BUILTIN = ("gae", "grpo", "reinforce", "reinforce_pp", "remax", "rloo")


def one_token(rewards, dtype=torch.float64):
    """Rows with a single valid token holding the sequence reward: (token_rewards [B,1], mask)."""
    r = torch.tensor(rewards, dtype=dtype)[:, None]
    return r, torch.ones_like(r, dtype=torch.long)


def right_padded_mask(lengths, steps):
    return (torch.arange(steps)[None, :] < torch.as_tensor(lengths)[:, None]).long()


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_builtin_estimators_are_registered():
    assert set(BUILTIN) <= set(list_advantage_estimators())
    assert list(list_advantage_estimators()) == sorted(list_advantage_estimators())


def test_unknown_estimator_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'") as info:
        get_advantage_estimator("ppo")
    for name in BUILTIN:
        assert name in str(info.value)
    r, m = one_token([1.0, 0.0])
    with pytest.raises(ValueError, match="rloo"):
        estimate_advantages("RLOO", r, m, group_index=torch.tensor([0, 0]))


def test_duplicate_registration_raises_and_new_estimators_get_the_shared_checks():
    name = "test_only_constant"
    try:

        @register_advantage_estimator(name)
        def constant(token_rewards, response_mask, *, group_index, values=None, level=1.0):  # noqa: ARG001 (the estimator signature the registry requires)
            full = torch.full_like(token_rewards, level)
            return full, full

        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator(name)(constant)
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("grpo")(constant)

        r = torch.tensor([[1.0, 2.0, NAN]])
        m = torch.tensor([[1, 1, 0]])
        a, ret = estimate_advantages(name, r, m, group_index=torch.tensor([0]), level=3.0)
        # the wrapper zeroes masked positions whatever the estimator returns
        assert torch.equal(a, torch.tensor([[3.0, 3.0, 0.0]]))
        assert torch.equal(ret, a)
        with pytest.raises(TypeError, match=r"'test_only_constant'.*'levle'.*level"):
            estimate_advantages(name, r, m, group_index=torch.tensor([0]), levle=3.0)
    finally:
        adv_module._ESTIMATORS.pop(name, None)
    assert name not in list_advantage_estimators()


def test_registration_checks_the_signature():
    def wrong(token_rewards, _response_mask):
        return token_rewards, token_rewards

    with pytest.raises(TypeError, match="signature"):
        register_advantage_estimator("test_only_wrong")(wrong)
    assert "test_only_wrong" not in list_advantage_estimators()


# ---------------------------------------------------------------------------------------------
# Capabilities
# ---------------------------------------------------------------------------------------------


def test_builtin_estimators_declare_their_capabilities():
    specs = {name: estimator_spec(name) for name in BUILTIN}
    assert all(isinstance(spec, EstimatorSpec) and spec.name == name for name, spec in specs.items())
    assert all(get_advantage_estimator(name).spec is spec for name, spec in specs.items())
    assert {n: s.needs_values for n, s in specs.items() if s.needs_values} == {"gae": True}
    assert {n: s.inputs for n, s in specs.items() if s.inputs} == {"remax": ("baseline_rewards",)}
    assert specs["grpo"].options == ("scale", "eps", "unbiased")
    assert specs["remax"].options == ()  # baseline_rewards is an input, not a user option
    assert specs["gae"].options == ("gamma", "lam", "critic_lam", "length_adaptive_alpha")
    assert {n: s.min_group_size({}) for n, s in specs.items()} == {
        "reinforce": 1,
        "rloo": 2,  # the leave-one-out baseline needs another sample (Kool et al. 2019)
        "grpo": 2,  # the group std needs two samples (Shao et al. 2024)
        "remax": 1,
        "reinforce_pp": 1,
        "gae": 1,
    }
    # REINFORCE++-baseline: with G = 1 the group mean is the row's own reward, every A = 0
    assert specs["reinforce_pp"].min_group_size({"group_baseline": True}) == 2
    assert specs["reinforce_pp"].min_group_size({"group_baseline": False, "gamma": 0.9}) == 1
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        estimator_spec("ppo")


def test_group_baseline_with_one_sample_per_prompt_gives_zero_advantages():
    # why reinforce_pp declares min_group_size 2 with group_baseline: every row is its own group.
    # The registered estimator refuses such a batch (test below); the bare function shows why.
    r = torch.tensor([[0.0, 1.0], [0.0, 3.0]], dtype=torch.float64)
    m = torch.ones(2, 2)
    with pytest.raises(ValueError, match="'reinforce_pp' with group_baseline=True"):
        estimate_advantages("reinforce_pp", r, m, group_index=torch.tensor([0, 1]), group_baseline=True)
    bare = get_advantage_estimator("reinforce_pp").__wrapped__
    a, _ = bare(r, m.bool(), group_index=torch.tensor([0, 1]), values=None, group_baseline=True)
    # G_t - R: row 0 -> [0, 0]; row 1 -> [0, 0]: all equal, whitened to exactly 0
    assert torch.equal(a, torch.zeros(2, 2, dtype=torch.float64))


# Every built-in estimator and option set whose registered min_group_size is above 1.
_NEEDS_GROUPS = [
    ("rloo", {}),
    ("grpo", {}),
    ("grpo", {"scale": "batch"}),
    ("grpo", {"scale": "none"}),
    ("reinforce_pp", {"group_baseline": True}),
]


def test_the_group_size_table_covers_every_builtin_that_needs_groups():
    for name in BUILTIN:
        spec = estimator_spec(name)
        if spec.min_group_size({}) > 1:
            assert (name, {}) in _NEEDS_GROUPS, name
    assert all(estimator_spec(name).min_group_size(opts) == 2 for name, opts in _NEEDS_GROUPS)


@pytest.mark.parametrize(("name", "options"), _NEEDS_GROUPS, ids=lambda x: str(x))
def test_a_direct_call_with_groups_below_min_group_size_is_refused(name, options):
    # Three prompts, one sample each: what the config refuses, refused at the estimator too.
    r, m = one_token([1.0, 0.0, 3.0])
    with pytest.raises(ValueError) as info:
        estimate_advantages(name, r, m, group_index=torch.tensor([5, 6, 7]), **options)
    message = str(info.value)
    assert message.startswith(f"advantage estimator {name!r}"), message
    assert "needs groups of at least 2 rows" in message
    assert "the largest group of this batch has 1 row (3 rows, 3 groups)" in message
    assert "pass at least 2 rows per group_index id (rollout.group_size >= 2)" in message
    if name == "reinforce_pp":
        assert "with group_baseline=True" in message and message.endswith("or change group_baseline")
    # The same batch with two samples of each prompt passes.
    r2, m2 = one_token([1.0, 0.0, 3.0, 3.0, 2.0, 0.0])
    a, _ = estimate_advantages(name, r2, m2, group_index=torch.tensor([5, 5, 6, 6, 7, 7]), **options)
    assert a.shape == (6, 1)
    # And so does a mixed batch (a group of 2 next to a lone row) where the estimator allows it.
    if name in ("reinforce_pp",) or options.get("scale") in ("batch", "none"):
        estimate_advantages(name, r, m, group_index=torch.tensor([5, 5, 7]), **options)


def test_direct_call_group_size_rule_follows_the_options():
    # reinforce_pp without the group baseline takes one sample per prompt: A = whitened R.
    r, m = one_token([1.0, 0.0, 3.0])
    a, _ = estimate_advantages("reinforce_pp", r, m, group_index=torch.tensor([5, 6, 7]))
    # mean 4/3, unbiased std sqrt(((1/3)^2 + (4/3)^2 + (5/3)^2) / 2) = sqrt(7/3)
    expected = torch.tensor([-1 / 3, -4 / 3, 5 / 3], dtype=torch.float64) / math.sqrt(7 / 3)
    torch.testing.assert_close(a[:, 0], expected, rtol=0, atol=1e-7)
    # a registered rule of 3: groups of 2 are refused, groups of 3 pass, and the options check
    # builds its dummy batch with groups that large
    name = "test_only_triples"
    try:

        @register_advantage_estimator(name, min_group_size=lambda options: 3 if options.get("wide") else 1)
        def triples(token_rewards, response_mask, *, group_index, values=None, wide=False):  # noqa: ARG001 (the estimator signature the registry requires)
            return token_rewards, token_rewards

        assert check_estimator_options(name, {"wide": True}) == {"wide": True}
        r4, m4 = one_token([1.0, 2.0, 3.0, 4.0])
        refused = r"'test_only_triples' with wide=True .*at least 3 rows.*has 2 rows"
        with pytest.raises(ValueError, match=refused):
            estimate_advantages(name, r4, m4, group_index=torch.tensor([0, 0, 1, 1]), wide=True)
        estimate_advantages(name, r4, m4, group_index=torch.tensor([0, 0, 1, 1]))
        estimate_advantages(name, r4, m4, group_index=torch.tensor([0, 0, 0, 1]), wide=True)
    finally:
        adv_module._ESTIMATORS.pop(name, None)


def test_check_estimator_options_refuses_unknown_options_and_inputs():
    with pytest.raises(ValueError) as info:
        check_estimator_options("grpo", {"scael": "none"})
    assert (
        str(info.value)
        == "advantage estimator 'grpo' has no option 'scael'; valid options: scale, eps, unbiased"
    )
    with pytest.raises(
        ValueError, match=r"advantage estimator 'rloo' has no option 'scale'; valid options: \(none\)"
    ):
        check_estimator_options("rloo", {"scale": "none"})
    with pytest.raises(
        ValueError, match="'baseline_rewards' is an input the trainer supplies, not an option"
    ):
        check_estimator_options("remax", {"baseline_rewards": 0.0})
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        check_estimator_options("ppo", {})
    with pytest.raises(TypeError, match="mapping"):
        check_estimator_options("grpo", ["scale"])


@pytest.mark.parametrize(
    "name, options, error, match",
    [
        ("grpo", {"scale": "std"}, ValueError, "valid scales: group, batch, none"),
        ("grpo", {"eps": -1.0}, ValueError, "eps must be a number >= 0"),
        ("grpo", {"unbiased": "yes"}, TypeError, "unbiased must be True or False"),
        ("gae", {"lam": 1.5}, ValueError, r"gae: lam must be a number in \[0, 1\]"),
        ("gae", {"length_adaptive_alpha": 0.0}, ValueError, "length_adaptive_alpha must be a number > 0"),
        ("reinforce_pp", {"gamma": -0.1}, ValueError, "reinforce_pp: gamma"),
        ("reinforce_pp", {"group_baseline": "true"}, TypeError, "group_baseline must be True or False"),
        ("reinforce", {"baseline": "mean"}, TypeError, "baseline"),
    ],
)
def test_check_estimator_options_validates_values_on_a_dummy_batch(name, options, error, match):
    with pytest.raises(error, match=match):
        check_estimator_options(name, options)


def test_check_estimator_options_accepts_good_options():
    assert check_estimator_options("grpo", {"scale": "none", "eps": 0.0}) == {"scale": "none", "eps": 0.0}
    assert check_estimator_options("gae", {"gamma": 1.0, "lam": 0.95, "critic_lam": 1.0}) == {
        "gamma": 1.0,
        "lam": 0.95,
        "critic_lam": 1.0,
    }
    assert check_estimator_options("remax", {}) == {}  # the dummy call supplies the input
    assert check_estimator_options("reinforce_pp", {"group_baseline": True}) == {"group_baseline": True}


def test_registration_declares_capabilities():
    name = "test_only_capable"
    try:

        @register_advantage_estimator(
            name,
            needs_values=True,
            inputs=("extra",),
            min_group_size=lambda options: 3 if options.get("wide") else 1,
        )
        def capable(token_rewards, response_mask, *, group_index, values=None, extra=None, wide=False):  # noqa: ARG001 (the estimator signature the registry requires)
            assert values is not None and extra is not None
            return token_rewards, token_rewards

        spec = estimator_spec(name)
        assert spec == capable.spec
        assert (spec.options, spec.inputs, spec.needs_values) == (("wide",), ("extra",), True)
        assert capable.options == ("wide",)
        assert (spec.min_group_size({}), spec.min_group_size({"wide": True})) == (1, 3)
        assert check_estimator_options(name, {"wide": True}) == {"wide": True}  # values and extra given
        with pytest.raises(TypeError, match=r"'test_only_capable'.*'wdie'.*valid options: wide; inputs"):
            estimate_advantages(
                name, torch.zeros(1, 1), torch.ones(1, 1), group_index=torch.tensor([0]), wdie=1
            )
    finally:
        adv_module._ESTIMATORS.pop(name, None)


def test_registration_checks_the_capabilities():
    def plain(token_rewards, response_mask, *, group_index, values=None, level=1.0):  # noqa: ARG001 (a signature to register)
        return token_rewards, token_rewards

    def open_options(token_rewards, response_mask, *, group_index, values=None, **options):  # noqa: ARG001 (a signature to register)
        return token_rewards, token_rewards

    with pytest.raises(TypeError, match="'missing' must be keyword-only parameters"):
        register_advantage_estimator("test_only_a", inputs=("missing",))(plain)
    with pytest.raises(TypeError, match="inputs must be a tuple"):
        register_advantage_estimator("test_only_b", inputs="level")
    with pytest.raises(ValueError, match="min_group_size must be >= 1"):
        register_advantage_estimator("test_only_c", min_group_size=0)
    with pytest.raises(TypeError, match="needs_values must be True or False"):
        register_advantage_estimator("test_only_d", needs_values="yes")
    with pytest.raises(TypeError, match="keyword-only"):
        register_advantage_estimator("test_only_e")(open_options)
    assert not any(n.startswith("test_only") for n in list_advantage_estimators())
    spec = EstimatorSpec("x", (), False, (), group_size_rule=lambda _options: 0)
    with pytest.raises(ValueError, match="min_group_size of advantage estimator 'x' must be >= 1"):
        spec.min_group_size({})


def test_monte_carlo_returns_hand_values():
    # G_t = sum_l gamma^l r_{t+l} over valid tokens; padding (99) never read.
    # gamma 1:   [1 + 2 + 4, 2 + 4, 4] = [7, 6, 4]
    # gamma 0.5: [1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4] = [3, 4, 4]
    r = torch.tensor([[1.0, 2.0, 4.0, 99.0], [3.0, 99.0, 99.0, 99.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert monte_carlo_returns(r, m).tolist() == [[7.0, 6.0, 4.0, 0.0], [3.0, 0.0, 0.0, 0.0]]
    assert monte_carlo_returns(r, m, gamma=0.5).tolist() == [[3.0, 4.0, 4.0, 0.0], [3.0, 0.0, 0.0, 0.0]]
    # the lam = 1 returns of GAE whatever the values (Schulman et al. 2015b, eq. 16)
    v = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _, ret = estimate_advantages("gae", r, m, group_index=torch.tensor([0, 1]), values=v, gamma=0.5, lam=1.0)
    torch.testing.assert_close(ret, monte_carlo_returns(r, m, gamma=0.5), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="gamma"):
        monte_carlo_returns(r, m, gamma=2.0)


def test_unknown_option_names_the_option_and_the_estimator():
    r, m = one_token([1.0, 0.0])
    with pytest.raises(TypeError, match=r"'grpo'.*'epsilon'.*valid options: scale, eps, unbiased"):
        estimate_advantages("grpo", r, m, group_index=torch.tensor([0, 0]), epsilon=1e-4)
    with pytest.raises(TypeError, match=r"'rloo'.*'scale'"):
        estimate_advantages("rloo", r, m, group_index=torch.tensor([0, 0]), scale="none")


def test_shared_argument_errors_name_the_argument():
    r = torch.zeros(2, 3)
    gi = torch.tensor([0, 0])
    with pytest.raises(ValueError, match="response_mask"):
        estimate_advantages("grpo", r, torch.ones(2, 4), group_index=gi)
    with pytest.raises(ValueError, match="token_rewards"):
        estimate_advantages("grpo", torch.zeros(6), torch.ones(6), group_index=gi)
    with pytest.raises(ValueError, match="group_index"):
        estimate_advantages("grpo", r, torch.ones(2, 3), group_index=torch.tensor([0, 0, 1]))
    with pytest.raises(TypeError, match="group_index"):
        estimate_advantages("grpo", r, torch.ones(2, 3), group_index=torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match="values"):
        estimate_advantages("gae", r, torch.ones(2, 3), group_index=gi, values=torch.zeros(2, 2))


def test_outputs_are_detached_and_in_the_rewards_dtype():
    r = torch.tensor([[0.5, 1.0], [0.0, 0.0]], requires_grad=True)
    v = torch.zeros(2, 2, requires_grad=True)
    for name, opts in _ALL_OPTIONS.items():
        a, ret = estimate_advantages(
            name, r, torch.ones(2, 2), group_index=torch.tensor([0, 0]), values=v, **opts
        )
        assert not a.requires_grad and not ret.requires_grad, name
        assert a.dtype == ret.dtype == torch.float32, name


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


# ---------------------------------------------------------------------------------------------
# Invariances shared by every estimator
# ---------------------------------------------------------------------------------------------

_ALL_OPTIONS = {
    "reinforce": {"baseline": 0.3},
    "rloo": {},
    "grpo": {},
    "remax": {"baseline_rewards": torch.tensor([0.5, 0.0])},
    "reinforce_pp": {"gamma": 0.9, "group_baseline": True},
    "gae": {"gamma": 0.9, "lam": 0.8, "critic_lam": 1.0, "length_adaptive_alpha": None},
}


def _invariance_batch(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, steps = 8, 7
    r = torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, steps, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, steps + 1, (batch,), generator=gen)
    m = right_padded_mask(lengths, steps)
    gi = torch.tensor([0, 1, 0, 1, 2, 3, 3, 2])
    return r, v, m, gi


def _options_for(name, batch):
    opts = dict(_ALL_OPTIONS[name])
    if name == "remax":
        opts["baseline_rewards"] = torch.linspace(-1, 1, batch, dtype=torch.float64)
    return opts


@pytest.mark.parametrize("name", BUILTIN)
def test_masked_rewards_and_values_never_change_any_output(name):
    for seed in range(3):
        r, v, m, gi = _invariance_batch(seed)
        opts = _options_for(name, r.shape[0])
        a, ret = estimate_advantages(name, r, m, group_index=gi, values=v, **opts)
        assert torch.equal(a[m == 0], torch.zeros(int((m == 0).sum()), dtype=torch.float64))
        assert torch.equal(ret[m == 0], torch.zeros(int((m == 0).sum()), dtype=torch.float64))
        gen = torch.Generator().manual_seed(100 + seed)
        for fill in (NAN, float("inf"), None):
            junk = (
                torch.full_like(r, fill) if fill is not None else torch.randn(r.shape, generator=gen) * 1e30
            )
            r_junk = torch.where(m.bool(), r, junk.to(r.dtype))
            v_junk = torch.where(m.bool(), v, -junk.to(v.dtype))
            a2, ret2 = estimate_advantages(name, r_junk, m, group_index=gi, values=v_junk, **opts)
            assert torch.equal(a2, a), (name, fill)
            assert torch.equal(ret2, ret), (name, fill)


@pytest.mark.parametrize("name", BUILTIN)
def test_shuffling_rows_with_group_index_permutes_the_outputs(name):
    r, v, m, gi = _invariance_batch(7)
    opts = _options_for(name, r.shape[0])
    a, ret = estimate_advantages(name, r, m, group_index=gi, values=v, **opts)
    perm = torch.randperm(r.shape[0], generator=torch.Generator().manual_seed(3))
    perm_opts = {k: (val[perm] if isinstance(val, torch.Tensor) else val) for k, val in opts.items()}
    a_p, ret_p = estimate_advantages(
        name, r[perm], m[perm], group_index=gi[perm], values=v[perm], **perm_opts
    )
    torch.testing.assert_close(a_p, a[perm], rtol=0, atol=1e-13)
    torch.testing.assert_close(ret_p, ret[perm], rtol=0, atol=1e-13)
