"""Evaluating a saved model: the run configuration it evaluates with (single-turn or episodes),
the default dataset of an environment, the output path checked before anything loads, and the
JSONL that is never half-written. The whole command is tested in test_command.py."""

from __future__ import annotations

import pytest

from policygrad.config.train import DataConfig, RolloutConfig
from policygrad.evaluate.model import (
    default_env_dataset,
    eval_config,
    eval_output_path,
    write_jsonl,
)
from policygrad.rewards.code import TaskReward

pytestmark = pytest.mark.unit


def test_write_jsonl_never_leaves_half_a_file(tmp_path):
    path = tmp_path / "eval.jsonl"
    write_jsonl(str(path), [{"a": 1}])
    with pytest.raises(TypeError):  # the second record cannot be written: the old file stays whole
        write_jsonl(str(path), [{"a": 2}, {"b": object()}])
    assert path.read_text() == '{"a": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.jsonl"]  # no temporary file left
    write_jsonl(str(path), [{"a": 2}, {"b": 3}])
    assert path.read_text() == '{"a": 2}\n{"b": 3}\n'


def test_eval_config_single_turn_and_episodes():
    data = DataConfig(eval_dataset="builtin:arithmetic")
    single = eval_config("m", data, seed=3, engine="hf", adapter="a", max_new_tokens=7)
    assert (single.seed, single.model.name, single.model.adapter, single.data) == (3, "m", "a", data)
    assert (single.rollout.engine, single.rollout.max_new_tokens) == ("hf", 7)
    # Rows of any kind are judged by their own verifier; no environment, default episode limits.
    assert single.reward.functions == list(TaskReward.functions) and single.env.name is None
    defaults = RolloutConfig()
    assert (single.rollout.max_turns, single.rollout.max_episode_tokens) == (
        defaults.max_turns,
        defaults.max_episode_tokens,
    )
    episodes = eval_config(
        "m", data, engine="hf", max_new_tokens=5, env="builtin:guess", env_options={"high": 9}, max_turns=2,
        max_episode_tokens=40,
    )
    assert (episodes.env.name, episodes.env.options) == ("builtin:guess", {"high": 9})
    rollout = episodes.rollout
    assert (rollout.max_turns, rollout.max_episode_tokens, rollout.max_new_tokens) == (2, 40, 5)
    assert episodes.reward.functions == []  # the environment's final reward is the score


def test_an_environment_is_evaluated_on_its_own_task_by_default():
    assert default_env_dataset("builtin:guess") == "builtin:guess"
    assert default_env_dataset(" builtin:code_feedback ") == "builtin:code"
    assert default_env_dataset("my.module:Env") == "builtin:arithmetic"


def test_the_output_path_is_checked_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert eval_output_path(None, "data/gsm.jsonl") == str(tmp_path / "eval-gsm.jsonl")
    assert eval_output_path(None, "builtin:arithmetic") == str(tmp_path / "eval-builtin-arithmetic.jsonl")
    with pytest.raises(ValueError, match=r"^--output .* is a folder; give a file"):
        eval_output_path(str(tmp_path), None)
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    with pytest.raises(ValueError, match=r"is the dataset being evaluated; give another file"):
        eval_output_path(str(data), str(data))
