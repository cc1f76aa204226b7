"""Tests of policygrad.specs.estimators: the built-in estimators' capabilities declared without
torch, the minimum group sizes as functions of the options, and the declaration of a new name."""

from __future__ import annotations

import pytest

from policygrad.specs import estimators as spec_module
from policygrad.specs.estimators import (
    BUILTIN_ESTIMATORS,
    VINEPPO_DEFAULTS,
    EstimatorSpec,
    check_min_group_size,
    check_new_estimator_name,
    declare_estimator,
    estimator_spec,
    list_advantage_estimators,
)

pytestmark = pytest.mark.unit


def test_the_builtin_declarations():
    assert list_advantage_estimators() == (
        "gae",
        "grpo",
        "reinforce",
        "reinforce_pp",
        "remax",
        "rloo",
        "vineppo",
    )
    assert [s.name for s in BUILTIN_ESTIMATORS] == [
        "reinforce", "rloo", "grpo", "remax", "reinforce_pp", "vineppo", "gae"
    ]  # fmt: skip
    assert estimator_spec("vineppo").options == tuple(VINEPPO_DEFAULTS)
    assert estimator_spec("vineppo").inputs == ("vine_values", "vine_segments")
    assert estimator_spec("reinforce_pp").batch_statistics
    assert not any(
        estimator_spec(n).batch_statistics for n in list_advantage_estimators() if n != "reinforce_pp"
    )
    assert [n for n in list_advantage_estimators() if estimator_spec(n).needs_values] == ["gae"]


def test_minimum_group_sizes_follow_the_options():
    # rloo's leave-one-out baseline and grpo's group std need a second sample of the prompt;
    # reinforce_pp's group baseline and vineppo's prompt_value=group only with those options.
    sizes = {n: estimator_spec(n).min_group_size({}) for n in list_advantage_estimators()}
    assert sizes == {
        "gae": 1,
        "grpo": 2,
        "reinforce": 1,
        "reinforce_pp": 1,
        "remax": 1,
        "rloo": 2,
        "vineppo": 1,
    }
    assert estimator_spec("reinforce_pp").min_group_size({"group_baseline": True}) == 2
    assert estimator_spec("reinforce_pp").min_group_size({"group_baseline": False}) == 1
    assert estimator_spec("vineppo").min_group_size({"prompt_value": "group"}) == 2
    assert estimator_spec("vineppo").min_group_size({"prompt_value": "rollouts"}) == 1


def test_unknown_names_and_bad_group_sizes_are_refused_with_the_registry_messages():
    with pytest.raises(ValueError) as info:
        estimator_spec("ppo")
    assert str(info.value) == (
        "unknown advantage estimator 'ppo'; registered: "
        "gae, grpo, reinforce, reinforce_pp, remax, rloo, vineppo"
    )
    with pytest.raises(ValueError, match="unknown advantage estimator None"):
        estimator_spec(None)
    with pytest.raises(
        ValueError, match=r"^advantage estimator 'grpo' is already registered; choose another"
    ):
        check_new_estimator_name("grpo")
    check_new_estimator_name("not_declared")
    with pytest.raises(TypeError, match=r"^x must be an int >= 1 \(or a function of the options"):
        check_min_group_size(True, "x")
    with pytest.raises(ValueError, match=r"^x must be >= 1, got 0$"):
        check_min_group_size(0, "x")


def test_declaring_a_new_estimator(monkeypatch):
    monkeypatch.setattr(spec_module, "_SPECS", dict(spec_module._SPECS))
    spec = EstimatorSpec("test_only_declared", ("level",), needs_values=False, inputs=(), group_size_rule=3)
    assert declare_estimator(spec) is spec
    assert estimator_spec("test_only_declared") is spec and spec.min_group_size({}) == 3
    assert "test_only_declared" in list_advantage_estimators()
    with pytest.raises(ValueError, match="'test_only_declared' is already registered"):
        declare_estimator(spec)
    with pytest.raises(TypeError, match="declare_estimator takes an EstimatorSpec, got dict"):
        declare_estimator({"name": "x"})
