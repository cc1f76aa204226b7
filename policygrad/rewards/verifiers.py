"""Rule-based reward functions for problems with a checkable final answer.

Every reward function here follows one protocol::

    fn(prompts: list[str], completions: list[str], **row_fields: list) -> list[float]

``prompts[i]`` and ``completions[i]`` are the plain texts of row i (the prompt as the dataset gives
it, before any chat template; the completion as decoded, without special tokens). Each row field
(``answer``, ``solution``, ...) is a list aligned with ``prompts``. A function returns one finite
float per row. Options (``max_length`` of :func:`length_penalty`, ...) are keyword arguments that
the caller binds once (see :mod:`policygrad.rewards.registry`); functions ignore row fields they
do not use (``**_``).

Answer extraction and matching (:func:`extract_answer`, :func:`answer_matches`, ...) live in
:mod:`policygrad.rewards.answers` (re-exported here): the reward is the verifier's 0/1 verdict on
the final answer only, never on the reasoning.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from policygrad.rewards.answers import (
    answer_matches,
    boxed_contents,
    extract_answer,
    final_line_matches,
    math_verify_available,
    normalize_number,
    parse_number,
)

__all__ = [
    "answer_correctness",
    "answer_format",
    "answer_matches",
    "extract_answer",
    "final_line_matches",
    "length_penalty",
    "math_verify_available",
    "normalize_number",
    "parse_number",
]


def _check_batch(fn_name: str, prompts, completions) -> int:
    if not isinstance(completions, Sequence) or isinstance(completions, str):
        raise TypeError(f"{fn_name}: completions must be a list of strings, got {type(completions).__name__}")
    if prompts is not None and len(prompts) != len(completions):
        raise ValueError(
            f"{fn_name}: {len(prompts)} prompts but {len(completions)} completions; "
            "pass one completion per prompt"
        )
    return len(completions)


def answer_correctness(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    answer: Sequence | None = None,
    use_math_verify: bool | None = None,
    **_,
) -> list[float]:
    """1.0 when the completion's final answer equals the row's reference answer, else 0.0.

    The completion's answer is :func:`extract_answer` (``#### x``, then ``\\boxed{x}``, then the
    last number); the comparison is :func:`answer_matches` (exact numeric equality; math-verify's
    symbolic check on top when installed). A non-numeric reference (``red``) also matches a
    completion whose final line is that answer (:func:`final_line_matches`: case, surrounding
    whitespace and punctuation ignored). A completion with no answer scores 0.0. This is the
    binary verifier of RL with verifiable rewards (Lambert et al. 2024, Tulu 3, which names RLVR;
    the rule-based accuracy reward of DeepSeek-R1, DeepSeek-AI 2025).

    Args:
        prompts: B prompt strings (unused, part of the protocol).
        completions: B completion strings.
        answer: row field, B reference answers (strings or numbers).
        use_math_verify: see :func:`answer_matches`.

    Returns:
        list of B floats in {0.0, 1.0}.

    Raises:
        ValueError: no ``answer`` row field (the dataset has no answer column: map one with
            ``answer_field``), or its length differs from B.
    """
    n = _check_batch("answer_correctness", prompts, completions)
    if answer is None:
        raise ValueError(
            "answer_correctness needs the row field 'answer' (the reference answer); the dataset "
            "rows have none: set the dataset's answer_field to the column holding the answers"
        )
    if isinstance(answer, str) or len(answer) != n:
        raise ValueError(
            f"answer_correctness: row field 'answer' must be a list of {n} answers, got {answer!r:.80}"
        )
    if use_math_verify is None:
        use_math_verify = math_verify_available()
    matches = (
        answer_matches(extract_answer(c), ref, use_math_verify=use_math_verify) or final_line_matches(c, ref)
        for c, ref in zip(completions, answer)
    )
    return [1.0 if match else 0.0 for match in matches]


# A completion "ends with a number" when its stripped text ends in a number followed by at most a
# closing decoration: a period or "!", markdown bold/italic stars, a closing parenthesis, "$", "%".
_ENDS_WITH_NUMBER = re.compile(r"\d[\s.!*)$%]*\Z")


def answer_format(prompts: Sequence[str], completions: Sequence[str], **_) -> list[float]:
    """1.0 when the completion states a final answer in an accepted form, else 0.0.

    Accepted forms: a ``####`` followed by a non-empty answer on the same line; a non-empty
    ``\\boxed{...}``; or text that ends with a number (optionally followed by ``.``, ``!``,
    ``*``, ``)``, ``$``, ``%`` and whitespace: ``"So the total is 42."`` and ``"**42**"`` pass;
    ``"42 apples"`` does not). Correctness is not checked; use :func:`answer_correctness`.

    Args:
        prompts: B prompt strings (unused).
        completions: B completion strings.

    Returns:
        list of B floats in {0.0, 1.0}.
    """
    _check_batch("answer_format", prompts, completions)
    scores = []
    for text in completions:
        marker = text.rfind("####")
        ok = marker != -1 and bool(text[marker + 4 :].split("\n", 1)[0].strip())
        if not ok:
            boxed = boxed_contents(text)
            ok = boxed is not None and bool(boxed.strip())
        if not ok:
            ok = _ENDS_WITH_NUMBER.search(text.strip()) is not None
        scores.append(1.0 if ok else 0.0)
    return scores


LENGTH_UNITS = ("words", "chars")


def length_penalty(
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    max_length: int = 256,
    buffer: int | None = None,
    unit: str = "words",
    **_,
) -> list[float]:
    """A penalty in [-1, 0] that grows linearly with the length over a budget.

    With L the completion's length in ``unit`` and ``soft = max_length - buffer``::

        penalty = 0                          if L <= soft
                = (soft - L) / buffer        if soft < L <= max_length   (linear, -1 at max_length)
                = -1                         if L > max_length

    This is DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", Eq. 13), measured in words or
    characters of the decoded text instead of tokens, so it needs no tokenizer. ``buffer=0`` is a
    hard cut: -1 above ``max_length``, 0 otherwise. Add it to a correctness reward with a weight.

    Args:
        prompts: B prompt strings (unused).
        completions: B completion strings.
        max_length: the length at which the penalty reaches -1 (``unit``s, > 0).
        buffer: width of the linear ramp below ``max_length``; default ``max_length // 4``.
        unit: ``"words"`` (whitespace-separated pieces, ``len(text.split())``) or ``"chars"``
            (``len(text)``).

    Returns:
        list of B floats in [-1, 0].

    Raises:
        ValueError: ``max_length`` not a positive int, ``buffer`` outside [0, max_length], or an
            unknown ``unit``.
    """
    _check_batch("length_penalty", prompts, completions)
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"length_penalty: max_length must be a positive integer, got {max_length!r}")
    if buffer is None:
        buffer = max_length // 4
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 <= buffer <= max_length:
        raise ValueError(
            f"length_penalty: buffer must be an integer in [0, max_length={max_length}], got {buffer!r}"
        )
    if unit not in LENGTH_UNITS:
        raise ValueError(f"length_penalty: unknown unit {unit!r}; valid units: {', '.join(LENGTH_UNITS)}")
    soft = max_length - buffer
    scores = []
    for text in completions:
        length = len(text.split()) if unit == "words" else len(text)
        if length <= soft:
            scores.append(0.0)
        elif length > max_length:
            scores.append(-1.0)
        else:
            scores.append((soft - length) / buffer)
    return scores
