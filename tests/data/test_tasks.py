"""The built-in arithmetic task: difficulty ranges, disjoint splits, a resumable train stream."""

from __future__ import annotations

import itertools

import pytest

from policygrad.data.tasks import DIFFICULTY_LEVELS, ArithmeticTask
from policygrad.rewards.verifiers import answer_correctness

pytestmark = pytest.mark.unit


def _key(row):
    return (row["op"], row["a"], row["b"])


def test_default_is_medium_addition_with_the_documented_prompt():
    task = ArithmeticTask()
    assert task.difficulty == "medium" and task.operations == ("+",) and task.operand_range == (1, 50)
    row = task.train_row(0)
    assert row["prompt"] == f"What is {row['a']} + {row['b']}? Answer with just the number."
    assert row["answer"] == str(row["a"] + row["b"])
    assert row["split"] == "train" and row["index"] == 0
    # The row's own answer passes the answer-correctness verifier.
    assert answer_correctness([row["prompt"]], [row["answer"]], answer=[row["answer"]]) == [1.0]


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTY_LEVELS))
def test_levels_produce_the_documented_ranges(difficulty):
    task = ArithmeticTask(difficulty, seed=1)
    level = DIFFICULTY_LEVELS[difficulty]
    low, high = level.operand_range
    rows = task.train_rows(400) + task.heldout_rows(20)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    for row in rows:
        assert low <= row["a"] <= high and low <= row["b"] <= high
        assert row["op"] in level.operations
        assert row["answer"] == str(ops[row["op"]](row["a"], row["b"]))
    # Every operation of the level shows up in 400 draws (each has probability 1/3 or 1 per draw).
    assert {row["op"] for row in rows} == set(level.operations)
    assert task.space_size == len(level.operations) * (high - low + 1) ** 2


def test_documented_space_sizes():
    # easy: 10*10 = 100; medium: 50*50 = 2,500; hard: 3 * 99*99 = 29,403.
    assert [ArithmeticTask(d).space_size for d in ("easy", "medium", "hard")] == [100, 2500, 29403]


def test_hard_has_negative_differences_and_products():
    rows = ArithmeticTask("hard", seed=0).train_rows(300)
    assert any(r["op"] == "-" and int(r["answer"]) < 0 for r in rows)
    assert any(r["op"] == "*" and r["prompt"].startswith(f"What is {r['a']} * {r['b']}?") for r in rows)


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_train_and_heldout_never_overlap(difficulty):
    heldout = {_key(r) for r in ArithmeticTask(difficulty).heldout_rows()}
    assert heldout
    for seed in (0, 1, 7):
        task = ArithmeticTask(difficulty, seed=seed)
        train = {_key(r) for r in task.train_rows(3000)}
        assert not train & heldout
        # The held-out list is the whole held-out part of the space, decided by the hash rule.
        assert all(task.is_heldout(*k) for k in heldout)
        assert not any(task.is_heldout(*k) for k in train)


def test_easy_space_is_partitioned_exactly():
    # 100 problems; 3000 train draws cover every train problem (a miss has probability
    # (1 - 1/77)^3000 ~ 1e-17 per problem), so train | held-out is the whole space, disjointly.
    task = ArithmeticTask("easy", seed=0)
    heldout = {_key(r) for r in task.heldout_rows()}
    train = {_key(r) for r in task.train_rows(3000)}
    assert train | heldout == {("+", a, b) for a, b in itertools.product(range(10), repeat=2)}
    assert len(train) + len(heldout) == 100
    assert task.heldout_size == len(heldout)


def test_heldout_fraction_is_respected():
    # 2,500 problems at fraction 0.2: 500 expected, binomial std sqrt(2500*0.2*0.8) = 20.
    size = ArithmeticTask("medium").heldout_size
    assert 420 <= size <= 580
    # A larger fraction holds out more problems; the held-out split only grows.
    small = {_key(r) for r in ArithmeticTask("medium", heldout_fraction=0.2).heldout_rows()}
    large = {_key(r) for r in ArithmeticTask("medium", heldout_fraction=0.5).heldout_rows()}
    assert small < large


