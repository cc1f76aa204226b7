"""A run that trains nothing fails loudly: ``why_nothing_trained`` names the cause of an empty
step from its metrics, and ``UpdateWatch`` ends a run after ``max_skipped_updates`` empty steps
in a row or with no update at all."""

from __future__ import annotations

import pytest

from policygrad.config.train import load_config
from policygrad.errors import TrainingError
from policygrad.run.health import UpdateWatch, why_nothing_trained

pytestmark = pytest.mark.unit


def config(**over):
    base = {"optim": {"lr": 1e-3, "target_kl": 0.05}, "max_skipped_updates": 3}
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(None, base)


# ----------------------------------------------------------------------------- causes


def test_non_finite_steps_name_lr_and_the_minus_inf_tokens():
    cause = why_nothing_trained({"optim/skipped_nonfinite": 2, "policy/nonfinite_tokens": 3}, config())
    assert cause.startswith(
        "every optimizer step was skipped because the loss or the gradient was not finite"
    )
    assert "(3 sampled tokens had log-prob -inf)" in cause and "(lr=0.001)" in cause
    plain = why_nothing_trained({"critic/skipped_nonfinite": 1}, config())
    assert "log-prob -inf" not in plain and "lr=0.001" in plain
    # Non-finite skips are named even when steps were counted too: they are the first cause.
    assert why_nothing_trained({"optim/skipped_nonfinite": 1, "optim/steps": 2}, config()).startswith(
        "every optimizer step was skipped"
    )


def test_non_finite_steps_name_the_loss_terms_weights_that_are_set():
    # Before: only optim.lr was named, though a large loss.positive_lm_coef overflows the gradient too.
    cfg = config(loss={"positive_lm_coef": 50.0}, kl={"beta": 0.04, "placement": "loss"})
    cause = why_nothing_trained({"optim/skipped_nonfinite": 1}, cfg)
    named = "the weights of the loss terms (loss.positive_lm_coef=50, kl.beta=0.04)"
    assert f"check optim.lr (lr=0.001), {named}, the scale of the rewards" in cause
    assert "weights of the loss terms" not in why_nothing_trained({"optim/skipped_nonfinite": 1}, config())


def test_a_zero_gradient_from_equal_scores_names_the_reward_functions():
    metrics = {"optim/steps": 2, "reward/zero_variance_group_frac": 1, "reward/mean": 0.5}
    cause = why_nothing_trained(metrics, config())
    assert "each group's samples the same score (reward/mean 0.5)" in cause
    assert "reward.functions=['answer_correctness']" in cause and "(code rows: code_tests)" in cause
    assert "drop_zero_variance_groups=true" in cause
    code = why_nothing_trained(metrics, config(reward={"functions": ["code_tests"]}))
    assert "(code rows: code_tests)" not in code  # it already is code_tests


def test_a_zero_gradient_with_varied_scores_is_a_diverged_run_naming_optim_lr():
    # Half the groups scored their samples differently, so their advantages were not 0: a gradient
    # of exactly 0 is a policy that no longer responds (optim.lr=1e6 collapses it), not flat rewards.
    metrics = {"optim/steps": 1, "reward/zero_variance_group_frac": 0.5, "policy/entropy": 10.8}
    cause = why_nothing_trained(metrics, config(optim={"lr": 1e6}))
    assert cause.startswith("the run diverged: the policy's gradient was exactly 0 at every optimizer step")
    assert "(policy/entropy 10.8)" in cause and "lower optim.lr (lr=1e+06)" in cause
    assert "reward.functions" not in cause


def test_a_zero_gradient_without_group_statistics_is_the_general_message():
    cause = why_nothing_trained({"optim/steps": 1}, config())
    assert cause.startswith("the policy's gradient was exactly 0 at every optimizer step")


@pytest.mark.parametrize(
    ("metrics", "start"),
    [
        ({"optim/early_stopped": 1}, "optim.target_kl=0.05 stopped every update before its first step"),
        ({"dynamic_sampling/groups_kept": 0}, "no group had reward signal"),
        ({"reward/invalid_frac": 1}, "the reward functions failed on every row"),
        ({"reward/invalid_frac": 0.5}, "no token carried loss"),  # some rows were scored
        ({"response/truncated_frac": 1}, "no token carried loss"),  # truncation=none keeps them
        ({}, "no token carried loss"),
    ],
)
def test_each_cause_of_an_empty_step(metrics, start):
    assert why_nothing_trained(metrics, config()).startswith(start)


