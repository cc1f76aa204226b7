"""The built-in task: procedurally generated arithmetic problems with a checkable answer.

``ArithmeticTask`` needs no files and no network. Every problem is ``a <op> b`` with integer
operands; its row is ``{"prompt": "What is 23 + 17? Answer with just the number.",
"answer": "40", ...}``. Two properties make it usable for RL experiments:

* **Disjoint splits.** Each problem belongs to the train or the held-out split by a hash of its
  canonical text (``"23+17"``), not by sampling order, so no train row ever equals a held-out row,
  whatever the seed, the number of rows drawn or the difficulty (the same problem is in the same
  split at every difficulty that contains it).
* **Resumable train stream.** Train row ``i`` is a pure function of ``(seed, i)``: a problem drawn
  uniformly from the train split with a generator seeded by ``(seed, i)``. A run that stopped after
  consuming ``k`` rows resumes with ``train_rows(n, start=k)`` and sees exactly what an
  uninterrupted run would have seen. Draws are with replacement (problems can repeat).

The held-out rows are a fixed list for a given difficulty (sorted by the split hash, so the order
is pseudo-random), independent of ``seed``: runs with different seeds are evaluated on the same
problems.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

__all__ = ["DIFFICULTY_LEVELS", "OPERATIONS", "ArithmeticLevel", "ArithmeticTask"]

OPERATIONS = ("+", "-", "*")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
DEFAULT_TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
# Problem spaces up to this size are enumerated to list the held-out split exactly.
_ENUMERATION_LIMIT = 1_000_000
_HASH_SALT = "policygrad-arithmetic-split"


@dataclass(frozen=True)
class ArithmeticLevel:
    """A difficulty preset: the operations and the inclusive operand range."""

    operations: tuple[str, ...]
    operand_range: tuple[int, int]
    description: str


DIFFICULTY_LEVELS: dict[str, ArithmeticLevel] = {
    # SmolLM2-135M-Instruct, greedy, through its chat template (measured on this project's CPU):
    # single-digit addition ~0.70 correct.
    "easy": ArithmeticLevel(("+",), (0, 9), "a + b with a, b in 0..9 (100 problems)"),
    # Same model: ~0.26 correct before training, ~0.53 after 21 min of GRPO. The default.
    "medium": ArithmeticLevel(("+",), (1, 50), "a + b with a, b in 1..50 (2,500 problems)"),
    "hard": ArithmeticLevel(
        ("+", "-", "*"),
        (1, 99),
        "a + b, a - b or a * b with a, b in 1..99 (29,403 problems; differences can be negative)",
    ),
}


def _split_hash(canonical: str) -> float:
    """A fixed pseudo-random number in [0, 1) for a canonical problem text."""
    digest = hashlib.sha256(f"{_HASH_SALT}|{canonical}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class ArithmeticTask:
    """Seedable arithmetic problems with disjoint train and held-out splits.

    Args:
        difficulty: a name from ``DIFFICULTY_LEVELS``: ``"easy"`` (a + b, a, b in 0..9),
            ``"medium"`` (a + b, a, b in 1..50; the default) or ``"hard"`` (+, - or *, a, b in
            1..99), or ``"custom"`` (then give both ``operations`` and ``operand_range``).
        seed: seed of the train stream (int).
        operations: overrides the level's operations; a subset of ``("+", "-", "*")``.
        operand_range: overrides the level's inclusive operand range ``(low, high)``; negative
            operands are allowed (a negative right operand is written in parentheses).
        heldout_fraction: the share of the problem space in the held-out split, in (0, 1).
        template: the prompt, with ``{a}``, ``{op}`` and ``{b}`` placeholders.

    Raises:
        ValueError: unknown difficulty (the valid names are listed), ``"custom"`` without both
            overrides, an unknown operation, a malformed range, ``heldout_fraction`` outside
            (0, 1), a template without the placeholders, or a split left empty by the hash.
        TypeError: a non-integer seed.
    """

    def __init__(
        self,
        difficulty: str = "medium",
        seed: int = 0,
        *,
        operations: tuple[str, ...] | list[str] | None = None,
        operand_range: tuple[int, int] | list[int] | None = None,
        heldout_fraction: float = 0.2,
        template: str = DEFAULT_TEMPLATE,
    ):
        names = (*DIFFICULTY_LEVELS, "custom")
        if difficulty not in names:
            raise ValueError(f"unknown difficulty {difficulty!r}; valid difficulties: {', '.join(names)}")
        if difficulty == "custom" and (operations is None or operand_range is None):
            raise ValueError(
                "difficulty='custom' needs both operations (e.g. ['+', '*']) and operand_range (e.g. [1, 20])"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        level = DIFFICULTY_LEVELS.get(difficulty)
        ops = tuple(operations) if operations is not None else level.operations
        if not ops or any(op not in OPERATIONS for op in ops) or len(set(ops)) != len(ops):
            raise ValueError(f"operations must be distinct items of {list(OPERATIONS)}, got {list(ops)!r}")
        bounds = tuple(operand_range) if operand_range is not None else level.operand_range
        if (
            len(bounds) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in bounds)
            or bounds[0] > bounds[1]
        ):
            raise ValueError(
                f"operand_range must be two integers (low, high) with low <= high, got {bounds!r}"
            )
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
        for key in ("{a}", "{op}", "{b}"):
            if key not in template:
                raise ValueError(f"template must contain {key} (and {{a}}, {{op}}, {{b}}), got {template!r}")
        self.difficulty = difficulty
        self.seed = seed
        self.operations = ops
        self.operand_range = (int(bounds[0]), int(bounds[1]))
        self.heldout_fraction = float(heldout_fraction)
        self.template = template
        self._width = self.operand_range[1] - self.operand_range[0] + 1
        self._per_op = self._width * self._width
        self._heldout_cache: list[tuple[str, int, int]] | None = None
        if self.space_size <= _ENUMERATION_LIMIT:
            heldout = self._enumerate_heldout()
            if not heldout or len(heldout) == self.space_size:
                raise ValueError(
                    f"heldout_fraction={heldout_fraction} leaves the "
                    f"{'held-out' if not heldout else 'train'} "
                    f"split of this {self.space_size}-problem space empty; change heldout_fraction or "
                    "widen operand_range"
                )

    # ----- the problem space -------------------------------------------------------------------
    @property
    def space_size(self) -> int:
        """Number of distinct problems: ``len(operations) * (high - low + 1) ** 2``."""
        return len(self.operations) * self._per_op

    def _decode(self, index: int) -> tuple[str, int, int]:
        """Problem number ``index`` in [0, space_size) -> (op, a, b)."""
        op_index, rest = divmod(index, self._per_op)
        a_off, b_off = divmod(rest, self._width)
        low = self.operand_range[0]
        return self.operations[op_index], low + a_off, low + b_off

    @staticmethod
    def canonical(op: str, a: int, b: int) -> str:
        """The canonical text of a problem, ``"23+17"``: what the split hash is computed on."""
        return f"{a}{op}{b}"

    def is_heldout(self, op: str, a: int, b: int) -> bool:
        """Whether the problem ``a op b`` is in the held-out split (a fixed hash rule)."""
        return _split_hash(self.canonical(op, a, b)) < self.heldout_fraction

    def _enumerate_heldout(self) -> list[tuple[str, int, int]]:
        if self._heldout_cache is None:
            scored = []
            for index in range(self.space_size):
                op, a, b = self._decode(index)
                h = _split_hash(self.canonical(op, a, b))
                if h < self.heldout_fraction:
                    scored.append((h, op, a, b))
            scored.sort()
            self._heldout_cache = [(op, a, b) for _, op, a, b in scored]
        return self._heldout_cache

    @property
    def heldout_size(self) -> int | None:
        """Number of held-out problems; ``None`` when the space is too large to count
        (more than 1,000,000 problems; the held-out share is then about ``heldout_fraction``)."""
        if self.space_size > _ENUMERATION_LIMIT:
            return None
        return len(self._enumerate_heldout())

    # ----- rows --------------------------------------------------------------------------------
    def make_row(self, op: str, a: int, b: int, *, split: str, index: int) -> dict:
        """The dataset row of problem ``a op b``.

        Returns:
            dict with ``prompt`` (str), ``answer`` (str, the exact integer result), ``a``, ``b``
            (int), ``op`` (str), ``split`` (``"train"`` or ``"heldout"``) and ``index`` (the
            row's position in its split's stream).
        """
        b_text = f"({b})" if b < 0 else str(b)
        prompt = self.template.format(a=a, op=op, b=b_text)
        return {
            "prompt": prompt,
            "answer": str(_APPLY[op](a, b)),
            "a": a,
            "b": b,
            "op": op,
            "split": split,
            "index": index,
        }

    def train_row(self, i: int) -> dict:
        """Train row ``i`` of the stream: a pure function of ``(seed, i)``.

        Raises:
            ValueError: ``i`` negative or not an int.
            RuntimeError: no train problem found in 10,000 draws (only possible for a custom
                space too large to enumerate with a ``heldout_fraction`` close to 1).
        """
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"train row index must be a non-negative int, got {i!r}")
        rng = random.Random(f"arithmetic-train|{self.seed}|{i}")
        for _ in range(10_000):
            op, a, b = self._decode(rng.randrange(self.space_size))
            if not self.is_heldout(op, a, b):
                return self.make_row(op, a, b, split="train", index=i)
        raise RuntimeError(
            f"no train problem found in 10,000 draws; lower heldout_fraction={self.heldout_fraction}"
        )

    def train_rows(self, n: int, start: int = 0) -> list[dict]:
        """Train rows ``start .. start + n - 1`` (resume a stream at ``start``)."""
        _check_count("n", n)
        _check_count("start", start)
        return [self.train_row(i) for i in range(start, start + n)]

    def heldout_rows(self, n: int | None = None) -> list[dict]:
        """The first ``n`` held-out rows (all of them when ``n`` is None): the same list for every
        seed of a given difficulty, operations, operand range and ``heldout_fraction``.

        Raises:
            ValueError: ``n`` larger than the held-out split (the message gives its size and the
                fixes), ``n`` negative, or ``n=None`` for a space too large to enumerate.
        """
        if n is not None:
            _check_count("n", n)
        if self.space_size <= _ENUMERATION_LIMIT:
            problems = self._enumerate_heldout()
            if n is not None and n > len(problems):
                raise ValueError(
                    f"asked for {n} held-out problems but the held-out split of difficulty "
                    f"{self.difficulty!r} ({self.describe()}) has only {len(problems)}; ask for at most "
                    f"{len(problems)} (eval_size), or choose a larger difficulty / operand_range, "
                    "or raise heldout_fraction"
                )
            problems = problems if n is None else problems[:n]
        else:
            if n is None:
                raise ValueError(
                    f"the held-out split of a {self.space_size}-problem space is too large to list; give n"
                )
            problems = self._sample_heldout(n)
        return [self.make_row(op, a, b, split="heldout", index=k) for k, (op, a, b) in enumerate(problems)]

    def _sample_heldout(self, n: int) -> list[tuple[str, int, int]]:
        """Held-out problems of a space too large to enumerate: a fixed pseudo-random draw."""
        rng = random.Random(
            f"arithmetic-heldout|{self.operations}|{self.operand_range}|{self.heldout_fraction}"
        )
        seen: set[tuple[str, int, int]] = set()
        problems: list[tuple[str, int, int]] = []
        attempts = 0
        limit = int(100 * (n + 1) / self.heldout_fraction)
        while len(problems) < n:
            attempts += 1
            if attempts > limit:
                raise ValueError(f"could not draw {n} distinct held-out problems; ask for fewer")
            problem = self._decode(rng.randrange(self.space_size))
            if problem not in seen and self.is_heldout(*problem):
                seen.add(problem)
                problems.append(problem)
        return problems

    def eval_rows(self, n: int | None = None) -> list[dict]:
        """Rows to evaluate on: the held-out split (:meth:`heldout_rows`)."""
        return self.heldout_rows(n)

    def describe(self) -> str:
        """One line: operations, operand range and space size."""
        low, high = self.operand_range
        return f"{' '.join(self.operations)} with operands in {low}..{high}, {self.space_size} problems"

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(difficulty={self.difficulty!r}, seed={self.seed}, operations={self.operations}, "
            f"operand_range={self.operand_range}, heldout_fraction={self.heldout_fraction})"
        )


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
