"""Tests of ``policygrad train`` (and the other commands) through ``policygrad.cli.main``: every
bad input ends in one ``error:`` line naming the field and the fix (exit status 2), and resume
from the command line. ``policygrad eval`` is tested in tests/evaluate/test_command.py."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import yaml

from policygrad.cli import main
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
