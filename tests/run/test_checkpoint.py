"""Checkpoint folders without a model: names and steps, completeness, which checkpoint a resume
takes and why the others are skipped, tidying interrupted saves, the trainer state loaded safely,
and policy weights and a whole optimizer state loaded back. (Transactions and full-disk saves:
tests/run/test_rundir.py.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import namedtuple

import pytest
import torch
from safetensors.torch import save_file

from policygrad.errors import TrainingError
from policygrad.run.checkpoint import (
    COMPLETE_FILE,
    STATE_FILE,
    CheckpointError,
    check_room_for_checkpoint,
    checkpoint_bytes,
    checkpoint_path,
    checkpoint_problem,
    checkpoint_step,
    find_checkpoints,
    latest_checkpoint,
    load_trainer_state,
    recover_interrupted_saves,
    save_checkpoint,
    temp_folder,
)

pytestmark = pytest.mark.unit

STATE = {"step": 2, "data_position": 4, "optimizer": {}, "scheduler": {}, "kl_controller": {}, "rng": {}}


class Weights:
    """Writes one safetensors file like ``save_pretrained``."""

    def save_pretrained(self, folder, **_):
        os.makedirs(folder, exist_ok=True)
        save_file({"w": torch.arange(4.0)}, os.path.join(folder, "model.safetensors"))


class Tokenizer:
    def save_pretrained(self, folder, **_):
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write("{}")


def _save(run_dir, step, **state):
    return save_checkpoint(
        checkpoint_path(str(run_dir), step),
        policy=Weights(),
        tokenizer=Tokenizer(),
        state={**STATE, "step": step, **state},
    )


def test_paths_and_steps():
    assert checkpoint_path("/r", 7) == os.path.join("/r", "checkpoints", "step_7")
    assert checkpoint_step("/r/checkpoints/step_12/") == 12
    for name in ("step_", "step_x", "step_-1", ".step_3.tmp-11", "step_3.old", "last"):
        assert checkpoint_step(os.path.join("/r", name)) is None, name
    assert temp_folder("/r/checkpoints/step_3") == f"/r/checkpoints/.step_3.tmp-{os.getpid()}"


def test_the_marker_records_the_step_and_every_file(tmp_path):
    path = _save(tmp_path, 3)
    marker = json.load(open(os.path.join(path, COMPLETE_FILE)))
    assert marker["step"] == 3
    assert marker["files"]["trainer_state.pt"] == os.path.getsize(os.path.join(path, STATE_FILE))
    assert not [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".")]  # no temporary left


def test_an_unreadable_marker_and_a_missing_file_are_problems(tmp_path):
    path = _save(tmp_path, 1)
    with open(os.path.join(path, COMPLETE_FILE), "w") as f:
        f.write('{"files": ')  # torn
    assert checkpoint_problem(path) == f"its completion marker {COMPLETE_FILE} is unreadable"
    with open(os.path.join(path, COMPLETE_FILE), "w") as f:
        json.dump({"step": 1}, f)  # no file list
    assert checkpoint_problem(path) == f"its completion marker {COMPLETE_FILE} is unreadable"
    path = _save(tmp_path, 2)
    os.remove(os.path.join(path, "model", "tokenizer.json"))
    assert checkpoint_problem(path) == os.path.join("model", "tokenizer.json") + " is missing"


def test_latest_checkpoint_skips_every_newer_incomplete_one_with_its_reason(tmp_path, caplog):
    _save(tmp_path, 2)
    killed = _save(tmp_path, 10)
    os.remove(os.path.join(killed, COMPLETE_FILE))  # killed before the marker
    torn = _save(tmp_path, 9)
    with open(os.path.join(torn, STATE_FILE), "ab") as f:
        f.write(b"x")
    (tmp_path / "checkpoints" / "notes").mkdir()  # not a checkpoint: ignored
    size = os.path.getsize(os.path.join(torn, STATE_FILE))
    path, skipped = find_checkpoints(str(tmp_path))
    assert path == checkpoint_path(str(tmp_path), 2)  # numeric order: 10 > 9 > 2
    assert skipped == [
        (killed, "no completion marker (its save did not finish)"),
        (torn, f"{STATE_FILE} has {size} bytes, not the {size - 1} it was saved with"),
    ]
    with caplog.at_level(logging.INFO, logger="policygrad"):
        assert latest_checkpoint(str(tmp_path)) == path
    assert f"skipped checkpoint {killed}: no completion marker (its save did not finish)" in caplog.text
    assert f"skipped checkpoint {torn}: {STATE_FILE} has" in caplog.text
    assert f"newest complete checkpoint: {path}" in caplog.text


def test_no_complete_checkpoint(tmp_path):
    killed = _save(tmp_path, 1)
    os.remove(os.path.join(killed, COMPLETE_FILE))
    assert find_checkpoints(str(tmp_path)) == (
        None,
        [(killed, "no completion marker (its save did not finish)")],
    )
    assert latest_checkpoint(str(tmp_path)) is None


def test_recover_puts_back_a_replaced_checkpoint_and_deletes_unfinished_saves(tmp_path):
    root = tmp_path / "checkpoints"
    recover_interrupted_saves(str(tmp_path))  # no checkpoints folder: nothing to do
    assert not root.exists()
    a = _save(tmp_path, 3)
    os.rename(a, root / ".step_3.old-4242")  # moved aside; the new step_3 never arrived
    b = _save(tmp_path, 5)
    os.makedirs(root / ".step_5.old-77" / "model")  # moved aside, but the new step_5 is complete
    os.makedirs(root / ".step_6.tmp-77" / "model")  # a save killed while writing
    (root / ".keep").write_text("not a save")  # another hidden file: untouched
    recover_interrupted_saves(str(tmp_path))
    assert sorted(os.listdir(root)) == [".keep", "step_3", "step_5"]
    assert checkpoint_problem(a) is None and checkpoint_problem(b) is None
    assert load_trainer_state(a)["step"] == 3


def test_a_trainer_state_loads_with_its_fields(tmp_path):
    path = _save(tmp_path, 4, extra=torch.ones(2))
    state = load_trainer_state(path)
    assert state["step"] == 4 and state["data_position"] == 4 and torch.equal(state["extra"], torch.ones(2))


def test_a_crafted_trainer_state_is_refused_without_running_it(tmp_path):
    ran = tmp_path / "code_ran"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    path = tmp_path / "ckpt"
    path.mkdir()
    torch.save({**STATE, "x": Exploit()}, path / STATE_FILE)
    with pytest.raises(CheckpointError, match=f"checkpoint {path / STATE_FILE} cannot be loaded safely"):
        load_trainer_state(str(path))
    assert not ran.exists()


def test_a_state_without_the_trainer_fields_or_file_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    with pytest.raises(CheckpointError, match=f"checkpoint {path} has no {STATE_FILE}; it is incomplete"):
        load_trainer_state(str(path))
    torch.save({"step": 1, "rng": {}}, path / STATE_FILE)
    with pytest.raises(
        CheckpointError,
        match="is not a policygrad trainer state \\(no data_position, optimizer, scheduler, kl_controller\\)",
    ):
        load_trainer_state(str(path))
    torch.save([1, 2], path / STATE_FILE)  # not even a mapping: every field is missing
    with pytest.raises(CheckpointError, match="no step, data_position"):
        load_trainer_state(str(path))
    (path / STATE_FILE).write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load_trainer_state(str(path))


def test_a_replacement_killed_before_its_marker_keeps_the_replaced_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    old = _save(tmp_path, 3)
    os.rename(old, root / ".step_3.old-9")  # save_checkpoint moved the complete step_3 aside,
    new = _save(tmp_path, 3)
    os.remove(os.path.join(new, COMPLETE_FILE))  # renamed the new one into place, then was killed
    recover_interrupted_saves(str(tmp_path))
    assert latest_checkpoint(str(tmp_path)) == old  # step 3 is still resumable


def test_checkpoint_bytes_counts_saved_weights_and_adamw_moments():
    # Linear(3, 2): weight 6 + bias 2 parameters, float32. Both trainable: 8 x 4 bytes of weights
    # + 8 x 8 bytes of AdamW moments = 96. Bias frozen: 32 + 6 x 8 = 80 (frozen weights are saved).
    net = torch.nn.Linear(3, 2)
    assert checkpoint_bytes(net) == 96
    net.bias.requires_grad_(False)
    assert checkpoint_bytes(net) == 80
    assert checkpoint_bytes(net, critic=torch.nn.Linear(3, 2)) == 80 + 96


def test_a_disk_without_room_for_one_checkpoint_is_refused_naming_both_sizes(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    seen = []

    def disk_usage(path):
        seen.append(path)
        return usage(10**9, 10**9 - 5 * 10**6, 5 * 10**6)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    folder = tmp_path / "not" / "yet"
    check_room_for_checkpoint(str(folder), 5 * 10**6)  # exactly enough
    assert seen == [str(tmp_path)]  # the nearest folder that exists
    with pytest.raises(TrainingError) as info:
        check_room_for_checkpoint(str(folder), 5 * 10**6 + 1)
    message = str(info.value)
    assert message.startswith(f"output_dir {folder} is on a disk with 5.0 MB free, and one checkpoint")
    assert "takes about 5.0 MB" in message and not folder.exists()
    # the unit follows the size: 120 kB free against a 350 kB checkpoint reads as such, not "0 MB"
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10**9, 10**9 - 120_000, 120_000))
    small = r"with 120 kB free, and one checkpoint of this run takes about 349 kB"
    with pytest.raises(TrainingError, match=small):
        check_room_for_checkpoint(str(folder), 348_672)
    large = r"with 120 kB free, .* takes about 12 GB .* so nothing was trained"
    with pytest.raises(TrainingError, match=large):
        check_room_for_checkpoint(str(folder), 12 * 10**9)
