"""CalculatorEnv (policygrad.envs.calculator): the calculate tool and the final answer's reward."""

from __future__ import annotations

import time

import pytest

from policygrad.envs.calculator import CalculatorEnv, calculate
from policygrad.envs.registry import environment_factory
from policygrad.sandbox.runner import available_isolation

pytestmark = pytest.mark.integration  # starts sandbox processes

MODE = "auto" if available_isolation() else "none"
ROW = {"prompt": "What is 12 * 7 + 5?", "answer": "89"}


def _call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def test_calculate_by_hand():
    assert calculate("(12 + 7) * 3") == "57"
    assert calculate("7 / 2") == "3.5"
    assert calculate("8 / 2") == "4"
    assert calculate("-2 ** 10 // 3 % 5") == str(-(2**10) // 3 % 5)
    assert calculate("1,000 + 2^3") == "1008"
    for hostile in ("__import__('os').system('id')", "open('/etc/passwd').read()", "(1).__class__", "x + 1"):
        with pytest.raises(ValueError, match="only numbers"):
            calculate(hostile)
    with pytest.raises(ValueError, match="exponent too large"):
        calculate("9**9**9")
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        calculate("1 +")


def test_an_episode_with_the_tool_and_a_correct_answer():
    env = environment_factory("builtin:calculator", {"isolation": MODE})()
    messages = env.reset(ROW, seed=0)
    assert messages[0]["role"] == "system" and "number on the last line" in messages[0]["content"]
    assert "calculate" in messages[0]["content"] and messages[1] == {"role": "user", "content": ROW["prompt"]}
    result = env.step("First the product.\n" + _call("12 * 7 + 5"))
    assert result.observation == [{"role": "tool", "content": "89"}] and not result.done
    final = env.step("So the total is\n89")
    assert final.done and env.final_reward("done") == 1.0


def test_a_wrong_answer_and_no_answer_score_zero():
    env = CalculatorEnv(isolation=MODE)
    env.reset(ROW, seed=0)
    assert env.final_reward("max_turns") == 0.0  # no turn
    env.step("It is 88.")
    assert env.final_reward("done") == 0.0
    env.reset({"prompt": "GSM8K-style", "answer": "1234"}, seed=0)
    env.step("The answer is 1,234.")
    assert env.final_reward("done") == 1.0


def test_hostile_expressions_are_error_messages_not_crashes_or_hangs():
    env = CalculatorEnv(isolation=MODE, tool_timeout_s=10)  # a loaded machine starts slowly
    env.reset(ROW, seed=0)
    start = time.monotonic()
    result = env.step(
        _call("__import__('os').system('touch /tmp/pwned')") + _call("9**9**9") + _call("10**999 * 10**999")
    )
    assert time.monotonic() - start < 60  # each call is refused at once, not timed out
    texts = [m["content"] for m in result.observation]
    assert texts[0].startswith("error: ValueError: only numbers")
    assert texts[1] == "error: ValueError: exponent too large"
    assert texts[2] == "error: ValueError: the result is too large"
    assert result.info == {"tool_calls": 3.0, "tool_errors": 3.0}


def test_rows_need_an_answer():
    with pytest.raises(KeyError, match="answer"):
        CalculatorEnv(isolation=MODE).reset({"prompt": "q"}, seed=0)
