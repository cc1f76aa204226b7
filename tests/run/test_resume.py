"""What may change on ``--resume``: session and training options are reported as changes,
anything else is refused naming each option with its saved and given value; and the read-only
checks of ``check_resume`` (the newest complete checkpoint, the run's own folder, not in use,
something left to train)."""

from __future__ import annotations

import os

import pytest

from policygrad.config.train import ConfigError, load_config
from policygrad.errors import TrainingError
from policygrad.run.checkpoint import COMPLETE_FILE, checkpoint_path
from policygrad.run.directory import LOCK_FILE, RunLock, write_config
from policygrad.run.resume import (
    SESSION_OPTIONS,
    TRAINING_OPTIONS,
    Resume,
    _flatten,
    check_resume,
    config_changes,
    saved_config,
)
from tests.run.folders import run_config, run_folder

pytestmark = pytest.mark.unit

SAVED = {"steps": 10, "optim": {"lr": 1e-3}, "model": {"name": "org/a"}, "seed": 1}


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    write_config(str(folder), load_config(None, {**SAVED, "output_dir": str(folder)}))
    return str(folder)


def given(run_dir, **over):
    return load_config(None, {**SAVED, "output_dir": run_dir, **over})


def test_every_option_named_is_a_config_field_and_in_one_set_only():
    fields = set(_flatten(load_config(None, {}).to_dict()))
    assert SESSION_OPTIONS <= fields, SESSION_OPTIONS - fields
    assert TRAINING_OPTIONS <= fields, TRAINING_OPTIONS - fields
    assert not SESSION_OPTIONS & TRAINING_OPTIONS


def test_flatten_joins_paths_with_dots_and_keeps_leaves():
    tree = {"a": 1, "b": {"c": (1, 2), "d": {"e": None}}, "empty": {}, "options": {"x": 1}}
    # Tuples become lists (as YAML reads them back); an empty dict and ``options`` stay leaves.
    assert _flatten(tree) == {"a": 1, "b.c": [1, 2], "b.d.e": None, "empty": {}, "options": {"x": 1}}


def test_the_same_options_are_no_change(run_dir):
    assert config_changes(run_dir, given(run_dir)) == {}


def test_output_dir_and_overwrite_are_not_compared(run_dir, tmp_path):
    moved = load_config(None, {**SAVED, "output_dir": str(tmp_path / "elsewhere"), "overwrite": True})
    assert config_changes(run_dir, moved) == {}


def test_session_and_training_options_are_reported_as_changes(run_dir):
    cfg = given(run_dir, steps=20, optim={"lr": 5e-4}, reward={"on_error": "skip"})
    assert config_changes(run_dir, cfg) == {
        "optim.lr": (1e-3, 5e-4),
        "reward.on_error": ("raise", "skip"),
        "steps": (10, 20),
    }


def test_other_changes_are_refused_naming_each_with_both_values(run_dir):
    cfg = given(run_dir, steps=20, seed=2, model={"name": "org/b"})
    with pytest.raises(ConfigError) as caught:
        config_changes(run_dir, cfg)
    message = str(caught.value)
    assert message.startswith(f"--resume {run_dir}: these options cannot change on resume")
    assert "model.name: 'org/a' -> 'org/b'; seed: 1 -> 2; drop them" in message
    assert "steps" not in message  # an allowed change is not listed
    assert f"model.name={os.path.join(run_dir, 'checkpoints', 'step_N', 'model')}" in message


def test_a_folder_without_config_yaml(tmp_path):
    with pytest.raises(FileNotFoundError, match="is this a policygrad run directory"):
        config_changes(str(tmp_path), load_config(None, {}))


def test_a_saved_config_that_is_no_longer_valid_names_the_field(run_dir):
    with open(os.path.join(run_dir, "config.yaml"), "a", encoding="utf-8") as f:
        f.write("no_such_option: 1\n")
    with pytest.raises(
        ConfigError, match=rf"--resume {run_dir}: its config.yaml is not valid: .*no_such_option"
    ):
        saved_config(run_dir)


def test_saved_config_reads_back_what_was_written(run_dir):
    assert saved_config(run_dir).to_dict() == {**given(run_dir).to_dict(), "overwrite": False}


