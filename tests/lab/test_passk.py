"""Tests of ``policygrad lab passk``: the unbiased pass@k worked by hand, the k ladder, the JSON /
PNG / HTML files from a fake engine whose completions are fixed, an end-to-end run of the CLI on
the tiny model (hf engine), and one ``error:`` line per bad flag with nothing written."""

from __future__ import annotations

import json
import math
import os

import pytest

from policygrad.cli import main
from policygrad.config.train import DataConfig
from policygrad.lab.passk import (
    ModelPassK,
    PassKResult,
    k_ladder,
    measure,
    parse_ks,
    pass_at_k_curve,
    passk_table,
    write_outputs,
)
from tests.evaluate.test_evaluation import FixedEngine
from tests.tiny import make_tiny_tokenizer


@pytest.mark.unit
def test_pass_at_k_by_hand():
    # n = 4 samples, c = 1 correct: pass@k = 1 - C(n-c, k) / C(n, k)
    #   k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4 = 0.25
    #   k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    #   k=4: C(3,4) = 0 (fewer wrong samples than k): 1
    assert pass_at_k_curve([1], 4, [1, 2, 4]) == {1: 0.25, 2: 0.5, 4: 1.0}
    # c = 2 of 4: k=1: 1 - 2/4 = 0.5; k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6; k=4: 1.
    # The mean with a problem never solved (c = 0: pass@k = 0 for every k) halves each value.
    curve = pass_at_k_curve([2, 0], 4, [1, 2, 4])
    assert curve[1] == pytest.approx(0.25)
    assert curve[2] == pytest.approx(5 / 12)
    assert curve[4] == pytest.approx(0.5)
    # n = 6, c = 1, k = 3: 1 - C(5,3)/C(6,3) = 1 - 10/20 = 0.5 (= k/n when c = 1).
    assert pass_at_k_curve([1], 6, [3]) == {3: pytest.approx(0.5)}
    assert pass_at_k_curve([], 4, [1]) == {1: 0.0}
    with pytest.raises(ValueError, match="k=5 must be <= n=4"):
        pass_at_k_curve([1], 4, [5])
    with pytest.raises(ValueError, match=r"c=5 must be in \[0, n=4\]"):
        pass_at_k_curve([5], 4, [1])


@pytest.mark.unit
def test_k_ladder_is_powers_of_two_and_n():
    assert k_ladder(1) == [1]
    assert k_ladder(2) == [1, 2]
    assert k_ladder(32) == [1, 2, 4, 8, 16, 32]
    assert k_ladder(6) == [1, 2, 4, 6]  # n not a power of two: n itself ends the ladder
    assert k_ladder(33) == [1, 2, 4, 8, 16, 32, 33]
    with pytest.raises(ValueError, match="--samples must be an integer >= 1, got 0"):
        k_ladder(0)


@pytest.mark.unit
def test_parse_ks():
    assert parse_ks(None, 6) == [1, 2, 4, 6]
    assert parse_ks("4, 1,4", 6) == [1, 4]
    with pytest.raises(ValueError, match=r"--k 1,8: each k must be in 1 \.\. --samples 4 .* drop 8"):
        parse_ks("1,8", 4)
    with pytest.raises(ValueError, match="must be comma-separated integers"):
        parse_ks("1,two", 4)
    with pytest.raises(ValueError, match="--k ',' names no k"):
        parse_ks(",", 4)


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


@pytest.mark.integration
def test_cli_end_to_end_on_the_tiny_model(tiny_lm_dir, tmp_path, capsys):
    out = tmp_path / "passk"
    argv = [
        "lab", "passk", "--base", tiny_lm_dir, "--trained", tiny_lm_dir, "--engine", "hf", "--limit", "3",
        "--samples", "3", "--max-new-tokens", "4", "--out", str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "pass@1" in printed and "pass@2" in printed and "pass@3" in printed
    data = json.loads((out / "passk.json").read_text())
    assert data["ks"] == [1, 2, 3]
    assert data["settings"]["problems"] == 3 and data["settings"]["dataset"] == "builtin:arithmetic"
    for label in ("base", "trained"):
        model = data["models"][label]
        assert model["engine"] == "hf" and len(model["correct"]) == 3
        assert all(0 <= c <= 3 for c in model["correct"])
        assert all(0.0 <= v <= 1.0 for v in model["pass_at_k"].values())
    # The same model with the same seed draws the same samples: the two curves agree.
    assert data["models"]["base"]["correct"] == data["models"]["trained"]["correct"]
    assert math.isclose(data["models"]["base"]["pass_at_k"]["3"], data["models"]["trained"]["pass_at_k"]["3"])
    assert (out / "passk.png").exists() and (out / "passk.html").exists()


def _fails(argv, capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    # transformers' loading bars may come first on stderr; the error is one line
    lines = [line for line in captured.err.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and captured.err.endswith(lines[0] + "\n"), captured.err
    return lines[0]


@pytest.mark.integration
def test_cli_errors_are_one_line_and_write_nothing(tiny_lm_dir, tmp_path, capsys):
    out = tmp_path / "never"
    common = ["lab", "passk", "--out", str(out)]
    models = ["--base", tiny_lm_dir, "--trained", tiny_lm_dir]
    missing = str(tmp_path / "no_such_model")
    line = _fails([*common, "--base", tiny_lm_dir, "--trained", missing], capsys)
    assert line.startswith(f"error: --trained {missing}: the folder ") and "does not exist" in line
    line = _fails([*common, "--base", str(tmp_path), "--trained", tiny_lm_dir], capsys)
    assert line.startswith(f"error: --base {tmp_path}: ") and "no config.json" in line
    assert _fails([*common, *models, "--samples", "0"], capsys) == "error: --samples must be >= 1, got 0"
    assert _fails([*common, *models, "--limit", "0"], capsys) == "error: --limit must be >= 1, got 0"
    line = _fails([*common, *models, "--samples", "4", "--k", "1,8"], capsys)
    assert line.startswith("error: --k 1,8: each k must be in 1 .. --samples 4")
    line = _fails([*common, *models, "--temperature", "0"], capsys)
    assert line.startswith("error: --temperature must be a finite number >=")
    line = _fails([*common, "--base", tiny_lm_dir], capsys)
    assert "the following arguments are required: --trained" in line
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    line = _fails(["lab", "passk", *models, "--out", str(a_file)], capsys)
    assert line.startswith(f"error: --output-dir {str(a_file)!r} is a file")
    assert not out.exists()


@pytest.mark.integration
def test_a_failure_on_the_second_model_writes_nothing(tiny_lm_dir, tmp_path, monkeypatch, capsys):
    import policygrad.lab.passk as passk

    calls = []

    def fake_measure(*_args, label, **_kwargs):
        calls.append(label)
        if label == "trained":
            raise ValueError("the trained model's samples could not be scored")
        return ModelPassK(label, "m", "hf", [False], [0], {1: 0.0}, 0.0)

    monkeypatch.setattr(passk, "measure", fake_measure)
    out = tmp_path / "out"
    argv = ["lab", "passk", "--base", tiny_lm_dir, "--trained", tiny_lm_dir, "--engine", "hf", "--limit", "1",
            "--samples", "1", "--max-new-tokens", "2", "--out", str(out)]
    line = _fails(argv, capsys)
    assert line == "error: the trained model's samples could not be scored"
    assert calls == ["base", "trained"]
    assert not out.exists()  # the base's numbers alone are not written as a result
