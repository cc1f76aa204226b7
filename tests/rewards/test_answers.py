"""Answers in text (:mod:`policygrad.rewards.answers`): numbers as written, the final answer of a
completion, and its match with a reference answer."""

from __future__ import annotations

from fractions import Fraction

import pytest

from policygrad.rewards.answers import (
    answer_matches,
    extract_answer,
    math_verify_available,
    normalize_number,
    parse_number,
)

pytestmark = pytest.mark.unit



@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 1,234.", "1234"),  # thousands comma dropped, sentence period not a decimal
        ("#### 42\nLater I also mention 7 and 99.", "42"),  # #### wins over later numbers
        ("so 5 + 5 = 10\n#### 10", "10"),
        ("\\boxed{3.50}", "3.5"),  # trailing zero dropped
        ("We get \\boxed{\\frac{1}{2}} here, then 7", "0.5"),  # boxed wins over a later number
        ("It is -5", "-5"),  # negative number
        ("x = \u22123", "-3"),  # U+2212 minus sign
        ("12 + 7 = 19", "19"),  # last number
        ("12-7=5", "5"),  # "-7" after a digit is subtraction, not a negative number
        ("The cost is $1,450,000.00 total", "1450000"),
        ("about 50% of them", "50"),
        ("+8 degrees", "8"),
        ("3/4 of the cake", "0.75"),  # a fraction with a finite decimal is written as one
        ("6/8", "0.75"),
        ("2/6", "1/3"),  # otherwise it is reduced
        ("#### $2,125", "2125"),
        ("#### yes", "yes"),  # non-numeric #### answer kept as text
        ("\\boxed{x+1}", "x+1"),  # non-numeric boxed answer kept as text
        ("\\boxed{\\text{{a}}}", "\\text{{a}}"),  # nested braces are balanced
        ("no digits here", None),
        ("", None),
        ("####   \n the result is 3", "3"),  # empty #### remainder falls through to the last number
        ("1,2345", "2345"),  # a comma not in groups of three separates two numbers
        ("v2 of the model gives 0.25", "0.25"),
        (".5 of it", "0.5"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_rejects_non_string():
    with pytest.raises(TypeError, match="expects a string"):
        extract_answer(42)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40.0", "40"),
        ("-0", "0"),
        ("$3.50", "3.5"),
        ("+7", "7"),
        ("1,234", "1234"),
        ("2/4", "0.5"),
        ("1/3", "1/3"),  # not a finite decimal: kept as a fraction
        ("\\frac{3}{4}", "0.75"),
        ("1e3", "1000"),
        ("-12.5", "-12.5"),
        ("1,2", None),
        ("twelve", None),
        ("1 2", None),  # two numbers, not one
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_parse_number_is_exact():
    # 3.50 = 350/100 = 7/2 exactly; 0.1 + 0.2 == 0.3 holds for Fractions (it fails for floats).
    assert parse_number("3.50") == Fraction(7, 2)
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3")
    assert parse_number("1/0") is None
    assert parse_number(None) is None
    assert parse_number("") is None and parse_number("-") is None
    assert parse_number("-$5") == -5 and parse_number("-\\frac{1}{4}") == Fraction(-1, 4)
    assert parse_number("1e999999999") is None  # refused, not computed
    assert extract_answer("\\boxed{1e999999999}") == "1e999999999"  # kept as text, not a number


def test_answer_matches_numeric_and_text():
    assert answer_matches("3.5", "3.50")
    assert answer_matches("3.5", "7/2")
    assert answer_matches("1234", "1,234")
    assert answer_matches("18", "Janet makes 9 * 2 = $18\n#### 18")  # reference with a worked solution
    assert answer_matches("40", 40)  # an int reference from JSON
    assert answer_matches("2.5", 2.5)
    assert not answer_matches("0.333", "1/3", use_math_verify=False)  # exact, no tolerance
    assert not answer_matches(None, "3")
    assert answer_matches("Yes", "yes.")  # loose text comparison
    assert not answer_matches("5", "-5")


def test_answer_matches_requires_math_verify_when_asked():
    if math_verify_available():
        pytest.skip("math-verify is installed here")
    with pytest.raises(ImportError, match="math-verify"):
        answer_matches("1", "1", use_math_verify=True)



def test_unbalanced_boxed_falls_back_to_an_earlier_balanced_one():
    assert extract_answer("\\boxed{1} then \\boxed{2") == "1"
    assert extract_answer("a } b \\boxed{3}") == "3"
    assert extract_answer("\\boxed{x{y}") is None  # never closed: no boxed answer, no number
