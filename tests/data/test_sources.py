"""Prompt datasets from files: field mapping, GSM8K, folders, errors, and the resumable stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policygrad.data.sources import (
    GSM8K_INSTRUCTION,
    PromptDataset,
    build_train_source,
    check_dataset_options,
    load_prompt_dataset,
    resolve_dataset,
)
from policygrad.data.tasks import ArithmeticTask
from policygrad.rewards.verifiers import answer_correctness

pytestmark = pytest.mark.unit

GSM8K_TEST = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "test.jsonl"


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----- field mapping ---------------------------------------------------------------------------
def test_auto_detected_prompt_and_answer(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 2+2?", "answer": 4, "id": "a"}])
    assert load_prompt_dataset(path) == [{"prompt": "What is 2+2?", "answer": "4", "id": "a"}]


def test_explicit_field_mapping_keeps_other_fields(tmp_path):
    rows = [{"q": "Name a prime.", "target": "7", "level": 1}, {"q": "Half of 5?", "target": 2.5, "level": 2}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    got = load_prompt_dataset(path, prompt_field="q", answer_field="target")
    assert got == [
        {"q": "Name a prime.", "target": "7", "level": 1, "prompt": "Name a prime.", "answer": "7"},
        {"q": "Half of 5?", "target": 2.5, "level": 2, "prompt": "Half of 5?", "answer": "2.5"},
    ]


def test_gsm8k_format_out_of_the_box(tmp_path):
    row = {"question": "Tom has 1000 and 234 more. How many?", "answer": "1000 + 234 = 1234\n#### 1,234"}
    path = _write_jsonl(tmp_path / "gsm.jsonl", [row])
    (got,) = load_prompt_dataset(path)
    assert got["prompt"] == row["question"] + " " + GSM8K_INSTRUCTION
    assert got["answer"] == "1234"  # the number after ####, thousands comma dropped
    assert got["solution"] == row["answer"]
    assert got["question"] == row["question"]
    # The instruction is configurable; "" appends nothing.
    assert load_prompt_dataset(path, instruction="")[0]["prompt"] == row["question"]
    assert load_prompt_dataset(path, instruction="Answer:")[0]["prompt"] == row["question"] + " Answer:"


def test_boxed_answers_are_extracted(tmp_path):
    row = {"problem": "1/2 + 1/4?", "solution": "We get $\\boxed{0.750}$."}
    path = _write_jsonl(tmp_path / "m.jsonl", [row])
    (got,) = load_prompt_dataset(path)
    assert got["prompt"] == "1/2 + 1/4?" and got["answer"] == "0.75"
    assert got["solution"] == "We get $\\boxed{0.750}$."


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason="GSM8K test file not present in ../shared/data")
def test_real_gsm8k_first_rows():
    rows = load_prompt_dataset(GSM8K_TEST, limit=4)
    # The first four GSM8K test answers: Janet's ducks 18, the robe 3, the house flip 70000,
    # James's sprints 540.
    assert [r["answer"] for r in rows] == ["18", "3", "70000", "540"]
    assert rows[0]["prompt"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert rows[0]["prompt"].endswith(GSM8K_INSTRUCTION)
    assert rows[0]["solution"].endswith("#### 18")
    assert answer_correctness(
        [r["prompt"] for r in rows],
        ["She makes 9 * 2 = $18 every day.", "#### 3", "So he made $70,000.", "The answer is 540 meters."],
        answer=[r["answer"] for r in rows],
        use_math_verify=False,
    ) == [1.0, 1.0, 1.0, 1.0]
    every = load_prompt_dataset(GSM8K_TEST)
    assert len(every) == 1319 and all(r["answer"] for r in every)


def test_split_folder_json_list_and_limit(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}])
    _write_jsonl(tmp_path / "test.jsonl", [{"prompt": f"t{k}", "answer": str(k)} for k in range(5)])
    assert [r["prompt"] for r in load_prompt_dataset(tmp_path, split="test", limit=2)] == ["t0", "t1"]
    assert load_prompt_dataset(tmp_path)[0]["prompt"] == "a"  # split defaults to train
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([{"prompt": "x", "answer": "2"}]))
    assert load_prompt_dataset(listed) == [{"prompt": "x", "answer": "2"}]


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


def test_save_to_disk_folder(tmp_path):
    import datasets

    data = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"question": "q1", "answer": "so #### 5"}]),
            "test": datasets.Dataset.from_list([{"question": "q2", "answer": "so #### 6"}]),
        }
    )
    data.save_to_disk(str(tmp_path / "dd"))
    (row,) = load_prompt_dataset(tmp_path / "dd", split="test", instruction="")
    assert row == {"question": "q2", "answer": "6", "prompt": "q2", "solution": "so #### 6"}
    with pytest.raises(ValueError, match=r"holds the splits \['test', 'train'\], not 'validation'"):
        load_prompt_dataset(tmp_path / "dd", split="validation")


# ----- errors ----------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist; give a JSONL file"):
        load_prompt_dataset(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="has no test.jsonl"):
        load_prompt_dataset(tmp_path, split="test")


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="is empty \\(no rows\\)"):
        load_prompt_dataset(path)
    with pytest.raises(ValueError, match="is empty"):
        PromptDataset([])


def test_bad_json_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": \n')
    with pytest.raises(ValueError, match="line 3 is not valid JSON"):
        load_prompt_dataset(path)
    path.write_text('{"prompt": "a", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"row 1 \(line 2\) is a list, not a JSON object"):
        load_prompt_dataset(path)


def test_row_missing_a_field_names_row_and_fields(tmp_path):
    rows = [
        {"question": "a", "answer": "1"},
        {"question": "b", "answer": "2"},
        {"qestion": "c", "answer": "3"},
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"row 2 \(line 3\) has no field 'question'; its fields are 'qestion', 'answer'"
    ):
        load_prompt_dataset(path)
    rows = [{"question": "a", "answer": "1"}, {"question": "b"}]
    path = _write_jsonl(tmp_path / "e.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"row 1 \(line 2\) has no field 'answer'; its fields are 'question'"
    ):
        load_prompt_dataset(path)


def test_undetectable_fields_name_the_setting(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "gold": "1"}])
    with pytest.raises(
        ValueError, match="cannot tell which field holds the prompt.*'text', 'gold'.*prompt_field"
    ):
        load_prompt_dataset(path)
    with pytest.raises(ValueError, match="cannot tell which field holds the reference answer.*answer_field"):
        load_prompt_dataset(path, prompt_field="text")
    # Without an answer requirement the rows load with no "answer" key.
    assert load_prompt_dataset(path, prompt_field="text", require_answer=False) == [
        {"text": "a", "gold": "1", "prompt": "a"}
    ]
    blank = _write_jsonl(tmp_path / "e.jsonl", [{"text": "  "}])
    with pytest.raises(ValueError, match="field 'text' must be a non-empty string"):
        load_prompt_dataset(blank, prompt_field="text", require_answer=False)


def test_bad_limit(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(ValueError, match="limit must be a non-negative int"):
        load_prompt_dataset(path, limit=-1)
    with pytest.raises(ValueError, match="limit=0 leaves"):
        load_prompt_dataset(path, limit=0)


# ----- the stream over a file ------------------------------------------------------------------
def _rows(n):
    return [{"prompt": f"p{k}", "answer": str(k)} for k in range(n)]


def test_prompt_dataset_epochs_are_seeded_permutations():
    data = PromptDataset(_rows(7), seed=1)
    stream = data.train_rows(21)
    epochs = [[r["prompt"] for r in stream[k : k + 7]] for k in (0, 7, 14)]
    for epoch in epochs:
        assert sorted(epoch) == sorted(f"p{k}" for k in range(7))  # each epoch visits every row once
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # shuffled differently per epoch
    assert PromptDataset(_rows(7), seed=1).train_rows(5, start=9) == stream[9:14]  # resume
    assert PromptDataset(_rows(7), seed=2).train_rows(21) != stream
    unshuffled = PromptDataset(_rows(3), shuffle=False).train_rows(7)
    assert [r["prompt"] for r in unshuffled] == ["p0", "p1", "p2", "p0", "p1", "p2", "p0"]


def test_prompt_dataset_rows_are_copies_and_eval_rows():
    data = PromptDataset(_rows(3))
    data.train_row(0)["prompt"] = "changed"
    assert sorted(r["prompt"] for r in data.train_rows(3)) == ["p0", "p1", "p2"]
    assert [r["prompt"] for r in data.eval_rows(2)] == ["p0", "p1"]
    assert len(data.eval_rows()) == 3
    with pytest.raises(ValueError, match="asked for 5 evaluation rows but .* has only 3"):
        data.eval_rows(5)


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
