"""CodeFeedbackEnv (policygrad.envs.code_feedback): visible tests as feedback, hidden ones scored."""

from __future__ import annotations

import pytest

from policygrad.envs.code_feedback import CodeFeedbackEnv, split_tests, visible_count
from policygrad.rewards.code import spec_for_row
from policygrad.sandbox.runner import available_isolation

pytestmark = pytest.mark.integration  # starts sandbox processes

MODE = "auto" if available_isolation() else "none"
TESTS = [
    "assert add(2, 3) == 5",
    "assert add(-1, 1) == 0",
    "assert add(10, 20) == 30",
    "assert add(0, 7) == 7",
]
ROW = {"prompt": "Write add(a, b).", "tests": TESTS, "entry_point": "add"}
CORRECT = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
HUMANEVAL = {
    "prompt": 'def add(a, b):\n    """Return a + b."""\n',
    "test": "def check(candidate):\n    assert candidate(2, 3) == 5, 'add(2, 3) should be 5'\n",
    "entry_point": "add",
}


def test_the_split():
    assert [visible_count(n) for n in (1, 2, 3, 4, 5)] == [1, 1, 1, 2, 2]
    visible, hidden = split_tests(spec_for_row(tests=TESTS, entry_point="add"))
    assert len(visible.asserts) == 2 and hidden.asserts == tuple(TESTS[2:])
    _, hidden = split_tests(spec_for_row(tests=TESTS[:1]))
    assert hidden.asserts == tuple(TESTS[:1])  # one assert: nothing left to hide
    spec = spec_for_row(**{k: HUMANEVAL[k] for k in ("test", "entry_point", "prompt")})
    assert split_tests(spec) == (spec, spec)


def test_a_correct_program_is_done_at_once():
    env = CodeFeedbackEnv(isolation=MODE)
    assert env.reset(ROW, seed=0) == [{"role": "user", "content": "Write add(a, b)."}]
    result = env.step(CORRECT)
    assert result.done and result.info == {"visible_passed": 1.0, "timed_out": 0.0}
    assert env.final_reward("done") == 1.0


def test_a_wrong_program_sees_its_failing_visible_tests():
    env = CodeFeedbackEnv(isolation=MODE, partial_credit=True)
    env.reset(ROW, seed=0)
    result = env.step("```python\ndef add(a, b):\n    return a * b if a > 0 else a + b\n```")
    assert not result.done and result.info["visible_passed"] == 0.5
    text = result.observation[0]["content"]
    assert result.observation[0]["role"] == "user"
    assert text.startswith("Your program fails 1 of 2 tests:\n- assert add(2, 3) == 5\n  AssertionError\n")
    assert "add(-1, 1)" not in text and "add(10, 20)" not in text  # passing and hidden tests stay unshown
    assert env.final_reward("max_turns") == 0.5  # hidden: add(10, 20) fails, add(0, 7) passes
    assert env.step(CORRECT).done and env.final_reward("done") == 1.0  # the last program is scored


def test_all_or_nothing_and_broken_programs():
    env = CodeFeedbackEnv(isolation=MODE)
    env.reset(ROW, seed=0)
    assert env.final_reward("max_turns") == 0.0  # no turn
    result = env.step("def add(a, b) return")
    text = result.observation[0]["content"]
    assert "fails 2 of 2 tests" in text and "SyntaxError" in text and len(text) <= 2000
    assert env.final_reward("max_turns") == 0.0


def test_humaneval_rows_show_the_checks_first_error():
    env = CodeFeedbackEnv(isolation=MODE)
    env.reset(HUMANEVAL, seed=0)
    result = env.step("    return a - b\n")  # a body, joined to the prompt as HumanEval does
    assert result.observation[0]["content"].startswith(
        "Your program fails the tests: AssertionError: add(2, 3) should be 5\n"
    )
    assert env.final_reward("max_turns") == 0.0
    assert env.step("    return a + b\n").done and env.final_reward("done") == 1.0


def test_rows_without_tests_and_bad_options():
    with pytest.raises(ValueError, match="no tests"):
        CodeFeedbackEnv(isolation=MODE).reset({"prompt": "p"}, seed=0)
    with pytest.raises(ValueError, match="max_feedback_chars"):
        CodeFeedbackEnv(isolation=MODE, max_feedback_chars=10)