def test_no_group_kept_names_what_dynamic_sampling_decided_on():
    kept_none = {"dynamic_sampling/groups_kept": 0}
    plain = why_nothing_trained(kept_none, config(drop_zero_variance_groups=True))
    assert "dynamic_sampling.reward='answer_correctness'); check the reward functions" in plain
    # with an environment: its rewards (turn rewards too) are in the return it decides on
    env = {"env": {"name": "builtin:guess"}, "drop_zero_variance_groups": True}
    rewards = "check the environment's rewards (env.name=builtin:guess)"
    cause = why_nothing_trained(kept_none, config(**env))
    assert f"dynamic_sampling.reward='return'); {rewards}" in cause
    functions = {"functions": ["answer_format"]}
    both = why_nothing_trained(kept_none, config(**env, reward=functions))
    assert both.endswith(f"{rewards} and the reward functions")
    named = config(**env, reward=functions, dynamic_sampling={"reward": "answer_format"})
    assert why_nothing_trained(kept_none, named).endswith("check the reward function 'answer_format'")


def test_every_completion_cut_under_truncation_exclude():
    cfg = config(reward={"truncation": "exclude"}, rollout={"max_new_tokens": 16})
    cause = why_nothing_trained({"response/truncated_frac": 1}, cfg)
    assert cause.startswith("every completion was cut at rollout.max_new_tokens=16")


# ----------------------------------------------------------------------------- UpdateWatch


def test_applied_updates_count_policy_and_critic_steps():
    watch = UpdateWatch(config())
    watch.observe({"optim/steps": 2, "critic/steps": 3})
    watch.observe({"optim/steps": 1, "critic/steps": float("nan")})  # a NaN count is no update
    assert (watch.applied, watch.steps, watch.empty_in_a_row) == (2 + 3 + 1, 2, 0)


def test_a_zero_grad_norm_counts_as_no_update():
    watch = UpdateWatch(config())
    watch.observe({"optim/steps": 2, "optim/grad_norm": 0.0, "critic/steps": 1, "critic/grad_norm": 0.0})
    assert (watch.applied, watch.empty_in_a_row) == (0, 1)
    watch.observe({"optim/steps": 2, "optim/grad_norm": 0.0, "critic/steps": 1, "critic/grad_norm": 0.3})
    assert (watch.applied, watch.empty_in_a_row) == (1, 0)  # the critic moved


def test_max_skipped_updates_empty_steps_in_a_row_end_the_run():
    watch = UpdateWatch(config())  # max_skipped_updates=3
    watch.observe({})
    watch.observe({})
    watch.observe({"optim/steps": 1})  # an applied step resets the count
    watch.observe({})
    watch.observe({"optim/early_stopped": 1})
    assert watch.empty_in_a_row == 2
    with pytest.raises(TrainingError) as caught:
        watch.observe({"optim/early_stopped": 1})
    assert str(caught.value) == (
        "3 steps in a row applied no update: optim.target_kl=0.05 stopped every update before its first "
        "step (policy/approx_kl was above it); raise optim.target_kl (max_skipped_updates=3)"
    )


def test_max_skipped_updates_zero_never_ends_the_run():
    watch = UpdateWatch(config(max_skipped_updates=0))
    for _ in range(50):
        watch.observe({})
    assert watch.empty_in_a_row == 50


def test_check_trained_fails_a_run_that_applied_nothing():
    watch = UpdateWatch(config(max_skipped_updates=0))
    watch.check_trained()  # no step taken: nothing to judge
    watch.observe({"dynamic_sampling/groups_kept": 0})
    watch.observe({"dynamic_sampling/groups_kept": 0})
    with pytest.raises(
        TrainingError, match=r"^the run applied no update in 2 steps: no group had reward signal"
    ):
        watch.check_trained()
    watch.observe({"optim/steps": 1})
    watch.check_trained()


def test_state_round_trips_and_missing_keys_read_as_zero():
    watch = UpdateWatch(config())
    watch.observe({"optim/steps": 4})
    watch.observe({})
    assert watch.state_dict() == {
        "applied": 4,
        "steps": 2,
        "empty_in_a_row": 1,
        "skipped_nonfinite": 0,
        "diverged": 0,
    }
    resumed = UpdateWatch(config())
    resumed.load_state_dict(watch.state_dict())
    assert resumed.state_dict() == watch.state_dict()
    resumed.load_state_dict({"steps": 7})
    assert resumed.state_dict() == {
        "applied": 0,
        "steps": 7,
        "empty_in_a_row": 0,
        "skipped_nonfinite": 0,
        "diverged": 0,
    }


