"""Every command refuses a bad argument or config with one ``error:`` line before it reads,
converts or loads any model, opens any dataset or starts any engine.

Each case runs with a cold model cache (an empty ``POLICYGRAD_HOME``) and the bundled default
model, so any model read would first convert the bundled GGUF file into that cache (tens of
seconds): an empty cache afterwards shows nothing was read."""

from __future__ import annotations

import os

import pytest

from policygrad.cli import main

pytestmark = pytest.mark.unit

BUNDLED = "bundled:smollm2-135m-instruct"  # kl-estimators runs without a model unless given one
A_FILE = "a-file.txt"  # created in the working folder by the test: an --output-dir that is a file

CASES = {
    "train": [
        (["--rollout.group_size=0"], "rollout.group_size"),
        (["--rollout.temperature=-1"], "rollout.temperature"),
        (["--steps=-1"], "steps"),
        (["--no_such_option=1"], "no_such_option"),
        (["--data.dataset=missing.jsonl"], "missing.jsonl"),
        (["--data.eval_dataset=missing.jsonl"], "missing.jsonl"),
        (["--rollout.engine=hf", "--rollout.dtype=bfloat16"], "rollout.dtype"),
        (["--reward.functions=[missing.py:score]"], "missing.py"),
        (["--reward.functions=[broken.py:score]"], "SyntaxError"),  # parsed, never run
        (["--model.adapter=no-adapter"], "model.adapter='no-adapter' has no adapter_config.json"),
    ],
    "eval": [
        (["--samples", "0"], "--samples"),
        (["--samples", "x"], "--samples"),
        (["--temperature", "-1"], "--temperature"),
        (["--k", "9"], "--k"),
        (["--limit", "0"], "--limit"),
        (["--engine", "nope"], "--engine"),
        (["--adapter", "no-adapter"], "has no adapter_config.json"),
        (["--dataset", "missing.jsonl"], "missing.jsonl"),
        (["--output", "no/such/folder/out.jsonl"], "--output"),
        (["--output", "."], "--output"),
        (["--env", "builtin:nope"], "--env"),
        (["--env", "builtin:guess", "--env-options", "{bad"], "--env-options"),
        (["--env", "builtin:guess", "--env-options", '{"high": "x"}'], "--env-options"),
        (["--max-turns", "2"], "--max-turns"),
    ],
    "memory": [
        (["--world-size", "0"], "--world-size"),
        (["--world-size", "2.5"], "--world-size"),
        (["--lora-rank", "-1"], "--lora-rank"),
        (["--batch", "4"], "--batch"),
        (["--critic-params", "0"], "--critic-params"),
        (["--algorithm", "nope"], "algorithm"),
        (["--output-dir", A_FILE], "--output-dir"),
    ],
    "lab": [
        (["gradient-snr", "--prompts", "0"], "--prompts"),
        (["gradient-snr", "--temperature", "0"], "--temperature"),
        (["gradient-snr", "--estimators", "nope"], "--estimators"),
        (["gradient-snr", "--output-dir", A_FILE], "--output-dir"),
        (["gradient-snr", "--samples-per-prompt", "x"], "--samples-per-prompt"),
        (["gradient-snr", "--params", "([unclosed"], "not a valid regular expression"),
        (["gradient-snr", "--dataset", "missing.jsonl"], "missing.jsonl"),
        (["mismatch", "--model", "/no-such-model"], "/no-such-model"),
        (["mismatch", "--cap", "0"], "--cap"),
        (["mismatch", "--temperature", "nan"], "--temperature"),
        (["mismatch", "--output-dir", A_FILE], "--output-dir"),
        (["kl-estimators", "--model", BUNDLED, "--max-new-tokens", "0"], "--max-new-tokens"),
        (["kl-estimators", "--model", BUNDLED, "--output-dir", A_FILE], "--output-dir"),
        (["nope"], "nope"),
    ],
    "report": [
        (["--samples", "-1", "."], "--samples"),
        (["missing-run"], "missing-run"),
        (["--no-such-option", "."], "--no-such-option"),
    ],
}
PARAMS = [
    pytest.param(command, args, named, id=f"{command}:{' '.join(args)}")
    for command, cases in CASES.items()
    for args, named in cases
]


@pytest.mark.parametrize("command, args, named", PARAMS)
def test_bad_argument_is_one_error_line_before_any_model(
    command, args, named, cold_cache, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / A_FILE).write_text("not a folder\n")
    (tmp_path / "broken.py").write_text("def score(:\n")
    assert main([command, *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), captured.err
    assert named in err[0]
    assert os.listdir(cold_cache) == []  # no model converted (nor anything else cached)
    # No run folder, no output file, nothing else written where the command ran.
    written = [A_FILE, os.path.basename(cold_cache), "broken.py"]
    assert sorted(os.listdir(tmp_path)) == sorted(written)  # nor a lab-results/ folder


def test_eval_refuses_to_write_over_the_dataset_it_reads(cold_cache, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    row = '{"prompt": "What is 1 + 1?", "answer": "2"}\n'
    (tmp_path / "data.jsonl").write_text(row)
    assert main(["eval", "--dataset", "data.jsonl", "--output", "./data.jsonl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --output ./data.jsonl is the dataset being evaluated")
    assert (tmp_path / "data.jsonl").read_text() == row  # the input is untouched
    assert os.listdir(cold_cache) == []
