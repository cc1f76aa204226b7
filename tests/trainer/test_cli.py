"""Tests of ``policygrad train`` / ``policygrad eval`` through ``policygrad.cli.main``: every bad
input ends in one ``error:`` line naming the field and the fix (exit status 2), resume from the
command line, and evaluation with its JSONL of completions."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import yaml

from policygrad.cli import main
from policygrad.evaluate.single_turn import pass_at_k
from policygrad.rewards.verifiers import extract_answer
from tests.training import checkpoint_weights, tiny_overrides, write_jsonl

pytestmark = pytest.mark.integration

VOLATILE = ("time/", "perf/", "memory/")


@pytest.fixture
def tiny_yaml(eos_model_dir, rewards_py, tmp_path):
    """``tiny_yaml(name="run", reward_fn="digit_fraction", **sections)`` -> path of a config file
    of a tiny run writing to ``tmp_path / name``."""

    def factory(name: str = "run", *, reward_fn: str = "digit_fraction", **sections) -> str:
        tree = tiny_overrides(eos_model_dir, f"{rewards_py}:{reward_fn}", tmp_path / name, **sections)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree))
        return str(path)

    return factory


def _fails(argv, capsys) -> str:
    """Run the CLI, expect exit status 2 and return the single ``error:`` line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ----------------------------------------------------------------------------- configuration


def test_unknown_algorithm(capsys):
    line = _fails(["train", "--algorithm=ppo2"], capsys)
    assert line == (
        "error: algorithm='ppo2' is not valid; choose one of "
        "['dr_grpo', 'grpo', 'ppo', 'reinforce', 'reinforce_pp', 'remax', 'rloo', 'vineppo']"
    )


def test_unknown_option(capsys):
    line = _fails(["train", "--kl.bta=1"], capsys)
    assert line.startswith("error: unknown config key kl.bta; valid keys here: beta, controller, horizon, ")


@pytest.mark.parametrize("algorithm", ["rloo", "grpo", "dr_grpo"])
def test_group_size_one_with_a_group_baseline(algorithm, capsys):
    line = _fails(["train", f"--algorithm={algorithm}", "--rollout.group_size=1"], capsys)
    assert f"algorithm={algorithm!r} needs rollout.group_size >= 2" in line


def test_config_file_errors(tmp_path, capsys):
    assert "config file /nonexistent.yaml not found" in _fails(["train", "/nonexistent.yaml"], capsys)
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  lr: fast\n")
    assert "optim.lr must be a number, got 'fast'" in _fails(["train", str(path)], capsys)


def test_resume_errors(tmp_path, capsys):
    line = _fails(["train", "--resume", str(tmp_path)], capsys)
    assert (
        f"--resume {tmp_path}: {tmp_path}/config.yaml not found; is this a policygrad run directory?" in line
    )
    assert "--resume needs a run directory" in _fails(["train", "--resume"], capsys)


def test_unknown_command(capsys):
    assert "unknown command 'fit'; choose one of train, eval" in _fails(["fit"], capsys)


# ----------------------------------------------------------------------------- data


def test_prompt_longer_than_the_context_budget(tiny_yaml, capsys):
    line = _fails(["train", tiny_yaml(), "--data.max_prompt_length=8"], capsys)
    assert "tokens long, over max_prompt_length=8" in line
    assert "raise max_prompt_length, or shorten or drop the long prompts" in line


