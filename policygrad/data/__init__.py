"""Prompts: the built-in arithmetic task, datasets from files, chat templates and tokenization.

A dataset object (``ArithmeticTask`` or ``PromptDataset``, from :func:`resolve_dataset`) has
``train_row(i)`` (row ``i`` of a reproducible, resumable train stream), ``train_rows(n, start)``
and ``eval_rows(n)``. Rows are dicts with ``"prompt"`` and ``"answer"`` plus any other fields.
"""

from policygrad.data.chat import format_prompt, format_prompts, tokenize_prompts
from policygrad.data.sources import (
    GSM8K_INSTRUCTION,
    PromptDataset,
    load_prompt_dataset,
    resolve_dataset,
)
from policygrad.data.tasks import DIFFICULTY_LEVELS, ArithmeticLevel, ArithmeticTask

__all__ = [
    "DIFFICULTY_LEVELS",
    "GSM8K_INSTRUCTION",
    "ArithmeticLevel",
    "ArithmeticTask",
    "PromptDataset",
    "format_prompt",
    "format_prompts",
    "load_prompt_dataset",
    "resolve_dataset",
    "tokenize_prompts",
]