def test_a_run_that_skipped_non_finite_steps_ends_with_one_warning():
    watch = UpdateWatch(config(optim={"lr": 1e6}))
    watch.observe({"optim/steps": 1})
    assert watch.end_warning() is None
    watch.observe({"optim/steps": 0, "optim/skipped_nonfinite": 1})
    watch.observe({"optim/steps": 0, "optim/skipped_nonfinite": 2, "critic/skipped_nonfinite": 1})
    warning = watch.end_warning()
    assert warning.startswith(
        "warning: the run diverged over its 3 steps: 4 optimizer steps were skipped because the loss or "
        "the gradient was not finite"
    )
    assert "lower optim.lr (lr=1e+06)" in warning and "\n" not in warning
    resumed = UpdateWatch(config(optim={"lr": 1e6}))
    resumed.load_state_dict(watch.state_dict())
    assert resumed.end_warning() == warning


def test_a_run_whose_policy_stopped_responding_ends_with_the_warning():
    watch = UpdateWatch(config())
    watch.observe({"optim/steps": 1})
    # a gradient of exactly 0 while half the groups scored differently: diverged (see above)
    watch.observe({"optim/steps": 1, "optim/grad_norm": 0.0, "reward/zero_variance_group_frac": 0.5})
    warning = watch.end_warning()
    assert warning.startswith(
        "warning: the run diverged over its 2 steps: in 1 steps the policy's gradient was exactly 0"
    )


def test_the_update_watch_names_the_cause_and_the_limit():
    cfg = load_config(None, {"max_skipped_updates": 3})
    watch = UpdateWatch(cfg)
    watch.observe({"optim/steps": 0, "optim/skipped_nonfinite": 1})
    watch.observe({"optim/steps": 0, "optim/skipped_nonfinite": 1})
    with pytest.raises(
        TrainingError, match=r"3 steps in a row applied no update: every optimizer step was skipped"
    ):
        watch.observe({"optim/steps": 0, "optim/skipped_nonfinite": 1})
    watch = UpdateWatch(cfg)
    watch.observe({"optim/steps": 0, "reward/invalid_frac": 1.0, "reward/valid_frac": 0.0})
    with pytest.raises(
        TrainingError, match="applied no update in 1 steps: the reward functions failed on every row"
    ):
        watch.check_trained()
    watch.observe({"optim/steps": 2})
    watch.check_trained()
    assert watch.state_dict() == {
        "applied": 2,
        "steps": 2,
        "empty_in_a_row": 0,
        "skipped_nonfinite": 0,
        "diverged": 0,
    }


def test_steps_with_an_exactly_zero_gradient_are_not_updates():
    cfg = load_config(None, {"max_skipped_updates": 2})
    flat = {"optim/steps": 1, "optim/grad_norm": 0.0, "reward/mean": 1.0}
    flat["reward/zero_variance_group_frac"] = 1.0
    watch = UpdateWatch(cfg)
    watch.observe(flat)
    with pytest.raises(TrainingError) as info:
        watch.observe(flat)
    assert str(info.value) == (
        "2 steps in a row applied no update: every advantage was 0 at every step: the rewards gave each "
        "group's samples the same score (reward/mean 1), so the gradient was exactly 0 and nothing was "
        "learned; make reward.functions=['answer_correctness'] tell the completions apart (code rows: "
        "code_tests), or set drop_zero_variance_groups=true to skip such groups (max_skipped_updates=2)"
    )
    # With an environment the episodes are scored by it first: the message names it.
    env_cfg = load_config(None, {"max_skipped_updates": 2, "env": {"name": "builtin:guess"}})
    watch = UpdateWatch(env_cfg)
    watch.observe(flat)
    with pytest.raises(TrainingError, match=r"make the environment's rewards \(env\.name=builtin:guess\)"):
        watch.observe(flat)
    # Groups that vary but whose advantages still vanish: the cause is the gradient, named so.
    watch = UpdateWatch(cfg)
    watch.observe({**flat, "reward/zero_variance_group_frac": 0.5})
    diverged = "in 1 steps: the run diverged: the policy's gradient was exactly 0 at every"
    with pytest.raises(TrainingError, match=diverged):
        watch.check_trained()
    # A critic that learned, or a policy gradient that is not 0, is an update.
    watch = UpdateWatch(cfg)
    watch.observe({**flat, "critic/steps": 1, "critic/grad_norm": 0.5})
    watch.observe({**flat, "optim/grad_norm": 1e-12})
    watch.check_trained()
    assert watch.state_dict() == {
        "applied": 2,
        "steps": 2,
        "empty_in_a_row": 0,
        "skipped_nonfinite": 0,
        "diverged": 0,
    }
    watch.observe({**flat, "critic/steps": 1, "critic/grad_norm": 0.0})
    assert watch.empty_in_a_row == 1
