"""Rule-based reward functions for problems with a checkable final answer.

Every reward function here follows one protocol::

    fn(prompts: list[str], completions: list[str], **row_fields: list) -> list[float]

``prompts[i]`` and ``completions[i]`` are the plain texts of row i (the prompt as the dataset gives
it, before any chat template; the completion as decoded, without special tokens). Each row field
(``answer``, ``solution``, ...) is a list aligned with ``prompts``. A function returns one finite
float per row. Options (``max_length`` of :func:`length_penalty`, ...) are keyword arguments that
the caller binds once (see :mod:`policygrad.rewards.registry`); functions ignore row fields they
do not use (``**_``).

Answer extraction (:func:`extract_answer`) is the rule of verifiable-reward training on math word
problems (GSM8K's ``#### x`` convention, Cobbe et al. 2021; the ``\\boxed{x}`` convention of the
MATH dataset, Hendrycks et al. 2021; otherwise the last number of the text): the reward is the
verifier's 0/1 verdict on the final answer only, never on the reasoning.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from fractions import Fraction

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

# A number as written in text: optional sign, digits with optional thousands commas ("1,234"),
# an optional decimal part, an optional "/denominator" (a simple fraction). The sign is only taken
# when it does not directly follow a word character or a closing bracket, so "12-7" yields 12 and
# 7 rather than 12 and -7, while "x = -7" yields -7. U+2212 (minus sign) counts as "-".
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])[-+\u2212])?"  # sign
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)?"  # integer part, commas only as thousands separators
    r"(?:\.\d+)?"  # decimal part (".5" is allowed; "5." leaves the period out)
    r"(?:/\d+)?"  # simple fraction
)
_CURRENCY_AND_UNITS = "$%\u20ac\u00a3"  # $ % € £ around a number are dropped by normalisation
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_BOXED = "\\boxed"


def _iter_numbers(text: str):
    """Yield every number substring of ``text`` in order (see ``_NUMBER``)."""
    for match in _NUMBER.finditer(text):
        token = match.group(0)
        if any(ch.isdigit() for ch in token):
            yield token


def parse_number(text: str) -> Fraction | None:
    """Parse one number written as text into an exact ``Fraction``, or ``None`` if it is not one.

    Accepted: optional surrounding whitespace, ``$``/``%``/``€``/``£`` signs, a trailing period;
    a leading ``+`` or ``-`` (also U+2212); thousands commas in groups of three (``1,234``);
    decimals (``3.50``, ``.5``); simple fractions (``3/4``); LaTeX ``\\frac{a}{b}`` with numeric
    ``a`` and ``b``; scientific notation with at most a three-digit exponent (``1e3``). Anything
    else (words, two numbers, ``1,2``) gives ``None``. ``Fraction`` keeps the comparison exact:
    ``3.50`` and ``7/2`` are equal.

    Args:
        text: the candidate string.

    Returns:
        The value as ``fractions.Fraction``, or ``None``.
    """
    if not isinstance(text, str):
        return None
    s = text.strip().strip(_CURRENCY_AND_UNITS).strip()
    if s.endswith("."):
        s = s[:-1]
    s = s.replace("\u2212", "-").replace("\\$", "").replace("\\%", "")
    negative = False
    if s and s[0] in "+-":
        negative, s = s[0] == "-", s[1:].strip(_CURRENCY_AND_UNITS)
    else:
        s = s.strip(_CURRENCY_AND_UNITS)
    frac = _FRAC.match(s)
    if frac is not None:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        if num is None or den is None or den == 0:
            return None
        return -num / den if negative else num / den
    if re.fullmatch(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    # Exponents are capped at three digits so that "1e999999999" cannot build a huge integer.
    if not re.fullmatch(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?(?:/\d+)?", s):
        return None
    try:
        if "/" in s:
            num_text, den_text = s.split("/")
            den = Fraction(den_text)
            if den == 0:
                return None
            value = Fraction(num_text) / den
        else:
            value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return -value if negative else value


def _format_fraction(value: Fraction) -> str:
    """Canonical text of a number: ``"40"``, ``"-3.5"``, ``"1/3"`` (no exponent, no trailing 0)."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    # A finite decimal exactly when the reduced denominator has no prime factor other than 2, 5.
    while den % 2 == 0:
        den //= 2
    while den % 5 == 0:
        den //= 5
    if den == 1:
        sign = "-" if value < 0 else ""
        value = abs(value)
        whole, rest = divmod(value.numerator, value.denominator)
        digits = ""
        while rest:
            rest *= 10
            digit, rest = divmod(rest, value.denominator)
            digits += str(digit)
        return f"{sign}{whole}.{digits}"
    return f"{value.numerator}/{value.denominator}"


