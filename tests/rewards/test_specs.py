"""Reward functions by name (:mod:`policygrad.rewards.specs`): the built-ins, file and module
specs, and the errors of a spec that does not load."""

from __future__ import annotations

import textwrap

import pytest

from policygrad.rewards.code import code_tests
from policygrad.rewards.specs import BUILTIN_REWARDS, load_reward_function
from policygrad.rewards.verifiers import answer_correctness, answer_format, length_penalty

pytestmark = pytest.mark.unit

USER_MODULE = textwrap.dedent(
    """
    NOT_CALLABLE = 3

    def contains_please(prompts, completions, **_):
        return [1.0 if "please" in c else 0.0 for c in completions]
    """
)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards_file.py"
    path.write_text(USER_MODULE)
    return path


# ----- loading ---------------------------------------------------------------------------------
def test_builtin_names():
    assert BUILTIN_REWARDS == {
        "answer_correctness": answer_correctness,
        "answer_format": answer_format,
        "length_penalty": length_penalty,
        "code_tests": code_tests,
    }
    assert load_reward_function("answer_format") is answer_format
    assert load_reward_function(answer_format) is answer_format  # a callable passes through


def test_load_from_file(user_file):
    fn = load_reward_function(f"{user_file}:contains_please")
    assert fn(["p", "p"], ["please", "no"]) == [1.0, 0.0]


def test_load_from_module(tmp_path, monkeypatch):
    (tmp_path / "policygrad_test_user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_function("policygrad_test_user_rewards:contains_please")
    assert fn(["p"], ["please"]) == [1.0]


def test_load_errors(user_file, tmp_path):
    with pytest.raises(ValueError, match="unknown reward function 'correctness'.*answer_correctness"):
        load_reward_function("correctness")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward_function(f"{tmp_path / 'missing.py'}:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'.*contains_please"):
        load_reward_function(f"{user_file}:nope")
    with pytest.raises(TypeError, match="'NOT_CALLABLE'.*is a int, not a function"):
        load_reward_function(f"{user_file}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg_xyz.mod'.*No module named"):
        load_reward_function("no_such_pkg_xyz.mod:f")
    with pytest.raises(ValueError, match="malformed"):
        load_reward_function("answer_format:")
    with pytest.raises(TypeError, match="string or a callable"):
        load_reward_function(3)


