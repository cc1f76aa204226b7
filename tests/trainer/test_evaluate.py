"""Evaluation numbers by hand: pass@k (unbiased, any k <= n) and maj@k over the extracted
answers, on a fake engine whose completions are fixed."""

from __future__ import annotations

import pytest
import torch

from policygrad.rollout.base import Rollout
from policygrad.trainer.config import DataConfig
from policygrad.trainer.evaluate import evaluate, majority_at_k, pass_at_k, write_jsonl
from tests.tiny import make_tiny_tokenizer

pytestmark = pytest.mark.unit


def test_majority_at_k_by_hand():
    answers = ["4", "5", "4", None, "5", "5"]
    correct = [True, False, True, False, False, False]
    # k=1: each sample alone: 2 of 6 right.
    assert majority_at_k(answers, correct, 1) == pytest.approx(2 / 6)
    # k=3: blocks ["4","5","4"] -> 4 (right), [None,"5","5"] -> 5 (wrong).
    assert majority_at_k(answers, correct, 3) == 0.5
    # k=2: ["4","5"] tie -> first seen "4" right; ["4",None] -> "4" right; ["5","5"] wrong.
    assert majority_at_k(answers, correct, 2) == pytest.approx(2 / 3)
    assert majority_at_k([None, None], [False, False], 2) == 0.0
    with pytest.raises(ValueError, match="k=7 must be in 1 .. n=6"):
        majority_at_k(answers, correct, 7)


class FixedEngine:
    """Returns, for each prompt, the next G completions of a fixed list (greedy: the first)."""

    shares_policy_weights = True

    def __init__(self, tokenizer, greedy: list[str], sampled: list[list[str]]):
        self.tokenizer, self.greedy, self.sampled = tokenizer, greedy, sampled
        self.calls = []

    def generate(self, prompt_ids, *, group_size, greedy=False, **_):
        self.calls.append((len(prompt_ids), group_size, greedy))
        texts = self.greedy if greedy else [t for row in self.sampled for t in row]
        ids = [self.tokenizer.encode(t) + [2] for t in texts]
        width = max(map(len, ids))
        response = torch.tensor([i + [0] * (width - len(i)) for i in ids])
        mask = (torch.arange(width)[None] < torch.tensor([len(i) for i in ids])[:, None]).float()
        n = len(texts)
        return Rollout(
            prompt_ids=torch.ones(n, 1, dtype=torch.long),
            prompt_mask=torch.ones(n, 1, dtype=torch.long),
            response_ids=response,
            response_mask=mask,
            sampler_logprobs=torch.zeros(n, width),
            truncated=torch.zeros(n, dtype=torch.bool),
            group_index=torch.arange(n) // group_size,
        )


def test_evaluate_reports_greedy_accuracy_pass_at_k_and_maj_at_k_in_one_call_each():
    tok = make_tiny_tokenizer()
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}]
    sampled = [["#### 2", "#### 3", "#### 3", "#### 2"], ["#### 4", "#### 1", "#### 9", "#### 8"]]
    engine = FixedEngine(tok, ["#### 2", "#### 5"], sampled)
    data = DataConfig(use_chat_template=False)
    metrics, records = evaluate(engine, tok, rows, data=data, max_new_tokens=8, samples=4, ks=[1, 2, 4])
    assert engine.calls == [(2, 1, True), (2, 4, False)]  # every problem in one generate call
    assert metrics["accuracy"] == 0.5
    assert metrics["pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert metrics["pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + pass_at_k(4, 1, 2)) / 2)
    assert metrics["pass@4"] == 1.0
    # maj@4: row 0 ties 2 vs 3 -> "2" seen first, right; row 1: all differ -> "4" first, right.
    assert metrics["maj@4"] == 1.0
    # maj@2: row 0 blocks ["2","3"] -> 2 right, ["3","2"] -> 3 wrong; row 1 ["4","1"] right, ["9","8"] wrong.
    assert metrics["maj@2"] == 0.5
    assert [s["answer"] for s in records[0]["samples"]] == ["2", "3", "3", "2"]
    with pytest.raises(ValueError, match="each k must be in 1 .. --samples 4"):
        evaluate(engine, tok, rows, data=data, max_new_tokens=8, samples=4, ks=[5])


def test_write_jsonl_never_leaves_half_a_file(tmp_path):
    path = tmp_path / "eval.jsonl"
    write_jsonl(str(path), [{"a": 1}])
    with pytest.raises(TypeError):  # the second record cannot be written: the old file stays whole
        write_jsonl(str(path), [{"a": 2}, {"b": object()}])
    assert path.read_text() == '{"a": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.jsonl"]  # no temporary file left
    write_jsonl(str(path), [{"a": 2}, {"b": 3}])
    assert path.read_text() == '{"a": 2}\n{"b": 3}\n'
