"""Training and evaluation rows from the ``data`` section of the config."""

from __future__ import annotations

import sys
from typing import Any

from policygrad.data.sources import resolve_dataset


def build_train_source(data, *, seed: int):
    """The train stream: an object with ``train_row(i)`` (a pure function of ``i``).

    Raises:
        FileNotFoundError, ValueError: from :func:`policygrad.data.sources.resolve_dataset`, naming
            the field (``data.dataset``, ``data.prompt_field``, ...).
    """
    return resolve_dataset(
        data.dataset,
        difficulty=data.difficulty,
        seed=seed,
        split="train",
        prompt_field=data.prompt_field,
        answer_field=data.answer_field,
        shuffle=data.shuffle,
    )


def build_eval_rows(data, *, seed: int, at_most: bool = False) -> list[dict[str, Any]]:
    """Held-out rows: ``data.eval_dataset`` if set, else the built-in task's held-out split.

    ``data.eval_size`` rows; more than a file holds is an error, unless ``at_most`` (then all of
    them). A file dataset without ``data.eval_dataset`` has no held-out split (evaluating on training
    rows would overstate accuracy), so no evaluation runs and a note says so.
    """
    if not data.eval_size:
        return []
    spec = data.eval_dataset
    if not spec:
        if not str(data.dataset).startswith("builtin:"):
            print(
                f"note: data.dataset={data.dataset!r} has no held-out split; set data.eval_dataset to "
                "evaluate (e.g. the test file of the same dataset)",
                file=sys.stderr,
            )
            return []
        spec = data.dataset
    source = resolve_dataset(
        spec,
        difficulty=data.difficulty,
        seed=seed,
        split="test",
        prompt_field=data.prompt_field,
        answer_field=data.answer_field,
        shuffle=False,
    )
    n = data.eval_size
    if at_most and hasattr(source, "__len__"):
        n = min(n, len(source))  # ``policygrad eval --limit N``: the first N rows, or all of fewer
    return source.eval_rows(n)
