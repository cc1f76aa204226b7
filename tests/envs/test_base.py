"""The environment protocol's checks: messages and step results are validated, normalised and
copied; the stop reasons and which of them truncate; the protocol's defaults."""

# ruff: noqa: ARG002 - environments take the protocol's arguments
from __future__ import annotations

import math

import pytest
import torch

from policygrad.envs.base import (
    STOP_REASONS,
    TRUNCATING_STOPS,
    Environment,
    EnvironmentFailure,
    StepResult,
    check_messages,
    check_step_result,
)

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------------------- check_messages


def test_good_messages_are_copied_not_aliased():
    original = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    got = check_messages(original, "reset()")
    assert got == original
    assert got is not original
    assert all(g is not o for g, o in zip(got, original))
    got[1]["content"] = "changed"
    assert original[1]["content"] == "2+2?"  # the caller's dict is untouched


def test_messages_keep_only_role_and_content_and_accept_a_tuple():
    got = check_messages(({"role": "user", "content": "x", "name": "tool-7"},), "reset()")
    assert got == [{"role": "user", "content": "x"}] and isinstance(got, list)


def test_empty_messages_are_allowed_only_when_asked():
    with pytest.raises(EnvironmentFailure, match=r"^reset\(\) is empty; give at least one message$"):
        check_messages([], "reset()")
    assert check_messages([], "StepResult.observation", allow_empty=True) == []


@pytest.mark.parametrize("value", ["hello", {"role": "user", "content": "x"}, None, 3])
def test_a_non_list_is_refused_naming_its_type(value):
    with pytest.raises(EnvironmentFailure) as info:
        check_messages(value, "reset()")
    assert str(info.value) == f"reset() must be a list of messages, got {type(value).__name__}"


@pytest.mark.parametrize(
    "bad",
    [
        {"content": "no role"},
        {"role": "user"},
        {"role": "user", "content": 42},
        {"role": None, "content": "x"},
        {"role": "user", "content": None},
        "user: hi",
        ["user", "hi"],
    ],
)
def test_a_malformed_message_is_refused_naming_its_index(bad):
    messages = [{"role": "user", "content": "fine"}, {"role": "assistant", "content": "ok"}, bad]
    with pytest.raises(EnvironmentFailure) as info:
        check_messages(messages, "StepResult.observation")
    assert str(info.value).startswith(
        "StepResult.observation[2] must be a dict with string 'role' and 'content', got "
    )


def test_the_first_bad_message_is_the_one_named():
    with pytest.raises(EnvironmentFailure, match=r"^reset\(\)\[1\] must be a dict"):
        check_messages([{"role": "user", "content": "a"}, {"role": "user"}, {"content": "b"}], "reset()")


# ----------------------------------------------------------------------------- check_step_result


@pytest.mark.parametrize("value", [None, (), {"reward": 1.0}, [{"role": "user", "content": "x"}]])
def test_a_non_step_result_is_refused(value):
    with pytest.raises(EnvironmentFailure) as info:
        check_step_result(value)
    assert str(info.value) == f"step() must return a StepResult, got {type(value).__name__}"


@pytest.mark.parametrize("reward", [True, False, "1.0", None, 1 + 0j])
def test_a_reward_that_is_not_a_number_is_refused(reward):
    with pytest.raises(EnvironmentFailure, match=r"^StepResult\.reward must be a number, got "):
        check_step_result(StepResult(reward=reward))


# 1e39 is a finite Python float but infinite in float32, where rewards are kept.
@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, 1e39, -3.5e38])
def test_a_reward_float32_cannot_hold_is_refused(reward):
    with pytest.raises(EnvironmentFailure, match=r"^StepResult\.reward must be finite and within float32"):
        check_step_result(StepResult(reward=reward))
    assert check_step_result(StepResult(reward=3.4e38)).reward == 3.4e38


@pytest.mark.parametrize("done", ["no", "", None, 2, [True]])
def test_done_must_be_true_or_false(done):
    with pytest.raises(EnvironmentFailure, match=r"^StepResult\.done must be True or False"):
        check_step_result(StepResult(done=done))


