"""The resumable stream over a list of prompt rows (:mod:`policygrad.data.prompt_dataset`):
seeded epoch permutations, copies, and the evaluation rows in file order."""

from __future__ import annotations

import pytest

from policygrad.data.prompt_dataset import PromptDataset

pytestmark = pytest.mark.unit


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
