"""``builtin:guess``: rows of the number-guessing game of :class:`policygrad.envs.guess.GuessEnv`.

Each row is one secret in ``[low, high]``::

    {"prompt": "I am thinking of an integer between 1 and 100. ...", "secret": 42, "low": 1,
     "high": 100, "answer": "42", "split": "train", "index": 0}

As :class:`policygrad.data.tasks.ArithmeticTask`: the train and held-out splits are disjoint by a
hash of the canonical text (``"1..100|42"``), train row ``i`` is a pure function of ``(seed, i)``
(resumable), and the held-out rows are a fixed list per difficulty, independent of the seed.
"""

from __future__ import annotations

import hashlib
import random

__all__ = ["GUESS_LEVELS", "GuessTask", "guess_prompt"]

# difficulty -> (low, high); binary search needs ceil(log2(high - low + 2)) guesses: 5, 7, 10.
GUESS_LEVELS = {"easy": (1, 20), "medium": (1, 100), "hard": (1, 1000)}
_HASH_SALT = "policygrad-guess-split"


def guess_prompt(low: int, high: int) -> str:
    """The game's rules as the user message of the first turn."""
    return (
        f"I am thinking of an integer between {low} and {high} (inclusive). Guess it. Reply with one "
        "integer per turn; I will answer \"Higher.\" if my number is larger, \"Lower.\" if it is smaller, "
        "and stop when you find it. Find it in as few guesses as you can."
    )


def _split_hash(canonical: str) -> float:
    digest = hashlib.sha256(f"{_HASH_SALT}|{canonical}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class GuessTask:
    """Secrets to find, with disjoint train and held-out splits.

    Args:
        difficulty: ``"easy"`` (1..20), ``"medium"`` (1..100, the default) or ``"hard"`` (1..1000).
        seed: seed of the train stream (int).
        heldout_fraction: the share of the secrets in the held-out split, in (0, 1).

    Raises:
        ValueError: an unknown difficulty, ``heldout_fraction`` outside (0, 1) or one that leaves
            a split empty.
        TypeError: a non-integer seed.
    """

    def __init__(self, difficulty: str = "medium", seed: int = 0, *, heldout_fraction: float = 0.2):
        if difficulty not in GUESS_LEVELS:
            valid = ", ".join(GUESS_LEVELS)
            raise ValueError(f"unknown difficulty {difficulty!r}; valid difficulties: {valid}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
        self.difficulty = difficulty
        self.seed = seed
        self.low, self.high = GUESS_LEVELS[difficulty]
        self.heldout_fraction = float(heldout_fraction)
        scored = sorted((_split_hash(self.canonical(k)), k) for k in range(self.low, self.high + 1))
        self._heldout = [k for h, k in scored if h < self.heldout_fraction]
        self._train = sorted(k for h, k in scored if h >= self.heldout_fraction)
        if not self._heldout or not self._train:
            raise ValueError(
                f"heldout_fraction={heldout_fraction} leaves a split of {self.describe()} empty; change it"
            )

    def canonical(self, secret: int) -> str:
        """The text the split hash is computed on: ``"1..100|42"``."""
        return f"{self.low}..{self.high}|{secret}"

    @property
    def space_size(self) -> int:
        """Number of secrets: ``high - low + 1``."""
        return self.high - self.low + 1

    @property
    def heldout_size(self) -> int:
        """Number of held-out secrets."""
        return len(self._heldout)

    def make_row(self, secret: int, *, split: str, index: int) -> dict:
        """The dataset row of one secret (module docstring)."""
        return {"prompt": guess_prompt(self.low, self.high), "secret": secret, "low": self.low,
                "high": self.high, "answer": str(secret), "split": split, "index": index}

    def train_row(self, i: int) -> dict:
        """Train row ``i``: a train secret drawn with a generator seeded by ``(seed, i)``.

        Raises:
            ValueError: ``i`` negative or not an int.
        """
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"train row index must be a non-negative int, got {i!r}")
        rng = random.Random(f"guess-train|{self.seed}|{i}")
        return self.make_row(rng.choice(self._train), split="train", index=i)

    def train_rows(self, n: int, start: int = 0) -> list[dict]:
        """Train rows ``start .. start + n - 1`` (resume a stream at ``start``)."""
        for name, value in (("n", n), ("start", start)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        return [self.train_row(i) for i in range(start, start + n)]

    def heldout_rows(self, n: int | None = None) -> list[dict]:
        """The first ``n`` held-out rows (all when None), the same for every seed.

        Raises:
            ValueError: ``n`` negative or larger than the held-out split (its size is named).
        """
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"n must be a non-negative int or None, got {n!r}")
        if n is not None and n > len(self._heldout):
            raise ValueError(
                f"asked for {n} held-out secrets but difficulty {self.difficulty!r} ({self.describe()}) has "
                f"only {len(self._heldout)}; ask for at most {len(self._heldout)} (eval_size) or choose a "
                "harder difficulty"
            )
        secrets = self._heldout if n is None else self._heldout[:n]
        return [self.make_row(k, split="heldout", index=j) for j, k in enumerate(secrets)]

    def eval_rows(self, n: int | None = None) -> list[dict]:
        """Rows to evaluate on: the held-out split (:meth:`heldout_rows`)."""
        return self.heldout_rows(n)

    def describe(self) -> str:
        """One line: the range and its size."""
        return f"secrets in {self.low}..{self.high}, {self.space_size} of them"

    def __repr__(self) -> str:
        return (f"GuessTask(difficulty={self.difficulty!r}, seed={self.seed}, "
                f"heldout_fraction={self.heldout_fraction})")
