"""Dataset specs: built-in tasks, files through ``resolve_dataset`` and ``load_prompt_dataset``, and
dataset options that choose nothing (file reading: tests/data/test_records.py; the stream over a
file: tests/data/test_prompt_dataset.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policygrad.data.sources import (
    PromptDataset,
    build_train_source,
    check_dataset_options,
    load_prompt_dataset,
    resolve_dataset,
)
from policygrad.data.tasks import ArithmeticTask

pytestmark = pytest.mark.unit

GSM8K_TEST = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dataset_options_that_choose_nothing_are_refused(tmp_path):
    # Before: data.split and data.dataset_config were ignored for a single file without a word.
    from policygrad.config.train import DataConfig

    one = str(_write_jsonl(tmp_path / "one.jsonl", [{"prompt": "a", "answer": "1"}]))
    with pytest.raises(ValueError) as info:
        build_train_source(DataConfig(dataset=one, split="test"), seed=0)
    assert str(info.value) == (
        f"data.split='test' does nothing for the dataset {one!r} (a single file): a split is chosen in a "
        "dataset folder ({split}.jsonl, save_to_disk) or a Hub dataset; drop data.split"
    )
    both = r"data.dataset_config='main' does nothing for the dataset .*\(a single file\) and .*\(a local "
    with pytest.raises(ValueError, match=both + r"folder\): a configuration is chosen in a Hub dataset"):
        check_dataset_options(DataConfig(dataset=one, eval_dataset=str(tmp_path), dataset_config="main"))
    with pytest.raises(ValueError, match=r"data.eval_split='validation' does nothing for the dataset "
                       r"'builtin:arithmetic' \(a built-in dataset\)"):
        check_dataset_options(DataConfig(eval_split="validation"))
    # Where they choose something, or left at their defaults, they pass.
    check_dataset_options(DataConfig(dataset=str(tmp_path), split="test"))  # a folder's test.jsonl
    check_dataset_options(DataConfig(dataset=one, eval_dataset="openai/gsm8k", dataset_config="main"))
    check_dataset_options(DataConfig(dataset=one))


def _rows(n):
    return [{"prompt": f"p{k}", "answer": str(k)} for k in range(n)]


# ----- specs -----------------------------------------------------------------------------------
def test_resolve_dataset(tmp_path):
    task = resolve_dataset("builtin:arithmetic")
    assert isinstance(task, ArithmeticTask) and task.difficulty == "medium"
    assert resolve_dataset("builtin:arithmetic", difficulty="easy", seed=3).operand_range == (0, 9)
    assert resolve_dataset("builtin:arithmetic:hard").operations == ("+", "-", "*")
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(4))
    data = resolve_dataset(path, seed=5)
    assert isinstance(data, PromptDataset) and len(data) == 4 and data.seed == 5
    with pytest.raises(
        ValueError, match="unknown built-in dataset 'builtin:gsm8k'; valid: builtin:arithmetic"
    ):
        resolve_dataset("builtin:gsm8k")


def test_builtin_through_load_prompt_dataset():
    heldout = load_prompt_dataset("builtin:arithmetic", split="test", limit=5)
    assert heldout == ArithmeticTask().heldout_rows(5)
    train = load_prompt_dataset("builtin:arithmetic:easy", split="train", limit=3, seed=2)
    assert train == ArithmeticTask("easy", seed=2).train_rows(3)
    with pytest.raises(ValueError, match="endless train stream; give limit"):
        load_prompt_dataset("builtin:arithmetic")
