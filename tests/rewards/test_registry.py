"""The weighted sum of reward functions with its error policy, and row fields from dataset rows
(loading by name: tests/rewards/test_specs.py; truncation: tests/rewards/test_truncation.py)."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.rewards.registry import (
    CompositeReward,
    RewardFunctionError,
    row_fields_from_rows,
)

pytestmark = pytest.mark.unit


# ----- weighted sum ----------------------------------------------------------------------------
def test_weighted_sum_by_hand():
    # Row 0: correct "40", ends with a number, 1 word -> 1.0*1 + 0.5*1 + 2.0*0 = 1.5
    # Row 1: wrong "41 apples": correctness 0, format 0, 2 words -> 0
    # Row 2: correct, 5 words with max_length=4, buffer=0 -> penalty -1: 1 + 0.5 - 2 = -0.5
    reward = CompositeReward(
        [
            ("answer_correctness", 1.0),
            {"name": "answer_format", "weight": 0.5},
            ("length_penalty", 2.0, {"max_length": 4, "buffer": 0}),
        ]
    )
    prompts = ["What is 20 + 20?"] * 3
    completions = ["40", "41 apples", "it is 20 + 20 = 40"]
    rewards, components, valid = reward(prompts, completions, answer=["40", "40", "40"])
    assert rewards.dtype == torch.float32 and valid.dtype == torch.bool
    assert rewards.tolist() == [1.5, 0.0, -0.5]
    assert valid.tolist() == [True, True, True]
    assert components["answer_correctness"].tolist() == [1.0, 0.0, 1.0]
    assert components["answer_format"].tolist() == [1.0, 0.0, 1.0]
    assert components["length_penalty"].tolist() == [0.0, 0.0, -1.0]
    assert reward.names == ["answer_correctness", "answer_format", "length_penalty"]


def test_accepts_bools_numpy_tensor_and_int_returns():
    import numpy as np

    def as_bools(_prompts, _completions, **_):
        return [True, False]

    def as_tensor(_prompts, _completions, **_):
        return torch.tensor([0.25, 0.5])

    def as_numpy(_prompts, _completions, **_):
        return np.array([1, 2])

    out = CompositeReward([as_bools, as_tensor, (as_numpy, -1.0)])(["a", "b"], ["x", "y"])
    # Row 0: 1 + 0.25 - 1 = 0.25; row 1: 0 + 0.5 - 2 = -1.5
    assert out.rewards.tolist() == [0.25, -1.5]


def test_repeated_function_names_are_distinct():
    reward = CompositeReward(["answer_format", ("answer_format", 2.0)])
    assert reward.names == ["answer_format", "answer_format#2"]
    assert reward(["p"], ["7"]).rewards.tolist() == [3.0]


def _raise_on_bad(_prompts, completions, **_):
    return [1.0 if c != "bad" else 1 / 0 for c in completions]


def test_raise_mode_names_function_and_row():
    reward = CompositeReward([("answer_format", 1.0), (_raise_on_bad, 1.0)], on_error="raise")
    long_prompt = "Q" * 200
    with pytest.raises(RewardFunctionError) as info:
        reward(["ok prompt", long_prompt], ["1", "bad"])
    message = str(info.value)
    assert "'_raise_on_bad'" in message
    assert "row 1" in message
    assert "ZeroDivisionError" in message
    assert repr("Q" * 80) in message  # the prompt's first 80 characters, not more
    assert "Q" * 81 not in message
    assert "on_error='skip'" in message


def test_raise_mode_non_number_return():
    def returns_none(_prompts, _completions, **_):
        return [1.0, None, 0.0]

    with pytest.raises(RewardFunctionError, match=r"'returns_none' returned None .*row 1 \(prompt: 'b'\)"):
        CompositeReward([returns_none])(["a", "b", "c"], ["x", "y", "z"])

    def returns_nan(_prompts, _completions, **_):
        return [float("nan")]

    with pytest.raises(RewardFunctionError, match="not a finite real number.*row 0"):
        CompositeReward([returns_nan])(["a"], ["x"])

    def returns_text(_prompts, _completions, **_):
        return ["1.0"]

    with pytest.raises(RewardFunctionError, match="returned '1.0' \\(str\\)"):
        CompositeReward([returns_text])(["a"], ["x"])


def test_skip_mode_counts_invalid_rows():
    def half_broken(_prompts, completions, **_):
        return [float("inf") if c == "inf" else None if c == "none" else 2.0 for c in completions]

    reward = CompositeReward([("answer_format", 1.0), (half_broken, 0.5)], on_error="skip")
    out = reward(["a", "b", "c", "d"], ["1", "inf", "bad", "none"])
    # Rows 1 (inf) and 3 (None) are invalid.
    # Row 0: 1*1 + 0.5*2 = 2.0; row 2: format 0 + 0.5*2 = 1.0; invalid rows get 0.0.
    assert out.valid.tolist() == [True, False, True, False]
    assert out.rewards.tolist() == [2.0, 0.0, 1.0, 0.0]
    assert math.isnan(out.components["half_broken"][1].item())
    metrics = out.metrics()
    assert metrics["reward/invalid_frac"] == 0.5
    assert metrics["reward_fn/half_broken/invalid"] == 2.0
    assert metrics["reward_fn/half_broken/mean"] == 2.0
    # answer_format succeeded on every row: "1" -> 1, "inf", "bad", "none" -> 0; mean 1/4.
    assert metrics["reward_fn/answer_format/mean"] == 0.25


def test_skip_mode_isolates_the_raising_row():
    out = CompositeReward([_raise_on_bad], on_error="skip")(["a", "b", "c"], ["ok", "bad", "ok"])
    assert out.valid.tolist() == [True, False, True]
    assert out.rewards.tolist() == [1.0, 0.0, 1.0]
    assert out.metrics()["reward/invalid_frac"] == pytest.approx(1 / 3, abs=1e-12)


def test_skip_mode_function_raising_for_whole_batch():
    def always_raises(_prompts, _completions, **_):
        raise RuntimeError("judge unavailable")

    out = CompositeReward(["answer_format", always_raises], on_error="skip")(["a", "b"], ["1", "2"])
    assert out.valid.tolist() == [False, False]
    assert out.rewards.tolist() == [0.0, 0.0]
    assert out.metrics()["reward/invalid_frac"] == 1.0
    with pytest.raises(
        RewardFunctionError, match="'always_raises' raised RuntimeError: judge unavailable.*row 0"
    ):
        CompositeReward([always_raises])(["a", "b"], ["1", "2"])


def test_batch_only_failure_is_reported():
    def fails_on_batches(prompts, _completions, **_):
        if len(prompts) > 1:
            raise ValueError("batch too big")
        return [1.0]

    with pytest.raises(RewardFunctionError, match="on the batch of 2 rows but not on any single row"):
        CompositeReward([fails_on_batches])(["a", "b"], ["1", "2"])
    # In skip mode the row-by-row scores are used.
    out = CompositeReward([fails_on_batches], on_error="skip")(["a", "b"], ["1", "2"])
    assert out.rewards.tolist() == [1.0, 1.0] and out.valid.tolist() == [True, True]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_wrong_length_always_raises(on_error):
    def too_short(_prompts, _completions, **_):
        return [1.0]

    with pytest.raises(RewardFunctionError, match="'too_short' returned 1 scores for 2 completions"):
        CompositeReward([too_short], on_error=on_error)(["a", "b"], ["1", "2"])

    def not_a_list(_prompts, _completions, **_):
        return 1.0

    with pytest.raises(RewardFunctionError, match="returned float"):
        CompositeReward([not_a_list], on_error=on_error)(["a"], ["1"])


def test_row_field_validation():
    reward = CompositeReward(["answer_correctness"])
    with pytest.raises(ValueError, match="row field 'answer' has 1 values for 2 completions.*group_size"):
        reward(["a", "b"], ["1", "2"], answer=["1"])
    with pytest.raises(ValueError, match="row field 'answer' must be a list of 1 values"):
        reward(["a"], ["1"], answer="1")
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        reward(["a", "b"], ["1"])


def test_constructor_errors():
    with pytest.raises(ValueError, match="unknown on_error 'ignore'; valid modes: raise, skip"):
        CompositeReward(["answer_format"], on_error="ignore")
    with pytest.raises(ValueError, match="at least one reward function"):
        CompositeReward([])
    with pytest.raises(ValueError, match="weight must be a finite number"):
        CompositeReward([("answer_format", float("nan"))])
    with pytest.raises(ValueError, match="a mapping needs 'name'"):
        CompositeReward([{"fn": "answer_format"}])


def test_row_fields_from_rows_repeats_per_group():
    rows = [{"prompt": "p0", "answer": "1"}, {"prompt": "p1", "answer": "2", "extra": 5}]
    assert row_fields_from_rows(rows, repeat=2) == {
        "answer": ["1", "1", "2", "2"],
        "extra": [None, None, 5, 5],
    }
    with pytest.raises(ValueError, match="repeat must be a positive integer"):
        row_fields_from_rows(rows, repeat=0)
