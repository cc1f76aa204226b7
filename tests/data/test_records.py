"""Prompt rows from files, folders and memory (:mod:`policygrad.data.records`, read through
:func:`~policygrad.data.sources.load_prompt_dataset`): field mapping, GSM8K, folders, and the
errors that name the row, the line or the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policygrad.data.records import GSM8K_INSTRUCTION, describe_fields, load_prompt_records
from policygrad.data.sources import PromptDataset, load_prompt_dataset
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


def test_records_in_memory_are_mapped_as_a_file_is(tmp_path):
    rows = [{"question": "Tom has 1000 and 234 more. How many?", "answer": "1000 + 234 = 1234\n#### 1,234"}]
    assert load_prompt_records(rows) == load_prompt_dataset(_write_jsonl(tmp_path / "gsm.jsonl", rows))
    (got,) = load_prompt_records(rows, instruction="")
    assert got["prompt"] == rows[0]["question"] and got["answer"] == "1234"  # 1,234 without its comma
    with pytest.raises(ValueError, match=r"^dataset memory is empty \(no rows\)"):
        load_prompt_records([], name="memory")
    missing = r"^memory: row 0 \(row 0\) has no field 'text'; its fields are 'q', 'a'\."
    with pytest.raises(ValueError, match=missing):
        load_prompt_records([{"q": "x", "a": "1"}], name="memory", prompt_field="text", answer_field="a")
    assert describe_fields({}) == "(none)"