@pytest.mark.parametrize("restart", ["yes", None, 1.5, [False]])
def test_restart_must_be_true_or_false(restart):
    with pytest.raises(EnvironmentFailure, match=r"^StepResult\.restart must be True or False"):
        check_step_result(StepResult([{"role": "user", "content": "x"}], restart=restart))


def test_numpy_and_torch_booleans_are_booleans():
    np = pytest.importorskip("numpy")
    message = [{"role": "user", "content": "x"}]
    for true in (np.True_, np.bool_(True), torch.tensor(True)):
        result = check_step_result(StepResult(message, done=true, restart=true))
        assert result.done is True and result.restart is True
    with pytest.raises(EnvironmentFailure, match=r"^StepResult\.done must be True or False"):
        check_step_result(StepResult(done=np.array([True, False])))


def test_a_restart_needs_the_conversation_it_restarts_with():
    with pytest.raises(EnvironmentFailure, match=r"^StepResult\.observation is empty"):
        check_step_result(StepResult([], restart=True))
    # done wins: a finished episode's observation is not shown, so it may be empty
    assert check_step_result(StepResult([], done=True, restart=True)).done
    messages = [{"role": "user", "content": "from here on", "name": "dropped"}]
    assert check_step_result(StepResult(messages, restart=1 == 1)) == StepResult(
        [{"role": "user", "content": "from here on"}], restart=True
    )


@pytest.mark.parametrize("value", ["0.5", None, True, [1.0], math.nan * 1j, math.nan, 1e39])
def test_non_numeric_info_is_refused_naming_the_key(value):
    with pytest.raises(EnvironmentFailure) as info:
        check_step_result(StepResult(info={"ok": 1.0, "calls": value}))
    assert str(info.value).startswith("StepResult.info['calls'] must be ")


def test_a_bad_observation_is_refused_naming_the_field():
    with pytest.raises(EnvironmentFailure, match=r"^StepResult\.observation\[0\] must be a dict"):
        check_step_result(StepResult(observation=[{"role": "user", "content": b"bytes"}]))
    with pytest.raises(EnvironmentFailure, match=r"^StepResult\.observation must be a list"):
        check_step_result(StepResult(observation="just text"))


def test_a_good_step_result_is_normalised():
    observation = [{"role": "tool", "content": "42"}]
    result = StepResult(observation, reward=1, done=1, info={"calls": 2, 3: 0.5})
    got = check_step_result(result)
    assert type(got.reward) is float and got.reward == 1.0
    assert got.done is True
    # keys become strings, values floats
    assert got.info == {"calls": 2.0, "3": 0.5}
    assert all(type(k) is str and type(v) is float for k, v in got.info.items())
    assert got.observation == observation and got.observation is not observation
    assert got.observation[0] is not observation[0]
    # an empty observation is fine (a done step shows none)
    assert check_step_result(StepResult(done=True)).observation == []


def test_numpy_like_reals_are_accepted_as_floats():
    np = pytest.importorskip("numpy")
    got = check_step_result(StepResult(reward=np.float32(0.25), info={"n": np.int64(3)}))
    assert type(got.reward) is float and got.reward == 0.25
    assert got.info == {"n": 3.0} and type(got.info["n"]) is float


# ----------------------------------------------------------------------------- stop reasons


def test_stop_reasons_and_which_truncate():
    assert STOP_REASONS == ("done", "max_turns", "length", "budget", "context", "error")
    assert frozenset({"length", "budget", "context"}) == TRUNCATING_STOPS
    assert TRUNCATING_STOPS <= set(STOP_REASONS)
    for reason in ("done", "max_turns", "error"):
        assert reason not in TRUNCATING_STOPS


# ----------------------------------------------------------------------------- defaults


class Minimal(Environment):
    def reset(self, row, *, seed):
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        return StepResult(done=True)


def test_the_protocol_defaults():
    env = Minimal()
    for reason in STOP_REASONS:
        if reason != "error":
            got = env.final_reward(reason)
            assert type(got) is float and got == 0.0
    before = dict(vars(env))
    assert env.close() is None
    assert vars(env) == before  # close is a no-op
    env.close()  # and may be called again


def test_an_environment_must_implement_reset_and_step():
    class NoStep(Environment):
        def reset(self, row, *, seed):
            return []

    with pytest.raises(TypeError, match="abstract"):
        NoStep()
