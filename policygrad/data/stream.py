"""The resumable stream of training rows."""

from __future__ import annotations

from typing import Any

__all__ = ["PromptStream"]


class PromptStream:
    """A resumable stream of training rows over a source with ``train_row(i)`` (a pure function
    of the position ``i``), so resuming at a saved position gives exactly the rows a straight run
    would have seen.

    Attributes:
        position: the index of the next row; saved in checkpoints and restored on resume.
    """

    def __init__(self, source):
        self.source = source
        self.position = 0

    def take(self, k: int) -> list[dict[str, Any]]:
        """The next ``k`` rows (fresh dicts from the source), advancing ``position`` by ``k``."""
        rows = [self.source.train_row(self.position + j) for j in range(k)]
        self.position += k
        return rows
