"""Prompt datasets from the Hugging Face Hub: ``data.dataset: openai/gsm8k`` with
``data.dataset_config: main`` and a split, through ``datasets.load_dataset``.

Offline (``HF_DATASETS_OFFLINE=1`` or ``HF_HUB_OFFLINE=1``) the dataset comes from the local
``datasets`` cache (``HF_DATASETS_CACHE``, default ``~/.cache/huggingface/datasets``), where an
earlier online load left it; online, a failed download also falls back to that cache. When
neither works the error says which and how to fix it. The rows then go through the same field
mapping as a local file (:func:`policygrad.data.sources.load_prompt_dataset`), so GSM8K's Hub
rows (``question``, ``answer`` ending in ``#### 42``) map exactly as its JSONL does.
"""

from __future__ import annotations

import os
import re

__all__ = ["hub_offline", "load_hub_rows", "looks_like_hub_id"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".arrow")
_TRUE = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """True when ``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` is set to 1/true/yes/on."""
    names = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in names)


def looks_like_hub_id(spec: str) -> bool:
    """True for ``name`` or ``owner/name`` that is not an existing path and has no file suffix."""
    spec = spec.strip()
    if not spec or os.path.exists(os.path.expanduser(spec)) or spec.startswith(("/", ".", "~")):
        return False
    return bool(_HUB_ID.match(spec)) and not spec.lower().endswith(_FILE_SUFFIXES)


def load_hub_rows(dataset_id: str, *, config: str | None = None, split: str = "train") -> list[dict]:
    """The rows of one split of a Hub dataset, as dicts.

    Args:
        dataset_id: ``owner/name`` (or ``name``) on the Hugging Face Hub.
        config: the dataset's configuration (``main`` for ``openai/gsm8k``), or None.
        split: ``train``, ``test``, ...

    Raises:
        ValueError: one line naming ``data.dataset`` and the fix: the dataset is neither
            reachable nor cached (offline mode named when it is on), an unknown config or split
            (the available ones listed), or the ``datasets`` library is missing.
    """
    try:
        import datasets  # heavy, and only a Hub dataset needs it
    except ImportError:  # pragma: no cover - a dependency
        raise ValueError(f"data.dataset={dataset_id!r} is a Hub id but `datasets` is not installed") from None
    where = f"data.dataset={dataset_id!r}" + (f" (config {config!r})" if config else "")
    try:
        cache = os.environ.get("HF_DATASETS_CACHE")  # read now: datasets reads it once, on import
        data = datasets.load_dataset(dataset_id, config, split=split, cache_dir=cache)
    except ValueError as e:  # unknown config or split: datasets lists the valid ones
        text = " ".join(str(e).split())
        raise ValueError(f"{where}, split {split!r}: {text}; set data.dataset_config / data.split") from None
    except Exception as e:  # noqa: BLE001 - ConnectionError, DatasetNotFoundError, FileNotFoundError...
        text = " ".join(str(e).split())[:200] or type(e).__name__
        if hub_offline():
            fix = (
                "hub access is off (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE) and the local datasets cache has no "
                "copy; load it once online, or give a local file (JSONL, JSON, Parquet, CSV)"
            )
        else:
            fix = "it is no local path, the Hub could not be reached or has no such dataset, and no cached "
            fix += "copy exists; check the id, or give a local file (JSONL, JSON, Parquet, CSV)"
        raise ValueError(f"{where} cannot be loaded ({type(e).__name__}: {text}): {fix}") from None
    return [dict(row) for row in data]
