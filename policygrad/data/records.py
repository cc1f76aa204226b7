"""Prompt rows from files, folders, the Hugging Face Hub and memory, with the field mapping.

Every reader returns rows as dicts with at least ``"prompt"`` (str, the text the model is asked,
before any chat template) and, when the dataset has answers, ``"answer"`` (str, the reference
final answer). Every other field of the source row is kept as-is, so reward functions can read it
as a row field. The sources a spec may name, and the GSM8K and ``\\boxed{x}`` answer conventions,
are described in :mod:`policygrad.data.sources`, whose
:func:`~policygrad.data.sources.load_prompt_dataset` reads files through :func:`load_file_rows`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from policygrad.data.hub import load_hub_rows, looks_like_hub_id
from policygrad.rewards.verifiers import extract_answer, normalize_number

__all__ = [
    "ANSWER_FIELD_CANDIDATES",
    "GSM8K_INSTRUCTION",
    "PROMPT_FIELD_CANDIDATES",
    "describe_fields",
    "load_file_rows",
    "load_prompt_records",
]

GSM8K_INSTRUCTION = 'Solve it step by step, then give the final answer as a number after "####".'
PROMPT_FIELD_CANDIDATES = ("prompt", "question", "problem", "query", "instruction", "input")
ANSWER_FIELD_CANDIDATES = ("answer", "final_answer", "target", "solution", "output")


def describe_fields(row: Mapping) -> str:
    """The field names of ``row`` for messages (``'prompt', 'answer'``, or ``(none)``)."""
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
            import datasets  # heavy, and only a save_to_disk folder needs it

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
            import datasets  # heavy, and only a parquet or csv file needs it

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
                f"{describe_fields(first)}. "
                f"Set prompt_field to one of them (looked for {', '.join(PROMPT_FIELD_CANDIDATES)})"
            )
    if answer_field is None:
        answer_field = next((f for f in ANSWER_FIELD_CANDIDATES if f in first), None)
        if answer_field is None and require_answer:
            raise ValueError(
                f"{source}: cannot tell which field holds the reference answer; the rows have the fields "
                f"{describe_fields(first)}. Set answer_field to one of them (looked for "
                f"{', '.join(ANSWER_FIELD_CANDIDATES)}), or use reward functions that need no answer"
            )
    return prompt_field, answer_field


def _row_prompt(where: str, row: Mapping, prompt_field: str) -> str:
    if prompt_field not in row or row[prompt_field] is None:
        raise ValueError(
            f"{where} has no field {prompt_field!r}; its fields are {describe_fields(row)}. Fix the row or "
            "set prompt_field"
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
            f"{where} has no field {answer_field!r}; its fields are {describe_fields(row)}. "
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



def load_file_rows(
    spec: str,
    *,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    split: str = "train",
    limit: int | None = None,
    instruction: str | None = None,
    require_answer: bool = True,
    config: str | None = None,
) -> list[dict]:
    """The rows of a file, a folder or a Hub dataset id (``spec``, not a ``builtin:``), mapped as
    :func:`~policygrad.data.sources.load_prompt_dataset` says (which checks ``limit`` first).

    Raises:
        FileNotFoundError, ValueError: as :func:`~policygrad.data.sources.load_prompt_dataset`.
    """
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
    of mappings), with the field mapping of :func:`~policygrad.data.sources.load_prompt_dataset`.

    Raises:
        ValueError: as :func:`~policygrad.data.sources.load_prompt_dataset` (no rows, no
            prompt/answer field, a bad row); ``name`` labels the messages.
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