def test_train_stream_is_a_pure_function_of_seed_and_position():
    a = ArithmeticTask("medium", seed=3)
    b = ArithmeticTask("medium", seed=3)
    first = a.train_rows(60)
    assert first == b.train_rows(60)
    # Resuming at position 40 gives what an uninterrupted stream gives there.
    assert b.train_rows(20, start=40) == first[40:]
    assert [a.train_row(i) for i in (59, 3, 17)] == [first[59], first[3], first[17]]
    assert [r["index"] for r in first] == list(range(60))
    # Another seed gives another stream.
    other = ArithmeticTask("medium", seed=4).train_rows(60)
    assert [_key(r) for r in other] != [_key(r) for r in first]


def test_heldout_is_fixed_and_independent_of_seed():
    rows0 = ArithmeticTask("medium", seed=0).heldout_rows(200)
    rows9 = ArithmeticTask("medium", seed=9).heldout_rows(200)
    assert rows0 == rows9
    assert len({_key(r) for r in rows0}) == 200  # no duplicates
    assert ArithmeticTask("medium").heldout_rows(50) == rows0[:50]  # a prefix of the same list
    assert [r["index"] for r in rows0[:3]] == [0, 1, 2] and rows0[0]["split"] == "heldout"
    assert ArithmeticTask("medium").eval_rows(10) == rows0[:10]


def test_asking_for_more_heldout_rows_than_exist_names_the_fix():
    task = ArithmeticTask("easy")
    size = task.heldout_size
    assert size < 200
    with pytest.raises(
        ValueError, match=f"asked for 200 held-out problems .* has only {size}; ask for at most {size}"
    ):
        task.heldout_rows(200)
    assert len(task.heldout_rows(size)) == size


def test_custom_space_and_negative_operands():
    task = ArithmeticTask("custom", operations=["*"], operand_range=(2, 12))
    assert task.space_size == 121
    assert all(r["op"] == "*" and 2 <= r["a"] <= 12 for r in task.train_rows(50))
    # A negative right operand is written in parentheses; the answer is exact.
    neg = ArithmeticTask("custom", operations=["-"], operand_range=(-3, 3))
    row = neg.make_row("-", 2, -3, split="train", index=0)
    assert row["prompt"] == "What is 2 - (-3)? Answer with just the number." and row["answer"] == "5"
    # A level's operations can be overridden.
    assert ArithmeticTask("easy", operations=["*"]).operations == ("*",)


def test_large_space_samples_heldout_without_enumerating():
    task = ArithmeticTask("custom", operations=["+"], operand_range=(1, 2000))  # 4,000,000 problems
    assert task.heldout_size is None
    rows = task.heldout_rows(100)
    keys = [_key(r) for r in rows]
    assert len(set(keys)) == 100 and all(task.is_heldout(*k) for k in keys)
    other_seed = ArithmeticTask("custom", operations=["+"], operand_range=(1, 2000), seed=5)
    assert other_seed.heldout_rows(100) == rows
    train = {_key(r) for r in task.train_rows(500)}
    assert not train & set(keys) and not any(task.is_heldout(*k) for k in train)
    with pytest.raises(ValueError, match="too large to list; give n"):
        task.heldout_rows()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"difficulty": "extreme"},
            ValueError,
            "unknown difficulty 'extreme'; valid difficulties: easy, medium, hard",
        ),
        ({"difficulty": "custom"}, ValueError, "needs both operations"),
        ({"operations": ["/"]}, ValueError, "operations must be distinct items of"),
        ({"operand_range": (5, 1)}, ValueError, "low <= high"),
        ({"heldout_fraction": 1.0}, ValueError, "heldout_fraction must be in \\(0, 1\\)"),
        ({"template": "What is {a}?"}, ValueError, "template must contain \\{op\\}"),
        ({"seed": 1.5}, TypeError, "seed must be an int"),
        # One problem: the hash puts it in one split and leaves the other empty.
        (
            {"difficulty": "custom", "operations": ["+"], "operand_range": (1, 1)},
            ValueError,
            "split .* empty",
        ),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        ArithmeticTask(**kwargs)


def test_bad_positions():
    task = ArithmeticTask()
    with pytest.raises(ValueError, match="non-negative int"):
        task.train_row(-1)
    with pytest.raises(ValueError, match="start must be a non-negative int"):
        task.train_rows(2, start=-3)