def test_empty_dataset(tiny_yaml, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = _fails(["train", tiny_yaml(), f"--data.dataset={empty}"], capsys)
    assert f"dataset {empty} is empty (no rows)" in line


def test_missing_prompt_field(tiny_yaml, tmp_path, capsys):
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": "What is 1+1?", "answer": "2"}])
    line = _fails(["train", tiny_yaml(), f"--data.dataset={data}"], capsys)
    assert "cannot tell which field holds the prompt; the rows have the fields 'text', 'answer'" in line
    assert "Set prompt_field to one of them" in line


def test_row_without_the_mapped_field(tiny_yaml, tmp_path, capsys):
    data = write_jsonl(
        tmp_path / "holes.jsonl",
        [{"text": "What is 1+1?", "answer": "2"}, {"body": "What is 2+2?", "answer": "4"}],
    )
    line = _fails(["train", tiny_yaml(), f"--data.dataset={data}", "--data.prompt_field=text"], capsys)
    assert "row 1 (line 2) has no field 'text'; its fields are 'body', 'answer'" in line


def test_missing_reward_file(tiny_yaml, tmp_path, capsys):
    line = _fails(["train", tiny_yaml(), f"--reward.functions=[{tmp_path}/nope.py:score]"], capsys)
    assert "reward function file" in line and "nope.py" in line and "does not exist" in line


# ----------------------------------------------------------------------------- rewards


def test_reward_function_that_raises(tiny_yaml, bad_row_dataset, rewards_py, capsys):
    argv = [
        "train",
        tiny_yaml(reward_fn="flaky"),
        f"--data.dataset={bad_row_dataset}",
        "--data.shuffle=false",
    ]
    line = _fails(argv, capsys)
    assert line == (
        f"error: reward function '{rewards_py}:flaky' raised RuntimeError: cannot score this row for row 4 "
        "(prompt: 'What is 7-4?'); fix the function, or set on_error='skip' to leave such rows out of "
        "the loss and count them in reward/invalid_frac"
    )


def test_reward_function_returning_a_non_number(tiny_yaml, bad_row_dataset, rewards_py, capsys):
    argv = [
        "train",
        tiny_yaml(reward_fn="not_a_number"),
        f"--data.dataset={bad_row_dataset}",
        "--data.shuffle=false",
    ]
    line = _fails(argv, capsys)
    assert (
        f"reward function '{rewards_py}:not_a_number' returned 'n/a' (str), not a finite real number" in line
    )
    assert "for row 4 (prompt: 'What is 7-4?')" in line


def test_reward_errors_skipped_are_counted(tiny_yaml, bad_row_dataset, tmp_path):
    argv = [
        "train",
        tiny_yaml("skip", reward_fn="flaky"),
        f"--data.dataset={bad_row_dataset}",
        "--data.shuffle=false",
        "--reward.on_error=skip",
    ]
    assert main(argv) == 0
    with open(tmp_path / "skip" / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["reward/invalid_frac"] for r in rows] == [0.5, 0.5]  # 4 of 8 rows each step
    assert all(r["optim/steps"] == 1 and math.isfinite(r["policy/loss"]) for r in rows)


# ----------------------------------------------------------------------------- resume


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)} for line in f]


def test_resume_from_the_command_line(tiny_yaml, tmp_path, capsys):
    # 2 steps, stop, `--resume` with 2 more steps == 4 straight steps (metrics and weights bitwise).
    extra = ["--kl.placement=reward", "--kl.beta=0.05", "--optim.num_minibatches=2"]
    assert main(["train", tiny_yaml("straight"), "--steps=4", *extra]) == 0
    assert main(["train", tiny_yaml("resumed"), "--steps=2", *extra]) == 0
    assert main(["train", "--resume", str(tmp_path / "resumed"), "--steps=4"]) == 0
    capsys.readouterr()
    straight, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed == straight
    a, b = checkpoint_weights(tmp_path / "straight", 4), checkpoint_weights(tmp_path / "resumed", 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- eval


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 1, 1, 0.2),  # pass@1 = c/n
        (10, 3, 1, 0.3),
        (4, 0, 2, 0.0),  # nothing correct
        (4, 3, 2, 1.0),  # n - c = 1 < k: every draw of 2 holds a correct sample
        (6, 2, 3, 0.8),  # 1 - C(4,3)/C(6,3) = 1 - 4/20
        (3, 3, 3, 1.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"k=3 must be <= n=2"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match=r"c=5 must be in \[0, n=4\]"):
        pass_at_k(4, 5, 1)


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
            "--env", "tests.evaluate.test_single_turn:FindChar", "--env-options", '{"char": "v"}',
            "--model", eos_model_dir, "--dataset", data, "--limit", "3", "--max-new-tokens", "6",
            "--max-turns", "2", "--samples", "2", "--output", str(out),
        ],
        capsys,
    )
    assert (result["n"], result["output"]) == (3, str(out))
    assert result["env"] == "tests.evaluate.test_single_turn:FindChar"
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


def test_files_that_exit_at_import_and_a_missing_critic_folder_are_named(
    tiny_yaml, eos_model_dir, tmp_path, capsys
):
    # Before: "error: 3" (a reward file calling sys.exit(3) at module level), an environment file
    # doing the same ended eval with status 3 and no line, and critic.init_from=/nope was "model: ...".
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\n\nsys.exit(3)\n")
    line = _fails(["train", tiny_yaml("exit_reward"), f"--reward.functions=[{exits}:score]"], capsys)
    assert line == (
        f"error: reward function file {str(exits)!r} exited at import with status 3 (sys.exit or exit() at "
        "module level); a reward file only defines functions: put the code that runs under "
        "if __name__ == '__main__': (reward.functions)"
    )
    line = _fails(["eval", "--engine", "hf", "--model", eos_model_dir, "--env", f"{exits}:Env"], capsys)
    assert line.startswith(f"error: environment file {str(exits)!r} exited at import with status 3 (")
    assert "give options" not in line

    line = _fails(["train", tiny_yaml("critic"), "--algorithm=ppo", "--critic.init_from=/nope"], capsys)
    assert line.startswith("error: critic.init_from='/nope': the folder '/nope' does not exist; give ")


