"""Tests of ``policygrad eval`` through ``policygrad.cli.main``: the JSON summary and the JSONL of
every completion or episode, pass@k counted again from the records, and every bad input one
``error:`` line naming the flag and the fix (exit status 2; also when every episode failed)."""

from __future__ import annotations

import json
import os

import pytest

from policygrad.cli import main
from policygrad.evaluate.scoring import pass_at_k
from policygrad.rewards.verifiers import extract_answer
from tests.training import write_jsonl

pytestmark = pytest.mark.integration


def _fails(argv, capsys) -> str:
    """Run the CLI, expect exit status 2 and return the single ``error:`` line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _eval(argv, capsys) -> dict:
    # The hf engine: vLLM's CPU attention has no kernel for the tiny model's head size.
    assert main(["eval", "--engine", "hf", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_reports_accuracy_and_writes_completions(eos_model_dir, tmp_path, capsys):
    prompts = [f"What is {a} + {b}?" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12)]]
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": p, "answer": "-999"} for p in prompts])
    out = tmp_path / "completions.jsonl"
    common = ["--model", eos_model_dir, "--limit", "6", "--max-new-tokens", "8", "--output", str(out)]
    result = _eval(["--dataset", data, "--samples", "3", *common], capsys)
    assert (result["n"], result["output"]) == (6, str(out)) and result["accuracy"] == 0.0
    assert result["pass@3"] == 0.0
    with open(out, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["prompt"] for r in records] == prompts
    for r in records:
        assert r["answer"] == "-999" and r["reward"] == 0.0 and isinstance(r["completion"], str)
        assert len(r["samples"]) == 3 and all(s["reward"] == 0.0 for s in r["samples"])

    # Second pass: make the reference answer of each row the final number of its greedy
    # completion (greedy decoding repeats itself), so exactly those rows are correct.
    finals = [extract_answer(r["completion"]) for r in records]
    assert any(finals), [r["completion"] for r in records]
    data = write_jsonl(
        tmp_path / "d2.jsonl", [{"question": p, "answer": f or "-999"} for p, f in zip(prompts, finals)]
    )
    result = _eval(["--dataset", data, *common], capsys)
    assert result["accuracy"] == pytest.approx(sum(f is not None for f in finals) / 6, abs=1e-12)
    assert "pass@1" not in result
    with open(out, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["reward"] for r in records] == [1.0 if f else 0.0 for f in finals]


def test_eval_limit_larger_than_the_dataset_takes_every_row(eos_model_dir, tmp_path, capsys):
    data = write_jsonl(
        tmp_path / "two.jsonl", [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    )
    out = tmp_path / "o.jsonl"
    result = _eval(
        ["--model", eos_model_dir, "--dataset", data, "--max-new-tokens", "4", "--output", str(out)], capsys
    )  # default --limit 100
    assert result["n"] == 2


def test_eval_errors(eos_model_dir, tmp_path, capsys):
    line = _fails(["eval", "--model", eos_model_dir, "--dataset", str(tmp_path / "none.jsonl")], capsys)
    assert "none.jsonl" in line
    data = write_jsonl(tmp_path / "one.jsonl", [{"question": "1+1?", "answer": "2"}])
    assert "--samples must be >= 1, got 0" in _fails(
        ["eval", "--model", eos_model_dir, "--dataset", data, "--samples", "0"], capsys
    )


def test_eval_env_plays_episodes_and_writes_every_one(eos_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", [{"question": f"Say {i}.", "answer": str(i)} for i in range(4)])
    out = tmp_path / "episodes.jsonl"
    result = _eval(
        [
            "--env", "tests.evaluate.test_evaluation:FindChar", "--env-options", '{"char": "v"}',
            "--model", eos_model_dir, "--dataset", data, "--limit", "3", "--max-new-tokens", "6",
            "--max-turns", "2", "--samples", "2", "--output", str(out),
        ],
        capsys,
    )
    assert (result["n"], result["output"]) == (3, str(out))
    assert result["env"] == "tests.evaluate.test_evaluation:FindChar"
    with open(out, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert [r["prompt"] for r in records] == [f"Say {i}." for i in range(3)]
    for rec in records:
        assert rec["transcript"][0] == {"role": "user", "content": rec["prompt"]} and len(rec["samples"]) == 2
    for r in [*records, *(s for rec in records for s in rec["samples"])]:
        assert 1 <= r["turns"] <= 2 and r["stop_reason"] in ("done", "max_turns", "length")
        assert r["final_answer"] == r["transcript"][-1]["content"] and r["success"] == (r["final_reward"] > 0)
    assert result["success"] == pytest.approx(sum(r["success"] for r in records) / 3)
    assert result["turns_mean"] == pytest.approx(sum(r["turns"] for r in records) / 3)
    assert sum(v for k, v in result.items() if k.startswith("stop_")) == pytest.approx(1.0)
    counted = [sum(s["success"] for s in r["samples"]) for r in records]
    assert result["pass@2"] == pytest.approx(sum(pass_at_k(2, c, 2) for c in counted) / 3)


def test_eval_env_whose_every_episode_failed_is_an_error_and_some_failed_are_counted(
    eos_model_dir, tmp_path, capsys
):
    # Before: every episode failed in the environment, yet the exit status was 0 with a summary of
    # zeros (success 0.0) that reads like a model that never succeeds.
    env = "tests.evaluate.test_evaluation:FailsOnBad"
    common = ["--env", env, "--model", eos_model_dir, "--max-new-tokens", "4", "--max-turns", "2"]
    all_bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": f"bad {i}", "answer": "1"} for i in range(3)])
    out = tmp_path / "episodes.jsonl"
    line = _fails(["eval", "--engine", "hf", *common, "--dataset", all_bad, "--output", str(out)], capsys)
    assert line.startswith(
        "error: every one of the 3 greedy episodes failed in the environment, so there is no result (the "
        "first: step() failed: RuntimeError: this row breaks the environment)"
    )
    records = [json.loads(x) for x in out.read_text().splitlines()]  # kept: each episode's error
    assert [r["failed"] for r in records] == [True] * 3
    assert all("this row breaks" in r["error"] for r in records)

    # Some failed: counted in the summary, and a note says how many.
    rows = [{"question": q, "answer": "1"} for q in ("Say 1.", "bad 2", "Say 3.", "bad 4")]
    some = write_jsonl(tmp_path / "some.jsonl", rows)
    argv = ["eval", "--engine", "hf", *common, "--dataset", some]
    assert main([*argv, "--output", str(out), "--samples", "2"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert (result["n"], result["failed"], result["samples_failed"]) == (4, 2, 4)
    assert result["failed_frac"] == 0.5 and result["stop_error"] == 0.5
    error = "step() failed: RuntimeError: this row breaks the environment"
    assert result["first_error"] == error
    # Before: no word; the failed episodes read as the model's failures in success (0.5 at most).
    notes = [line for line in captured.err.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: 2 of 4 greedy and 4 sampled episodes failed in the environment and count as unsuccessful "
        f"in success and pass@k (the first: {error}); each episode's error is in {out}"
    ]
    assert main([*argv, "--output", str(out), "--limit", "1"]) == 0  # none failed: no note
    assert "note:" not in capsys.readouterr().err


def test_eval_writes_where_its_output_pointed_when_it_started(
    eos_model_dir, tmp_path, monkeypatch, capsys
):
    # An environment that changes the working directory mid-evaluation: before, a relative --output
    # was written under the new folder.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    data = write_jsonl(tmp_path / "p.jsonl", [{"question": f"Say {i}.", "answer": str(i)} for i in range(2)])
    options = json.dumps({"to": str(tmp_path / "elsewhere")})
    env = "tests.evaluate.test_evaluation:ChdirOnStep"
    argv = ["--env", env, "--env-options", options, "--model", eos_model_dir]
    result = _eval([*argv, "--dataset", data, "--max-new-tokens", "3", "--output", "eps.jsonl"], capsys)
    assert result["output"] == str(tmp_path / "eps.jsonl") and (tmp_path / "eps.jsonl").is_file()
    assert os.listdir(tmp_path / "elsewhere") == []


def test_eval_of_a_model_with_nan_weights_is_an_error(eos_model_dir, tmp_path, capsys):
    # Before: greedy decoding of NaN logits gave noise, reported as accuracy 0.0 with exit status 0.
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "nan_model"
    shutil.copytree(eos_model_dir, model)
    weights = load_file(model / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name][0] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}])
    out = str(tmp_path / "o.jsonl")
    argv = ["eval", "--engine", "hf", "--model", str(model), "--dataset", data, "--output", out]
    line = _fails(argv, capsys)
    assert line.startswith(f"error: --model {model} has non-finite weights: ")
    assert line.endswith("; it cannot be evaluated (repair the weights or choose another model)")
    assert not os.path.exists(out)


def test_eval_of_a_model_whose_logits_overflow_is_an_error(eos_model_dir, tmp_path, capsys):
    # Finite weights, but the final norm scaled by 3e38 makes every logit infinite: greedy decoding
    # picked token 0 from NaN log-probabilities and eval reported accuracy 0.0 with exit status 0.
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "overflow"
    shutil.copytree(eos_model_dir, model)
    weights = load_file(model / "model.safetensors")
    weights = {k: v * 3e38 if k == "model.norm.weight" else v for k, v in weights.items()}
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    rows = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    argv = ["eval", "--engine", "hf", "--model", str(model), "--dataset", data, "--max-new-tokens", "3"]
    line = _fails([*argv, "--output", str(tmp_path / "o.jsonl")], capsys)
    assert line == (
        "error: the model's logits were not finite: 6 of 6 generated tokens have a NaN log-probability (its "
        "weights or activations overflow), so nothing was evaluated; evaluate a checkpoint from before it "
        "diverged or repair the model"
    )


def test_eval_env_errors_name_the_flag(eos_model_dir, capsys):
    common = ["eval", "--model", eos_model_dir, "--engine", "hf"]
    line = _fails([*common, "--env", "builtin:guess", "--env-options", "{high: 5}"], capsys)
    assert line.startswith("error: --env-options '{high: 5}' is not valid JSON (")
    assert "give a JSON object" in line
    line = _fails([*common, "--env", "builtin:guess", "--env-options", "[1]"], capsys)
    assert line.startswith("error: --env-options must be a JSON object")
    line = _fails([*common, "--env", "builtin:guess", "--env-options", '{"hgh": 5}'], capsys)
    assert "--env-options" in line and "'hgh'" in line and "give options builtin:guess accepts" in line
    line = _fails([*common, "--env", "builtin:guess", "--env-options", '{"low": 9, "high": 2}'], capsys)
    assert line.startswith("error: --env-options {\"low\": 9, \"high\": 2} do not fit builtin:guess: low=9")
    line = _fails([*common, "--env", "builtin:nope"], capsys)
    assert line.startswith("error: --env: unknown environment 'builtin:nope'; give builtin:guess, ")
    line = _fails([*common, "--env", "tests.evaluate.test_evaluation:NoSuchClass"], capsys)
    assert "--env" in line and "NoSuchClass" in line
    # A class the module does not have is not fixed by other options (before: "give options
    # tests.evaluate.test_evaluation:NoSuchClass accepts"): the line lists the classes it has.
    assert "give options" not in line
    assert line.endswith(
        "its Environment classes: ChdirOnStep, FailsOnBad, FindChar; give "
        "tests.evaluate.test_evaluation:NAME with one of them"
    )
    line = _fails([*common, "--max-turns", "3"], capsys)
    assert line == (
        "error: --max-turns applies to multi-turn episodes only; give --env (an environment) "
        "or --agent, or drop --max-turns"
    )


def test_eval_split_or_dataset_config_that_choose_nothing_are_refused(tmp_path, capsys):
    # Before: --split and --dataset-config were ignored for a JSONL file without a word.
    data = write_jsonl(tmp_path / "one.jsonl", [{"question": "1+1?", "answer": "2"}])
    line = _fails(["eval", "--dataset", data, "--split", "train"], capsys)
    assert line == (
        f"error: --split train does nothing for --dataset {data}, a single file: it chooses a split of a "
        "dataset folder or a Hub dataset; drop --split"
    )
    line = _fails(["eval", "--dataset-config", "main"], capsys)  # the default builtin:arithmetic
    assert line.startswith("error: --dataset-config main does nothing for --dataset builtin:arithmetic, a")


def test_eval_rejects_a_useless_batch_size_or_limit(capsys):
    assert _fails(["eval", "--batch-size", "-1"], capsys) == "error: --batch-size must be >= 1, got -1"
    assert _fails(["eval", "--limit", "0"], capsys) == "error: --limit must be >= 1, got 0"


def test_eval_agent_plays_the_sessions_an_equivalent_environment_plays(eos_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "p.jsonl", [{"question": f"Say {i}.", "answer": str(i)} for i in range(3)])
    common = [
        "--model",
        eos_model_dir,
        "--dataset",
        data,
        "--max-new-tokens",
        "4",
        "--max-turns",
        "3",
        "--samples",
        "2",
    ]
    by_env = _eval(
        ["--env", "tests.envs.test_agent_training:Digits", *common, "--output", str(tmp_path / "env.jsonl")],
        capsys,
    )
    by_agent = _eval(
        [
            "--agent",
            "tests.envs.test_agent_training:digits_agent",
            *common,
            "--output",
            str(tmp_path / "agent.jsonl"),
        ],
        capsys,
    )
    assert by_agent["agent"] == "tests.envs.test_agent_training:digits_agent" and "env" not in by_agent
    volatile = {
        "env",
        "agent",
        "output",
        "seconds",
        "load_seconds",
        "env/tool_calls",
        "env/malformed_tool_calls",
        "env/history_rewrites",
    }
    assert by_agent["env/history_rewrites"] == 0.0  # its calls extend their history
    assert {k: v for k, v in by_env.items() if k not in volatile} == {
        k: v for k, v in by_agent.items() if k not in volatile
    }
    assert by_agent["failed"] == 0 and by_agent["n"] == 3


def test_eval_agent_errors_name_the_flag(eos_model_dir, tmp_path, capsys):
    common = ["eval", "--model", eos_model_dir]
    line = _fails([*common, "--agent", "tests.envs.agents:guess", "--env", "builtin:guess"], capsys)
    assert line == "error: --env and --agent are both given; an agent is its own environment: give one"
    line = _fails([*common, "--agent", "tests.envs.agents:guess", "--env-options", "{}"], capsys)
    assert line == "error: --env-options applies to --env; an agent takes no options"
    line = _fails([*common, "--agent", "tests.envs.agents:nope"], capsys)
    assert line.startswith(
        "error: 'tests.envs.agents' has no attribute 'nope' (--agent 'tests.envs.agents:nope')"
    )
    line = _fails([*common, "--agent", str(tmp_path / "missing.py") + ":run"], capsys)
    assert "agent file" in line and "does not exist" in line
