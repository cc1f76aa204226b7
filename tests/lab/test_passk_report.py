"""Tests of the pass@k result: the measurement of a fake engine whose completions are fixed, its
table, and the JSON / PNG / HTML files."""

from __future__ import annotations

import json
import os

import pytest

from policygrad.config.train import DataConfig
from policygrad.lab.passk import measure
from policygrad.lab.passk_report import PassKResult, passk_table, write_outputs
from tests.evaluate.test_evaluation import FixedEngine
from tests.tiny import make_tiny_tokenizer


def _fixed_measure(label, greedy, sampled):
    tok = make_tiny_tokenizer()
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}]
    engine = FixedEngine(tok, greedy, sampled)
    m = measure(
        engine, tok, rows, data=DataConfig(use_chat_template=False), samples=4, ks=[1, 2, 4],
        max_new_tokens=8, label=label, model=f"fake-{label}", engine_name="fake",
    )
    assert engine.calls == [(2, 1, True), (2, 4, False)]  # greedy, then every problem's n samples
    return m, rows


@pytest.mark.unit
def test_measure_and_files_on_a_fake_engine(tmp_path):
    # base: row 0 right in 1 of 4 samples, row 1 in 0 of 4; greedy right on row 0 only.
    base, rows = _fixed_measure(
        "base", ["#### 2", "#### 5"], [["#### 2", "#### 3", "#### 3", "#### 3"], ["#### 1"] * 4]
    )
    # trained: row 0 right in all 4, row 1 in 0; greedy right on row 0.
    trained, _ = _fixed_measure("trained", ["#### 2", "#### 5"], [["#### 2"] * 4, ["#### 9"] * 4])
    assert base.correct == [1, 0] and trained.correct == [4, 0]
    assert base.greedy_correct == [True, False] and base.greedy_accuracy == 0.5
    # base pass@k = mean of (c=1 of 4) and 0: [0.25, 0.5, 1] / 2.
    assert base.pass_at_k == {1: 0.125, 2: 0.25, 4: 0.5}
    assert trained.pass_at_k == {1: 0.5, 2: 0.5, 4: 0.5}
    result = PassKResult(
        models=[base, trained],
        problems=[{"prompt": r["prompt"], "answer": r["answer"]} for r in rows],
        ks=[1, 2, 4],
        settings={"dataset": "fake", "samples": 4, "temperature": 1.0},
    )
    result.table = passk_table(result)
    assert "pass@1" in result.table and "greedy" in result.table
    assert "only base 0, only trained 0" in result.table
    write_outputs(result, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["passk.html", "passk.json", "passk.png"]
    data = json.loads(open(result.json_path).read())
    assert data["ks"] == [1, 2, 4]
    assert data["models"]["base"]["pass_at_k"] == {"1": 0.125, "2": 0.25, "4": 0.5}
    assert data["models"]["trained"]["correct"] == [4, 0]
    assert data["coverage"] == {
        "problems": 2, "solved_by_base": 1, "solved_by_trained": 1, "solved_by_both": 1,
        "only_base": 0, "only_trained": 0,
    }
    assert data["settings"]["samples"] == 4 and data["problems"][1]["prompt"] == "2+2?"
    assert open(result.png_path, "rb").read(4) == b"\x89PNG"
    page = open(result.html_path, encoding="utf-8").read()
    assert page.count('<img src="data:image/png;base64,') == 1
    assert "<td>pass@4</td><td>0.500</td><td>0.500</td><td>+0.000</td>" in page
    assert "<td>1/4</td><td>4/4</td>" in page