def normalize_number(text: str) -> str | None:
    """Canonical text of a number written as ``text``, or ``None`` if ``text`` is not a number.

    ``"1,234"`` -> ``"1234"``; ``"$3.50"`` -> ``"3.5"``; ``"+7"`` -> ``"7"``; ``"40.0"`` ->
    ``"40"``; ``"50%"`` -> ``"50"``; ``"-0"`` -> ``"0"``; ``"2/4"`` -> ``"0.5"``; ``"2/6"`` -> ``"1/3"``;
    ``"\\frac{3}{4}"`` -> ``"0.75"``. See :func:`parse_number` for what is accepted.
    """
    value = parse_number(text)
    return None if value is None else _format_fraction(value)


def _boxed_contents(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` in ``text`` whose braces balance, or ``None``.

    One pass over the text (linear time, whatever the input): every ``{`` is matched to its ``}``
    with a stack, then the last ``\\boxed{`` whose brace closes wins. An unbalanced later
    ``\\boxed{`` falls back to an earlier balanced one."""
    if _BOXED + "{" not in text:
        return None
    closes: dict[int, int] = {}  # index of "{" -> index of its "}"
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closes[stack.pop()] = i
    start = text.rfind(_BOXED + "{")
    while start != -1:
        brace = start + len(_BOXED)
        if brace in closes:
            return text[brace + 1 : closes[brace]]
        start = text.rfind(_BOXED + "{", 0, start)
    return None


def extract_answer(text: str) -> str | None:
    """The final answer stated in a completion, normalised; ``None`` if it states none.

    Rules, first match wins:

    1. ``#### x``: the text after the last ``####`` up to the end of its line. Its first number
       is the answer (``"#### $1,234."`` -> ``"1234"``); with no number there, the stripped text
       itself (``"#### yes"`` -> ``"yes"``); an empty remainder falls through to rule 2.
    2. ``\\boxed{x}``: the contents of the last ``\\boxed{...}`` (nested braces allowed),
       normalised if it is a number (``"\\boxed{3.50}"`` -> ``"3.5"``,
       ``"\\boxed{\\frac{1}{2}}"`` -> ``"0.5"``), else the stripped contents
       (``"\\boxed{x+1}"`` -> ``"x+1"``).
    3. The last number in the text (``"12 + 7 = 19"`` -> ``"19"``; ``"The answer is 1,234."`` ->
       ``"1234"``; ``"It is -5"`` -> ``"-5"``).

    Numbers are normalised by :func:`normalize_number`: thousands commas, ``$``/``%``, a leading
    ``+`` and trailing zeros after the decimal point are dropped; a fraction is written as a
    decimal when it has a finite one (``"3/4"`` -> ``"0.75"``) and reduced otherwise.

    Args:
        text: a completion (or a reference answer).

    Returns:
        The normalised answer string, or ``None`` when the text holds no ``####`` answer, no
        ``\\boxed{}`` and no number.

    Raises:
        TypeError: ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"extract_answer expects a string, got {type(text).__name__}")
    marker = text.rfind("####")
    if marker != -1:
        rest = text[marker + 4 :].split("\n", 1)[0].strip()
        if rest:
            for token in _iter_numbers(rest):
                normalised = normalize_number(token)
                if normalised is not None:
                    return normalised
            return rest
    boxed = _boxed_contents(text)
    if boxed is not None and boxed.strip():
        normalised = normalize_number(boxed)
        return normalised if normalised is not None else boxed.strip()
    last = None
    for token in _iter_numbers(text):
        normalised = normalize_number(token)
        if normalised is not None:
            last = normalised
    return last


def _reference_answer(reference) -> str | None:
    """Normalised reference answer: the whole string if it is a number, else extracted."""
    if reference is None:
        return None
    if isinstance(reference, bool):
        reference = str(reference).lower()
    if isinstance(reference, (int, float)):
        if isinstance(reference, float) and not math.isfinite(reference):
            return None
        reference = repr(reference)
    reference = str(reference)
    whole = normalize_number(reference)
    if whole is not None:
        return whole
    extracted = extract_answer(reference)
    if extracted is not None:
        return extracted
    stripped = reference.strip()
    return stripped or None


def _plain_text(answer: str) -> str:
    """Loose form of a non-numeric answer for string comparison."""
    return answer.strip().strip("$").rstrip(".").strip().lower()


# What surrounds a final answer line without being part of it: whitespace and punctuation
# (markdown stars, quotes, a closing period, brackets).
_SURROUNDING = string.whitespace + string.punctuation


def _final_line(text: str) -> str:
    """The last non-empty line of ``text``, lower-cased, without surrounding whitespace and
    punctuation (``"**Red.**"`` -> ``"red"``); ``""`` when there is none."""
    for line in reversed(text.splitlines()):
        line = line.strip(_SURROUNDING)
        if line:
            return line.casefold()
    return ""


def final_line_matches(completion: str, reference) -> bool:
    """Whether the last non-empty line of ``completion`` is a non-numeric reference answer.

    Both sides are compared after normalisation: case, surrounding whitespace and punctuation
    (``"Red."``, ``"**red**"`` and ``" RED "`` all match ``"red"``). A numeric reference never
    matches here (numbers are compared exactly by :func:`answer_matches`), nor does an empty one.

    Args:
        completion: a completion string.
        reference: the row's reference answer (string or number).
    """
    ref = _reference_answer(reference)
    if ref is None or parse_number(ref) is not None:
        return False
    wanted = ref.strip(_SURROUNDING).casefold()
    return bool(wanted) and _final_line(completion) == wanted


def math_verify_available() -> bool:
    """Whether the optional ``math-verify`` package imports (``pip install policygrad[math]``)."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def _math_verify_equal(reference: str, predicted: str) -> bool:
    """Symbolic equality by math-verify of two extracted answers; ``False`` on any failure."""
    try:
        from math_verify import parse, verify

        gold = parse(f"${reference}$")
        pred = parse(f"${predicted}$")
        if not gold or not pred:
            return False
        return bool(verify(gold, pred))
    except Exception:  # noqa: BLE001 - math-verify raises many kinds on odd input; treat as "no"
        return False


def answer_matches(predicted: str | None, reference, *, use_math_verify: bool | None = None) -> bool:
    """Whether an extracted answer equals a reference answer.

    Both numbers (:func:`parse_number`): exact numeric equality decides (``"3.5"`` == ``"7/2"``
    == ``"3.50"``; ``"0.333"`` != ``"1/3"``). Otherwise the loose strings are compared
    (case-insensitive, outer ``$`` and a final period dropped); when they differ and math-verify
    is used (see ``use_math_verify``), ``math_verify.verify`` judges symbolic equality of the two
    strings as LaTeX
    (``"\\frac{1}{2}"`` vs ``"1/2"``, ``"\\sqrt{4}"`` vs ``"2"``).

    Args:
        predicted: the completion's extracted answer (``None`` never matches).
        reference: the reference answer; a whole-number string, a number, or text from which
            :func:`extract_answer` takes the answer (``"... #### 42"``).
        use_math_verify: ``None`` uses math-verify when it is installed; ``True`` requires it;
            ``False`` never uses it.

    Raises:
        ImportError: ``use_math_verify=True`` and math-verify is not installed.
    """
    if use_math_verify is None:
        use_math_verify = math_verify_available()
    elif use_math_verify and not math_verify_available():
        raise ImportError(
            "use_math_verify=True but the math-verify package is not installed; "
            "pip install 'policygrad[math]' or set use_math_verify=None/False"
        )
    if predicted is None:
        return False
    ref = _reference_answer(reference)
    if ref is None:
        return False
    pred_value, ref_value = parse_number(predicted), parse_number(ref)
    if pred_value is not None and ref_value is not None:
        return pred_value == ref_value
    if _plain_text(predicted) == _plain_text(ref):
        return True
    return bool(use_math_verify) and _math_verify_equal(ref, predicted)


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
            boxed = _boxed_contents(text)
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
