"""Final answers in text: numbers as written (:func:`parse_number`, :func:`normalize_number`), the
final answer of a completion (:func:`extract_answer`) and whether it equals a reference answer
(:func:`answer_matches`, :func:`final_line_matches`); the reward functions of
:mod:`policygrad.rewards.verifiers` are built on them.

Answer extraction is the rule of verifiable-reward training on math word problems (GSM8K's
``#### x`` convention, Cobbe et al. 2021; the ``\\boxed{x}`` convention of the MATH dataset,
Hendrycks et al. 2021; otherwise the last number of the text): the reward is the verifier's 0/1
verdict on the final answer only, never on the reasoning.
"""

from __future__ import annotations

import math
import re
import string
from fractions import Fraction

__all__ = [
    "answer_matches",
    "boxed_contents",
    "extract_answer",
    "final_line_matches",
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


def boxed_contents(text: str) -> str | None:
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
    boxed = boxed_contents(text)
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
        import math_verify  # noqa: F401 - an optional dependency: only whether it imports
    except ImportError:
        return False
    return True


def _math_verify_equal(reference: str, predicted: str) -> bool:
    """Symbolic equality by math-verify of two extracted answers; ``False`` on any failure."""
    try:
        from math_verify import parse, verify  # an optional dependency (policygrad[math])

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