def test_eval_env_whose_every_episode_failed_is_an_error_and_some_failed_are_counted(
    eos_model_dir, tmp_path, capsys
):
    # Before: every episode failed in the environment, yet the exit status was 0 with a summary of
    # zeros (success 0.0) that reads like a model that never succeeds.
    env = "tests.evaluate.test_single_turn:FailsOnBad"
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
    env = "tests.evaluate.test_single_turn:ChdirOnStep"
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
    line = _fails([*common, "--env", "tests.evaluate.test_single_turn:NoSuchClass"], capsys)
    assert "--env" in line and "NoSuchClass" in line
    # A class the module does not have is not fixed by other options (before: "give options
    # tests.evaluate.test_single_turn:NoSuchClass accepts"): the line lists the classes it has.
    assert "give options" not in line
    assert line.endswith(
        "its Environment classes: ChdirOnStep, FailsOnBad, FindChar; give "
        "tests.evaluate.test_single_turn:NAME with one of them"
    )
    line = _fails([*common, "--max-turns", "3"], capsys)
    assert line == (
        "error: --max-turns applies to multi-turn episodes only; give --env (an environment) "
        "or drop --max-turns"
    )


# ----------------------------------------------------------------------------- found by trying to break it


def test_a_new_run_never_mixes_with_an_old_one(tiny_yaml, tmp_path, capsys):
    # A second run into the same output_dir would keep the old run's checkpoints, and a later
    # --resume would silently continue the old run: refused unless --overwrite=true.
    # length_fraction: seed 5's single step samples no digit, and a run that moves no weight fails.
    cfg = tiny_yaml("run", reward_fn="length_fraction")
    assert main(["train", cfg]) == 0
    line = _fails(["train", cfg, "--seed=5"], capsys)
    assert "already holds a run" in line and "--resume" in line and "--overwrite=true" in line
    assert main(["train", cfg, "--seed=5", "--steps=1", "--overwrite=true"]) == 0
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_1"]  # the old step_2 is gone
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1]


def test_a_checkpoint_is_a_complete_model_folder(tiny_yaml, tmp_path, capsys):
    # README: `policygrad eval --model RUN_DIR/checkpoints/step_N/model` needs the tokenizer there.
    assert main(["train", tiny_yaml("run")]) == 0
    folder = tmp_path / "run" / "checkpoints" / "step_2" / "model"
    assert (folder / "tokenizer_config.json").exists()
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}])
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--engine",
                "hf",
                "--model",
                str(folder),
                "--dataset",
                data,
                "--limit",
                "1",
                "--max-new-tokens",
                "4",
                "--output",
                str(tmp_path / "e.jsonl"),
            ]
        )
        == 0
    )


def test_resume_without_checkpoint_yaml_error_and_broken_reward_file_are_one_line_errors(
    tiny_yaml, tmp_path, capsys
):
    cfg = tiny_yaml("run")
    os.makedirs(tmp_path / "interrupted")
    with open(cfg) as src, open(tmp_path / "interrupted" / "config.yaml", "w") as dst:
        dst.write(src.read())
    assert "no checkpoint found" in _fails(["train", "--resume", str(tmp_path / "interrupted")], capsys)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("steps: [\n")
    assert _fails(["train", str(bad_yaml)], capsys).startswith("error: while parsing")
    broken = tmp_path / "broken.py"
    broken.write_text("import a_module_that_does_not_exist\n")
    line = _fails(["train", cfg, f"--reward.functions=[{broken}:f]"], capsys)
    assert "failed to load" in line and "ModuleNotFoundError" in line
    assert "is a file" in _fails(["train", cfg, f"--output_dir={broken}"], capsys)


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


def test_under_torchrun_a_config_error_is_printed_by_rank_0_alone(monkeypatch, capsys):
    # Every rank reads the same config and raises the same error: one line in all, from rank 0.
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "--no_such_option=1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == lines
        assert all(line.startswith("error: ") and "no_such_option" in line for line in err)


def test_a_run_that_said_how_it_stopped_gets_no_second_interrupted_line(monkeypatch, capsys):
    import policygrad.cli as cli

    def stopped(_argv):
        exc = KeyboardInterrupt()
        exc.reported = True  # as Run.train marks a second Ctrl-C it has logged
        raise exc

    monkeypatch.setitem(cli.COMMANDS, "train", stopped)
    assert main(["train"]) == 130
    assert capsys.readouterr().err == ""
    monkeypatch.setitem(cli.COMMANDS, "train", lambda _argv: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "interrupted\n"
