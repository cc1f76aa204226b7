"""Tests of policygrad.specs.datasets: which dataset specs name built-in code tasks."""

from __future__ import annotations

import pytest

from policygrad.specs.datasets import is_code_dataset, normalize_dataset_spec

pytestmark = pytest.mark.unit


def test_code_datasets_are_recognised_by_their_spec(tmp_path, monkeypatch):
    assert is_code_dataset("builtin:code") and is_code_dataset("builtin:code:hard")
    assert is_code_dataset("humaneval") and is_code_dataset("builtin:humaneval")
    assert not is_code_dataset("builtin:arithmetic") and not is_code_dataset(None) and not is_code_dataset("")
    assert normalize_dataset_spec("humaneval") == "builtin:humaneval"
    assert normalize_dataset_spec("rows.jsonl") == "rows.jsonl"
    # a file called humaneval is that file, not the built-in problems
    monkeypatch.chdir(tmp_path)
    (tmp_path / "humaneval").write_text("{}\n")
    assert normalize_dataset_spec("humaneval") == "humaneval" and not is_code_dataset("humaneval")
