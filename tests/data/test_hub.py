"""``data.dataset`` as a Hugging Face Hub id: loaded with ``datasets.load_dataset`` from a local
``datasets`` cache while hub access is off, with GSM8K's field mapping; a clear one-line error
when the dataset is neither reachable nor cached."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from policygrad.config.train import DataConfig
from policygrad.data.hub import load_hub_rows, looks_like_hub_id
from policygrad.data.sources import build_eval_rows, build_train_source, load_prompt_dataset

pytestmark = pytest.mark.unit

ROWS = {
    "train": [{"question": f"Tom has {i} apples and buys 2. How many?", "answer": f"{i} + 2\n#### {i + 2}"}
              for i in range(3)],
    "test": [{"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"}],
}


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """A local ``datasets`` cache holding ``openai/gsm8k`` (config ``main``, splits train and test)
    as an earlier online ``load_dataset`` leaves it, with hub access off."""
    import datasets
    from datasets.packaged_modules.json.json import Json

    source = tmp_path / "src"
    source.mkdir()
    for split, rows in ROWS.items():
        (source / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    builder = Json(
        cache_dir=str(tmp_path / "build"),
        dataset_name="gsm8k",
        config_name="main",
        data_files={split: str(source / f"{split}.jsonl") for split in ROWS},
    )
    builder.download_and_prepare()
    cache = tmp_path / "datasets-cache"
    shutil.copytree(builder.cache_dir, cache / "openai___gsm8k" / "main" / "0.0.0" / "0123456789abcdef")
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    # datasets reads these variables once, on import: set its copies too.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def test_a_hub_id_loads_offline_from_the_local_cache_with_gsm8k_mapping(offline_cache):
    rows = load_prompt_dataset("openai/gsm8k", config="main", split="test")
    assert len(rows) == 1
    assert rows[0]["prompt"].startswith("What is 6 times 7?") and "####" in rows[0]["prompt"]
    assert rows[0]["answer"] == "42" and rows[0]["solution"] == "6 * 7 = 42\n#### 42"
    # The JSONL of the same rows maps identically.
    jsonl = load_prompt_dataset(os.fspath(offline_cache.parent / "src" / "test.jsonl"))
    assert [{k: r[k] for k in ("prompt", "answer", "solution")} for r in jsonl] == [
        {k: r[k] for k in ("prompt", "answer", "solution")} for r in rows
    ]
    # Through a run's data section: training split, and the Hub dataset's eval_split held out.
    data = DataConfig(dataset="openai/gsm8k", dataset_config="main", eval_size=1)
    source = build_train_source(data, seed=0)
    assert len(source) == 3 and source.train_row(0)["answer"] in {"2", "3", "4"}
    assert [r["answer"] for r in build_eval_rows(data, seed=0)] == ["42"]


@pytest.mark.usefixtures("offline_cache")
def test_hub_errors_are_one_line_and_name_the_field():
    with pytest.raises(ValueError) as err:
        load_hub_rows("someone/not-cached", split="train")
    text = str(err.value)
    assert "data.dataset='someone/not-cached'" in text and "hub access is off" in text and "\n" not in text
    with pytest.raises(ValueError, match=r"split 'validation'.*set data.dataset_config / data.split"):
        load_hub_rows("openai/gsm8k", config="main", split="validation")


def test_what_counts_as_a_hub_id(tmp_path):
    assert looks_like_hub_id("openai/gsm8k") and looks_like_hub_id("gsm8k")
    assert not looks_like_hub_id("data/train.jsonl") and not looks_like_hub_id("./gsm8k")
    assert not looks_like_hub_id("a/b/c") and not looks_like_hub_id(str(tmp_path))
