"""Tests of policygrad.config.agent: ``agent.function`` makes a run an episode run of the agent
environment, with the agent's limits; what would be silently overridden is refused."""

from __future__ import annotations

import pytest

from policygrad.config.agent import _RETRIES_DEFAULT, _STEP_TIMEOUT_DEFAULT, AGENT_ENVIRONMENT
from policygrad.config.sections import ConfigError, RolloutConfig
from policygrad.config.train import load_config

pytestmark = pytest.mark.unit

AGENT = "--agent.function=agents/guess.py:run"


def test_the_defaults_an_agent_checks_against_are_the_rollout_sections():
    r = RolloutConfig()
    assert (r.env_step_timeout_s, r.env_retries) == (_STEP_TIMEOUT_DEFAULT, _RETRIES_DEFAULT)


def test_an_agent_is_the_agent_environment_with_its_limits():
    cfg = load_config(None, [AGENT, "--agent.timeout_s=30", "--agent.retries=2"])
    assert cfg.env.name == AGENT_ENVIRONMENT
    assert cfg.env.options == {"function": "agents/guess.py:run", "rewritten_history": "segment"}
    assert (cfg.rollout.env_step_timeout_s, cfg.rollout.env_retries) == (30.0, 2)
    assert cfg.reward.functions == []  # the agent's return is the reward, as an environment's
    # its saved form loads again to the same config (a resume)
    again = load_config(None, cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


def test_a_saved_agent_config_takes_a_new_function_timeout_and_retries():
    # A new run from a saved config.yaml: env.name and the two rollout fields there were derived
    # from the agent section, which decides them again.
    saved = load_config(None, [AGENT]).to_dict()
    agent = {"function": "other.py:go", "timeout_s": 30, "retries": 0, "rewritten_history": "fail"}
    cfg = load_config(None, {**saved, "agent": agent})
    assert cfg.env.options == {"function": "other.py:go", "rewritten_history": "fail"}
    assert (cfg.rollout.env_step_timeout_s, cfg.rollout.env_retries) == (30.0, 0)


def test_without_an_agent_nothing_changes():
    cfg = load_config(None, [])
    assert cfg.agent.function is None and cfg.env.name is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [AGENT, "--env.name=builtin:guess"],
            "agent.function and env.name='builtin:guess' (or env.options) are",
        ),
        ([AGENT, '--env.options={"x": 1}'], "agent.function and env.name=None (or env.options) are both set"),
        ([AGENT, "--agent.timeout_s=1e300"], "agent.timeout_s must be at most 86400"),
        (
            [AGENT, "--rollout.env_step_timeout_s=5"],
            "rollout.env_step_timeout_s does not apply to an agent; set agent.timeout_s",
        ),
        (
            [AGENT, "--rollout.env_retries=3"],
            "rollout.env_retries does not apply to an agent; set agent.retries",
        ),
        ([AGENT, "--agent.timeout_s=0"], "agent.timeout_s must be > 0"),
        ([AGENT, "--agent.retries=11"], "agent.retries must be an int in [0, 10], got 11"),
        (
            ["--agent.function=run"],
            "agent.function must be 'path/to/file.py:function' or 'package.module:function'",
        ),
        ([f"--env.name={AGENT_ENVIRONMENT}"], "is set by agent.function; set agent.function instead"),
        ([AGENT, "--reward.functions=[]", "--rollout.ignore_eos=true"], "rollout.ignore_eos with env.name"),
        ([AGENT, "--agent.rewritten_history=drop"], "agent.rewritten_history must be one of segment, fail"),
        # Segments train with one advantage per episode: a critic and a KL in the reward do not
        # give one.
        ([AGENT, "--algorithm=ppo"], "which the gae estimator's per-token advantages (a critic) does not"),
        ([AGENT, "--kl.placement=reward", "--kl.beta=0.1"], "which kl.placement=reward (a KL penalty"),
        (
            [AGENT, "--algorithm=reinforce_pp", "--advantage.options.gamma=0.9"],
            "which advantage.options.gamma=0.9 (a discount over an episode's tokens) does not give",
        ),
    ],
)
def test_bad_agent_settings_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["--algorithm=ppo"],
        ["--kl.placement=reward", "--kl.beta=0.1"],
    ],
)
def test_what_cannot_train_segments_loads_when_a_rewritten_history_fails_the_episode(overrides):
    cfg = load_config(None, [AGENT, "--agent.rewritten_history=fail", *overrides])
    assert cfg.env.options["rewritten_history"] == "fail"
    # and the outcome estimators with the KL in the loss train segments
    for algorithm in ("grpo", "rloo", "reinforce"):
        load_config(None, [AGENT, f"--algorithm={algorithm}", "--kl.placement=loss", "--kl.beta=0.01"])
