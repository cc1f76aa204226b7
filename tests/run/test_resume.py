"""What may change on ``--resume``: session and training options are reported as changes,
anything else is refused naming each option with its saved and given value; a new base
learning rate keeps the schedule's position."""

from __future__ import annotations

import os

import pytest
import torch

from policygrad.config.train import ConfigError, load_config
from policygrad.run.resume import (
    SESSION_OPTIONS,
    TRAINING_OPTIONS,
    _flatten,
    config_changes,
    saved_config,
    set_base_lr,
)
from policygrad.run.rundir import write_config

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


def test_set_base_lr_keeps_the_schedules_position():
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.025], abs=1e-15)  # 0.1 x 0.25
    set_base_lr(optimizer, scheduler, 0.2)
    # Step 2 of the schedule: factor 0.5^2 = 0.25, so the rate is 0.2 x 0.25 = 0.05 at once ...
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.05], abs=1e-15)
    assert scheduler.base_lrs == [0.2, 0.2]
    assert [g["initial_lr"] for g in optimizer.param_groups] == [0.2, 0.2]
    # ... and the schedule goes on from there: step 3, 0.2 x 0.125 = 0.025.
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.025], abs=1e-15)