def test_resume_applies_session_and_training_options_and_refuses_the_rest(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_config(str(run), load_config(None, {"output_dir": str(run)}))
    same = load_config(None, {"output_dir": str(run), "overwrite": True})
    assert config_changes(str(run), same) == {}
    changed = load_config(None, {"output_dir": str(run), "steps": 400, "optim": {"lr": 0.5}})
    assert config_changes(str(run), changed) == {"optim.lr": (2e-5, 0.5), "steps": (300, 400)}
    refused = load_config(
        None, {"output_dir": str(run), "algorithm": "rloo", "seed": 3, "optim": {"lr": 0.5}}
    )
    with pytest.raises(ConfigError) as info:
        config_changes(str(run), refused)
    message = str(info.value)
    assert "cannot change on resume" in message
    assert "algorithm: 'grpo' -> 'rloo'; seed: 0 -> 3;" in message and "optim.lr" not in message


# ----------------------------------------------------------------------------- check_resume


def test_a_resume_takes_the_newest_checkpoint_its_state_and_the_changes(tmp_path):
    run = run_folder(tmp_path / "run", 1, 2)
    got = check_resume(run_config(run, optim={"lr": 5e-6}), run)
    assert isinstance(got, Resume)
    assert got.checkpoint == checkpoint_path(run, 2) and got.state["step"] == 2
    assert list(got.changes) == ["optim.lr"] and got.changes["optim.lr"][1] == 5e-6
    assert check_resume(run_config(run), run).changes == {}
    assert not os.path.exists(os.path.join(run, LOCK_FILE))  # read-only: nothing taken


def test_a_start_that_saved_no_checkpoint_is_told_to_start_again(tmp_path):
    run = run_folder(tmp_path / "run")
    with pytest.raises(TrainingError) as e:
        check_resume(run_config(run), run)
    assert str(e.value) == (
        f"--resume {run}: no checkpoint found under {run}/checkpoints: the run saved no checkpoint before it "
        "stopped, so there is nothing to continue; start it again instead (its folder is taken as new): "
        f"policygrad train {run}/config.yaml [--key=value ...]"
    )


def test_no_complete_checkpoint_names_the_skipped_ones(tmp_path):
    run = run_folder(tmp_path / "run", 3)
    os.remove(os.path.join(checkpoint_path(run, 3), COMPLETE_FILE))
    with pytest.raises(TrainingError) as e:
        check_resume(run_config(run), run)
    assert str(e.value) == (
        f"--resume {run}: no checkpoint found under {run}/checkpoints that is complete "
        "(step_3: no completion marker (its save did not finish))"
    )
    empty = str(tmp_path / "empty")  # no config.yaml either
    with pytest.raises(
        TrainingError, match=r"^--resume .*/empty: no checkpoint found under .*/empty/checkpoints$"
    ):
        check_resume(run_config(empty), empty)


def test_a_resume_continues_in_its_own_folder(tmp_path):
    run = run_folder(tmp_path / "run", 1)
    other = tmp_path / "branch"
    with pytest.raises(ConfigError, match=rf"--resume {run} with output_dir='{other}'.*cp -r {run} {other}"):
        check_resume(run_config(other), run)
    assert check_resume(run_config(run + "/"), run).state["step"] == 1  # the same folder, spelled otherwise


def test_overwrite_cannot_be_combined_with_resume(tmp_path):
    run = run_folder(tmp_path / "run", 1)
    with pytest.raises(
        ConfigError, match=f"--overwrite cannot be combined with --resume {run}; give one of them"
    ):
        check_resume(run_config(run, overwrite=True), run)


@pytest.mark.parametrize("steps", [2, 1])
def test_nothing_left_to_train_is_refused(tmp_path, steps):
    run = run_folder(tmp_path / "run", 2)
    with pytest.raises(ConfigError) as e:
        check_resume(run_config(run, steps=steps), run)
    assert str(e.value) == (
        f"--resume {run}: the run is at step 2 of steps={steps}, so there is nothing to train; give --steps "
        "larger than 2 to continue it"
    )


def test_a_folder_in_use_is_refused(tmp_path):
    run = run_folder(tmp_path / "run", 1)
    lock = RunLock.acquire(run)
    try:
        # The lock of this process is live while referenced: another run owns the folder.
        with pytest.raises(TrainingError):
            check_resume(run_config(run), run)
    finally:
        lock.release()
    assert check_resume(run_config(run), run).state["step"] == 1


def test_options_that_cannot_change_are_refused(tmp_path):
    run = run_folder(tmp_path / "run", 1)
    with pytest.raises(ConfigError, match="cannot change on resume.*seed: 0 -> 3"):
        check_resume(run_config(run, seed=3), run)
