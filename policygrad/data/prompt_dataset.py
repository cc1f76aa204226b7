"""A finite list of prompt rows as a dataset object: a reproducible, resumable training order
(seeded epoch permutations) and the evaluation rows in file order (:class:`PromptDataset`)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping

from policygrad.data.records import describe_fields

__all__ = ["PromptDataset"]


class PromptDataset:
    """A finite list of prompt rows with a reproducible, resumable training order.

    The train stream visits the rows epoch by epoch; epoch ``e`` is a permutation drawn from a
    generator seeded with ``(seed, e)`` (or file order when ``shuffle=False``). Train row ``i`` is
    therefore a pure function of ``(rows, seed, shuffle, i)``: a run resumes at position ``k`` with
    ``train_rows(n, start=k)``. The evaluation rows are the first ``n`` rows in file order.

    Same interface as :class:`policygrad.data.tasks.ArithmeticTask`: ``train_row(i)``,
    ``train_rows(n, start)``, ``eval_rows(n)``.

    Args:
        rows: the rows (dicts with ``"prompt"``), e.g. from :func:`load_prompt_dataset`.
        seed: seed of the epoch permutations.
        shuffle: permute each epoch (True) or keep file order (False).
        name: a label for messages (the source path).

    Raises:
        ValueError: no rows, or a row without a string ``"prompt"``.
    """

    def __init__(
        self, rows: Iterable[Mapping], *, seed: int = 0, shuffle: bool = True, name: str = "dataset"
    ):
        self.rows = [dict(r) for r in rows]
        if not self.rows:
            raise ValueError(f"{name} is empty (no rows); give a dataset with at least one row")
        for k, row in enumerate(self.rows):
            if not isinstance(row.get("prompt"), str):
                fields = describe_fields(row)
                raise ValueError(f"{name}: row {k} has no string 'prompt'; its fields are {fields}")
        self.seed = seed
        self.shuffle = shuffle
        self.name = name
        self._epoch_cache: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"prompt-dataset|{self.seed}|{epoch}").shuffle(order)
        self._epoch_cache = (epoch, order)
        return order

    def train_row(self, i: int) -> dict:
        """Row ``i`` of the endless train stream (a copy, safe to modify).

        Raises:
            ValueError: ``i`` negative or not an int.
        """
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ValueError(f"train row index must be a non-negative int, got {i!r}")
        epoch, k = divmod(i, len(self.rows))
        return dict(self.rows[self._order(epoch)[k]])

    def train_rows(self, n: int, start: int = 0) -> list[dict]:
        """Train rows ``start .. start + n - 1`` of the stream."""
        for label, value in (("n", n), ("start", start)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{label} must be a non-negative int, got {value!r}")
        return [self.train_row(i) for i in range(start, start + n)]

    def eval_rows(self, n: int | None = None) -> list[dict]:
        """The first ``n`` rows in file order (all when ``n`` is None).

        Raises:
            ValueError: ``n`` larger than the dataset (its size is given) or negative.
        """
        if n is None:
            return [dict(r) for r in self.rows]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int or None, got {n!r}")
        if n > len(self.rows):
            raise ValueError(
                f"asked for {n} evaluation rows but {self.name} has only {len(self.rows)}; ask for at most "
                f"{len(self.rows)} (eval_size)"
            )
        return [dict(r) for r in self.rows[:n]]

    def __repr__(self) -> str:
        return (
            f"PromptDataset({self.name!r}, {len(self.rows)} rows, seed={self.seed}, shuffle={self.shuffle})"
        )
