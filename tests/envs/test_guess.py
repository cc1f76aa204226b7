"""The guessing game (policygrad.envs.guess) and its dataset (policygrad.data.guess_task)."""

from __future__ import annotations

import math

import pytest

from policygrad.data.guess_task import GuessTask
from policygrad.data.sources import load_prompt_dataset, resolve_dataset
from policygrad.envs.base import check_step_result
from policygrad.envs.guess import GuessEnv
from policygrad.envs.registry import environment_factory

pytestmark = pytest.mark.unit


def _binary_search(env: GuessEnv, low: int, high: int) -> int:
    """Play the game by bisection; the number of turns it took."""
    turns = 0
    while True:
        guess = (low + high) // 2
        result = check_step_result(env.step(f"My guess: {guess}"))
        turns += 1
        if result.done:
            assert result.info["found"] == 1.0 and result.observation == []
            return turns
        reply = result.observation[0]["content"]
        assert reply in ("Higher.", "Lower.")
        low, high = (guess + 1, high) if reply == "Higher." else (low, guess - 1)


@pytest.mark.parametrize("high", [1, 2, 7, 100])
def test_binary_search_finds_every_secret_within_the_bound(high):
    bound = math.ceil(math.log2(high + 1))
    for secret in range(1, high + 1):
        env = GuessEnv(high=high)
        env.reset({"secret": secret}, seed=0)
        assert _binary_search(env, 1, high) <= bound
        assert env.final_reward("done") == 1.0


def test_replies_by_hand():
    env = GuessEnv()
    messages = env.reset({"secret": 37}, seed=0)
    assert messages[0]["role"] == "user" and "between 1 and 100" in messages[0]["content"]
    assert env.step("50").observation == [{"role": "user", "content": "Lower."}]
    assert env.step("I think 20, then 30").observation[0]["content"] == "Higher."  # the first integer
    bad = env.step("no idea")
    assert bad.observation[0]["content"] == "Reply with one integer between 1 and 100." and not bad.done
    assert bad.info["invalid"] == 1.0
    assert env.step("500").info["out_of_range"] == 1.0
    assert env.final_reward("max_turns") == 0.0
    done = env.step("37")
    assert done.done and done.info == {"guesses": 1.0, "invalid": 0.0, "out_of_range": 0.0, "found": 1.0}
    assert env.final_reward("done") == 1.0


def test_turn_penalty_makes_fewer_turns_better():
    env = GuessEnv(turn_penalty=0.1)
    env.reset({"secret": 3}, seed=0)
    env.step("1")
    env.step("3")
    assert env.final_reward("done") == pytest.approx(1.0 - 0.2)


def test_secret_from_the_seed_and_the_row_range():
    a, b = GuessEnv(), GuessEnv()
    a.reset({}, seed=5)
    b.reset({}, seed=5)
    assert a.secret == b.secret and 1 <= a.secret <= 100  # the G episodes of a row share it
    env = GuessEnv()
    env.reset({"low": 10, "high": 12, "prompt": "Guess 10..12."}, seed=1)
    assert env.low == 10 and env.high == 12 and 10 <= env.secret <= 12
    assert env.step("x").observation[0]["content"] == "Reply with one integer between 10 and 12."


def test_bad_options_and_rows():
    with pytest.raises(ValueError, match="low=5 must be at most high=4"):
        GuessEnv(low=5, high=4)
    with pytest.raises(ValueError, match="turn_penalty"):
        GuessEnv(turn_penalty=-1)
    with pytest.raises(ValueError, match="outside"):
        GuessEnv().reset({"secret": 101}, seed=0)
    with pytest.raises(ValueError, match="env.options do not fit"):
        environment_factory("builtin:guess", {"hgh": 3})
    assert isinstance(environment_factory("builtin:guess", {"high": 10})(), GuessEnv)


def test_dataset_splits_are_disjoint_and_resumable():
    task = GuessTask("medium", seed=3)
    train = {row["secret"] for row in task.train_rows(300)}
    heldout = {row["secret"] for row in task.heldout_rows()}
    assert train and heldout and not train & heldout
    assert task.train_rows(5, start=10) == task.train_rows(15)[10:]
    assert GuessTask("medium", seed=4).heldout_rows() == task.heldout_rows()  # independent of the seed
    row = task.train_row(0)
    assert row["answer"] == str(row["secret"]) and (row["low"], row["high"]) == (1, 100)
    assert resolve_dataset("builtin:guess:hard").high == 1000
    rows = load_prompt_dataset("builtin:guess:easy", split="test", limit=2)
    assert [r["split"] for r in rows] == ["heldout", "heldout"] and rows[0]["high"] == 20
    env = GuessEnv()
    env.reset(rows[0], seed=0)
    assert env.secret == rows[0]["secret"] and env.high == 20
    with pytest.raises(ValueError, match="unknown difficulty"):
        GuessTask("extreme")
    with pytest.raises(ValueError, match="has only"):
        task.heldout_rows(10_000)
