"""Tests of ``policygrad lab passk``: an end-to-end run of the CLI on the tiny model (hf engine), and
one ``error:`` line per bad flag with nothing written (pass@k by hand: test_passk_curve.py; the
files from a fake engine: test_passk_report.py)."""

from __future__ import annotations

import json
import math

import pytest

from policygrad.cli import main
from policygrad.lab.passk_report import ModelPassK


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
