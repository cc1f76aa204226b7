"""The built-in rule-based reward functions (answer extraction and matching:
tests/rewards/test_answers.py)."""

from __future__ import annotations

import pytest

from policygrad.rewards.verifiers import (
    answer_correctness,
    answer_format,
    extract_answer,
    length_penalty,
    math_verify_available,
)

pytestmark = pytest.mark.unit

def test_answer_correctness_numeric_path():
    prompts = ["p"] * 7
    completions = [
        "The answer is 1,234.",  # ref 1234 -> 1
        "#### 42\nbut maybe 41",  # ref 42 -> 1 (#### wins)
        "\\boxed{3.50}",  # ref 3.5 -> 1
        "I don't know",  # no number -> 0
        "It is -5",  # ref -5 -> 1
        "12 + 7 = 19",  # ref 19 -> 1
        "12 + 7 = 8",  # ref 19 -> 0
    ]
    answers = ["1234", "42", "3.5", "7", "-5", 19, "19"]
    assert answer_correctness(prompts, completions, answer=answers, use_math_verify=False) == [
        1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0,
    ]  # fmt: skip
    # Default (auto) gives the same here: plain numbers never reach math-verify.
    assert answer_correctness(prompts, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def test_answer_correctness_ignores_other_row_fields():
    assert answer_correctness(["p"], ["5"], answer=["5"], solution=["2+3=5"], index=[0]) == [1.0]


def test_answer_correctness_without_answer_field_names_the_fix():
    with pytest.raises(ValueError, match="row field 'answer'.*answer_field"):
        answer_correctness(["p"], ["5"])
    with pytest.raises(ValueError, match="list of 2 answers"):
        answer_correctness(["p", "q"], ["5", "6"], answer=["5"])
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        answer_correctness(["p", "q"], ["5"], answer=["5"])


@pytest.mark.skipif(not math_verify_available(), reason="math-verify (optional extra) is not installed")
def test_answer_correctness_math_verify_path():
    # \frac{1}{2} is not a plain number for the numeric path ("\frac{1}{2}" parses, but "\sqrt{4}"
    # does not): math-verify decides sqrt(4) == 2.
    assert answer_correctness(["p"], ["\\boxed{\\sqrt{4}}"], answer=["2"], use_math_verify=True) == [1.0]
    assert answer_correctness(["p"], ["\\boxed{\\sqrt{5}}"], answer=["2"], use_math_verify=True) == [0.0]
    assert answer_correctness(["p"], ["\\boxed{\\sqrt{4}}"], answer=["2"], use_math_verify=False) == [0.0]


def test_answer_format():
    completions = [
        "So the total is 42.",  # ends with a number (+ period) -> 1
        "**42**",  # markdown bold -> 1
        "#### 7",  # -> 1
        "\\boxed{x+1} is it, I think",  # boxed -> 1
        "42 apples",  # ends with a word -> 0
        "I am not sure",  # -> 0
        "####  ",  # empty #### -> 0
        "\\boxed{}",  # empty boxed -> 0
        "40",  # -> 1
    ]
    assert answer_format(["p"] * 9, completions) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_length_penalty_by_hand():
    # max_length=10 words, buffer=4: soft limit 6. Lengths 5, 6, 7, 9, 10, 11 ->
    # 0, 0, (6-7)/4=-0.25, (6-9)/4=-0.75, (6-10)/4=-1.0, -1 (over max_length).
    completions = [" ".join(["w"] * n) for n in (5, 6, 7, 9, 10, 11)]
    got = length_penalty(["p"] * 6, completions, max_length=10, buffer=4)
    assert got == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]


def test_length_penalty_chars_default_buffer_and_hard_cut():
    # unit chars, max_length 8 -> default buffer 8 // 4 = 2, soft limit 6.
    # "abcdefg" has 7 chars -> (6-7)/2 = -0.5; "a b" has 3 chars -> 0.
    assert length_penalty(["p", "p"], ["abcdefg", "a b"], max_length=8, unit="chars") == [-0.5, 0.0]
    # buffer=0: a hard cut at max_length.
    assert length_penalty(["p", "p"], ["a b c", "a b"], max_length=2, buffer=0) == [-1.0, 0.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_length": 0}, "max_length must be a positive integer"),
        ({"max_length": 10, "buffer": 11}, "buffer must be an integer in"),
        ({"unit": "tokens"}, "unknown unit 'tokens'; valid units: words, chars"),
    ],
)
def test_length_penalty_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        length_penalty(["p"], ["x"], **kwargs)


# ------------------------------------------------------------------ hostile and non-numeric answers


def _best_time(fn, text: str, repeats: int = 3) -> float:
    import time

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(text)
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize(
    "unit",
    ["\\boxed{", "{\\boxed{", "}\\boxed{", "#### \\boxed{1", "1,", "1 "],
)
def test_answer_extraction_is_linear_time(unit):
    # Ten times the input may take about ten times as long, never a hundred (a quadratic scan:
    # 4,000 repeated "\boxed{" took 6.9 s). The bound leaves room for a busy machine's noise.
    def both(text):
        extract_answer(text)
        answer_format(["p"], [text])
        answer_correctness(["p"], [text], answer=["red"])

    small, large = unit * 2_000, unit * 20_000
    both(small)  # warm the regex caches
    ratio = _best_time(both, large) / max(_best_time(both, small), 1e-4)
    assert ratio < 40, f"{unit!r}: 10x the input took {ratio:.0f}x as long"


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("red", "red", 1.0),
        ("Red.", "red", 1.0),  # case and a closing period
        ("  **RED**  \n", "red", 1.0),  # markdown and whitespace around the final line
        ("I think it is blue.\nred", "red", 1.0),  # the final line decides
        ("red\nor maybe blue", "red", 0.0),  # the final line is not the answer
        ("The answer is red.", "red", 0.0),  # a sentence is not the answer line
        ("reddish", "red", 0.0),  # exact, not a prefix
        ("Paris, France", "paris, france", 1.0),  # inner punctuation kept
        ("", "red", 0.0),
        ("7", "seven", 0.0),
    ],
)
def test_non_numeric_reference_matches_the_final_answer_line(completion, answer, expected):
    assert answer_correctness(["p"], [completion], answer=[answer], use_math_verify=False) == [expected]


def test_numeric_reference_ignores_the_final_line_rule():
    # "5" vs "five": a number is compared exactly as a number, never as text.
    assert answer_correctness(["p"], ["five"], answer=["5"], use_math_verify=False) == [0.0]
    assert answer_correctness(["p"], ["so\n5."], answer=["5"], use_math_verify=False) == [1.0]
