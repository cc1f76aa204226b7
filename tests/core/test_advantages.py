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
    list_advantage_estimators,
    monte_carlo_returns,
    register_advantage_estimator,
)
from policygrad.specs import estimators as estimator_specs

pytestmark = pytest.mark.unit

NAN = float("nan")
BUILTIN = ("gae", "grpo", "reinforce", "reinforce_pp", "remax", "rloo")


def _unregister(name):
    """Take a test-only estimator out of both registries: its function and its declaration."""
    adv_module._ESTIMATORS.pop(name, None)
    estimator_specs._SPECS.pop(name, None)


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
        _unregister(name)
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


def test_every_declared_estimator_is_implemented_with_its_declared_options(monkeypatch):
    # the declarations the config validates against (policygrad.specs.estimators) are the ones
    # the registered callables carry, vineppo included
    for name in list_advantage_estimators():
        assert get_advantage_estimator(name).spec is estimator_specs.estimator_spec(name), name
    assert get_advantage_estimator("vineppo").options == tuple(estimator_specs.VINEPPO_DEFAULTS)
    # a function whose options drift from its declaration is refused
    monkeypatch.setattr(estimator_specs, "_SPECS", dict(estimator_specs._SPECS))
    estimator_specs.declare_estimator(EstimatorSpec("test_only_declared", ("level",), False, ()))

    def drifted(token_rewards, response_mask, *, group_index, values=None, levle=1.0):  # noqa: ARG001 (a signature to refuse)
        return token_rewards, token_rewards

    with pytest.raises(TypeError) as info:
        adv_module._implement("test_only_declared", drifted)
    assert str(info.value) == (
        "advantage estimator 'test_only_declared' is declared with the options ('level',) in "
        "policygrad.specs.estimators, but its function takes ('levle',); make them agree"
    )


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
        _unregister(name)


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
        _unregister(name)


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
