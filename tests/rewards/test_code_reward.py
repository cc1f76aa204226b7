"""The code_tests reward's pure parts: program extraction, joining to a stub, test specs, the
plain-data codec of the sandbox protocol, and the task reward's dispatch (no sandbox runs here)."""

from __future__ import annotations

import json
import math

import pytest

from policygrad.rewards.code import (
    TaskReward,
    build_program,
    called_names,
    configure_code_rewards,
    extract_program,
    is_code_row,
    spec_for_row,
)
from policygrad.rewards.registry import BUILTIN_REWARDS, load_reward_function
from policygrad.sandbox import wire

pytestmark = pytest.mark.unit

STUB = 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum."""\n'


def test_extract_program_takes_the_last_python_block():
    text = "```python\ndef f():\n    return 1\n```\ntext\n```bash\nls\n```\n"
    text += "```py\ndef f():\n    return 2\n```"
    assert extract_program(text) == "def f():\n    return 2\n"
    assert extract_program("```\nx = 1\n```") == "x = 1\n"  # an untagged fence counts
    assert extract_program("no fence at all") == "no fence at all"
    assert extract_program("```python\ndef f():\n    return 3") == "def f():\n    return 3"  # left open
    assert extract_program("```bash\nls\n```") == "```bash\nls\n```"  # no Python block: the whole text


def test_build_program_joins_a_body_to_the_stub():
    body = "    return sum(xs)\n"
    assert build_program(body, stub=STUB, entry_point="total") == STUB + body


def test_build_program_appends_a_whole_function_after_the_stub():
    full = "def total(xs: List[int]) -> int:\n    return sum(xs)\n"
    joined = build_program(f"```python\n{full}```", stub=STUB, entry_point="total")
    assert joined == STUB.rstrip("\n") + "\n\n\n" + full
    # Without a stub (the asserts form) the program is the extracted code alone.
    assert build_program(f"```python\n{full}```") == full


def test_called_names_never_include_builtins_or_what_tests_bind():
    tests = ["assert add(1, 2) == 3", "xs = make(3)\nassert len(xs) == 3 and sorted(xs) == xs"]
    assert called_names(tests) == ["add", "make"]
    assert called_names(["assert helper(f(1)) == 2"], prelude="def helper(x):\n    return x") == ["f"]
    with pytest.raises(ValueError, match="is not valid Python"):
        called_names(["assert add(1, == 3"])


def test_test_spec_of_humaneval_and_assert_rows():
    check = "def check(candidate):\n    assert candidate([1]) == 1\n"
    spec = spec_for_row(test=check, entry_point="total", stub=STUB)
    assert (spec.names, spec.entry_point, spec.asserts, spec.prelude, spec.total) == (
        ("total",), "total", (), STUB, 1
    )
    spec = spec_for_row(tests=["assert add(1, 2) == 3", "assert add(0, 0) == 0"], entry_point="add")
    assert (spec.names, spec.check, spec.total) == (("add",), None, 2)
    with pytest.raises(ValueError, match="the row has no tests: give 'tests'"):
        spec_for_row(entry_point="add")
    with pytest.raises(ValueError, match="defines check\\(candidate\\) but the row has no 'entry_point'"):
        spec_for_row(test="def check(candidate):\n    pass\n")


def test_is_code_row():
    assert is_code_row({"tests": ["assert f() == 1"]})
    assert is_code_row({"test": "def check(c): pass", "entry_point": "f"})
    assert not is_code_row({"answer": "42"})
    assert not is_code_row({"tests": []})


@pytest.mark.parametrize(
    "value",
    [None, True, 0, -7, 2**100, 1.5, "text", [1, [2, "x"]], (1, (2,)), {"a": 1, 2: (3,)}, {1, 2},
     frozenset({"a"}), b"\x00\xff", 1 + 2j, {(1, 2): [None]}],
)
def test_plain_data_round_trips_exactly(value):
    back = wire.decode(json.loads(json.dumps(wire.encode(value))))
    assert back == value and type(back) is type(value)


def test_nan_crosses_as_nan():
    assert math.isnan(wire.decode(json.loads(json.dumps(wire.encode(float("nan"))))))


class _Rigged:
    def __eq__(self, other):
        return True


class _RiggedInt(int):
    def __eq__(self, other):
        return True


@pytest.mark.parametrize(
    "value", [_Rigged(), _RiggedInt(3), [_Rigged()], {"k": _Rigged()}, (lambda: 1), iter([1])]
)
def test_objects_with_their_own_methods_cannot_cross(value):
    with pytest.raises(TypeError, match="cannot cross the sandbox boundary"):
        wire.encode(value)


@pytest.mark.parametrize(
    "obj", [{"x": 1}, {"__t": "tuple", "v": 3}, {"__t": "eq_all", "v": []}, {"__t": "dict", "v": [[1]]}]
)
def test_decode_accepts_only_the_tagged_forms(obj):
    with pytest.raises(ValueError):
        wire.decode(obj)


def test_code_tests_is_a_builtin_reward():
    assert "code_tests" in BUILTIN_REWARDS
    assert load_reward_function("code_tests") is BUILTIN_REWARDS["code_tests"]


def test_configure_code_rewards_leaves_other_entries_alone():
    specs = ["answer_correctness", "my.module:fn"]
    assert configure_code_rewards(specs, {"isolation": "docker"}) == specs  # no code_tests: nothing built


ROWS_AND_TESTS = [
    ({"tests": ["assert f() == 1"]}, 1),
    ({"tests": "assert f() == 1"}, 1),  # one string: one test
    ({"tests": "   "}, 0),
    ({"tests": []}, 0),
    ({"test": "assert f() == 1"}, 1),  # assert code without HumanEval's check
    ({"test": "def check(candidate):\n    assert candidate() == 1\n", "entry_point": "f"}, 1),
    ({"test": "", "entry_point": "f"}, 0),
    ({"answer": "42"}, 0),
]


@pytest.mark.parametrize(("row", "count"), ROWS_AND_TESTS)
def test_one_rule_decides_a_code_row_for_training_and_evaluation(row, count):
    """is_code_row (evaluation's choice of verifier) says yes exactly when spec_for_row (what
    code_tests trains on) finds tests in the row."""
    fields = {key: row.get(key) for key in ("test", "entry_point", "tests")}
    if count:
        assert spec_for_row(**fields).total == count
    else:
        with pytest.raises(ValueError, match="the row has no tests"):
            spec_for_row(**fields)
    assert is_code_row(row) == bool(count)


def test_task_reward_judges_a_one_string_tests_row_by_its_tests_not_its_answer():
    reward = TaskReward({"isolation": "docker"})
    reward._code = lambda _prompts, completions, **_fields: [0.25] * len(completions)  # the sandbox's verdict
    # answer_correctness would give 1.0: the completion matches the row's answer.
    assert reward(["Write f."], ["4"], tests=["assert f() == 1"], answer=["4"]) == [0.25]


def test_task_reward_scores_answer_rows_without_a_sandbox():
    reward = TaskReward({"isolation": "docker"})  # a sandbox would fail to build: none is built
    assert reward(["What is 2 + 2?", "What is 3 + 3?"], ["4", "7"], answer=["4", "6"]) == [1.0, 0.0]
    assert reward._code is None
