"""The read-only checks of ``--resume`` before anything is built, the prompt-length check, and
taking the run folder (lock, ``config.yaml``, metrics log) once the run is built."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from policygrad.config.train import ConfigError, load_config
from policygrad.errors import TrainingError
from policygrad.run.checkpoint import COMPLETE_FILE, checkpoint_path, save_checkpoint
from policygrad.run.directory import Resume, check_prompts, check_resume, take_run_dir
from policygrad.run.rundir import LOCK_FILE, RunLock, write_config
from tests.tiny import make_tiny_tokenizer

pytestmark = pytest.mark.unit

STATE = {"data_position": 0, "optimizer": {}, "scheduler": {}, "kl_controller": {}, "rng": {}}


def _config(run_dir, **fields):
    tree = {
        "model": {"name": "org/model"},
        "reward": {"functions": ["r.py:f"]},
        "output_dir": str(run_dir),
        "steps": 5,
        "tensorboard": False,
    }
    for key, value in fields.items():
        tree[key] = {**tree[key], **value} if isinstance(value, dict) and key in tree else value
    return load_config(None, tree)


class _Files:
    def save_pretrained(self, folder, **_):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"w" * 10)


def _run(run_dir, *steps):
    """A run folder with ``config.yaml`` and complete checkpoints at ``steps``."""
    os.makedirs(run_dir, exist_ok=True)
    write_config(str(run_dir), _config(run_dir))
    for step in steps:
        save_checkpoint(
            checkpoint_path(str(run_dir), step),
            policy=_Files(),
            tokenizer=_Files(),
            state={**STATE, "step": step},
        )
    return str(run_dir)


def test_a_resume_takes_the_newest_checkpoint_its_state_and_the_changes(tmp_path):
    run = _run(tmp_path / "run", 1, 2)
    got = check_resume(_config(run, optim={"lr": 5e-6}), run)
    assert isinstance(got, Resume)
    assert got.checkpoint == checkpoint_path(run, 2) and got.state["step"] == 2
    assert list(got.changes) == ["optim.lr"] and got.changes["optim.lr"][1] == 5e-6
    assert check_resume(_config(run), run).changes == {}
    assert not os.path.exists(os.path.join(run, LOCK_FILE))  # read-only: nothing taken


def test_a_start_that_saved_no_checkpoint_is_told_to_start_again(tmp_path):
    run = _run(tmp_path / "run")
    with pytest.raises(TrainingError) as e:
        check_resume(_config(run), run)
    assert str(e.value) == (
        f"--resume {run}: no checkpoint found under {run}/checkpoints: the run saved no checkpoint before it "
        "stopped, so there is nothing to continue; start it again instead (its folder is taken as new): "
        f"policygrad train {run}/config.yaml [--key=value ...]"
    )


def test_no_complete_checkpoint_names_the_skipped_ones(tmp_path):
    run = _run(tmp_path / "run", 3)
    os.remove(os.path.join(checkpoint_path(run, 3), COMPLETE_FILE))
    with pytest.raises(TrainingError) as e:
        check_resume(_config(run), run)
    assert str(e.value) == (
        f"--resume {run}: no checkpoint found under {run}/checkpoints that is complete "
        "(step_3: no completion marker (its save did not finish))"
    )
    empty = str(tmp_path / "empty")  # no config.yaml either
    with pytest.raises(
        TrainingError, match=r"^--resume .*/empty: no checkpoint found under .*/empty/checkpoints$"
    ):
        check_resume(_config(empty), empty)


def test_a_resume_continues_in_its_own_folder(tmp_path):
    run = _run(tmp_path / "run", 1)
    other = tmp_path / "branch"
    with pytest.raises(ConfigError, match=rf"--resume {run} with output_dir='{other}'.*cp -r {run} {other}"):
        check_resume(_config(other), run)
    assert check_resume(_config(run + "/"), run).state["step"] == 1  # the same folder, spelled otherwise


def test_overwrite_cannot_be_combined_with_resume(tmp_path):
    run = _run(tmp_path / "run", 1)
    with pytest.raises(
        ConfigError, match=f"--overwrite cannot be combined with --resume {run}; give one of them"
    ):
        check_resume(_config(run, overwrite=True), run)


@pytest.mark.parametrize("steps", [2, 1])
def test_nothing_left_to_train_is_refused(tmp_path, steps):
    run = _run(tmp_path / "run", 2)
    with pytest.raises(ConfigError) as e:
        check_resume(_config(run, steps=steps), run)
    assert str(e.value) == (
        f"--resume {run}: the run is at step 2 of steps={steps}, so there is nothing to train; give --steps "
        "larger than 2 to continue it"
    )


def test_a_folder_in_use_is_refused(tmp_path):
    run = _run(tmp_path / "run", 1)
    lock = RunLock.acquire(run)
    try:
        # The lock of this process is live while referenced: another run owns the folder.
        with pytest.raises(TrainingError):
            check_resume(_config(run), run)
    finally:
        lock.release()
    assert check_resume(_config(run), run).state["step"] == 1


def test_options_that_cannot_change_are_refused(tmp_path):
    run = _run(tmp_path / "run", 1)
    with pytest.raises(ConfigError, match="cannot change on resume.*seed: 0 -> 3"):
        check_resume(_config(run, seed=3), run)


# ----------------------------------------------------------------------------- check_prompts


def _trainer(prompts, *, context, max_new_tokens, max_prompt_length=None):
    data = {"max_prompt_length": max_prompt_length} if max_prompt_length else {}
    cfg = _config(
        "/tmp/unused", rollout={"prompts_per_step": len(prompts), "max_new_tokens": max_new_tokens}, data=data
    )
    rows = [{"prompt": p} for p in prompts]
    return SimpleNamespace(
        config=cfg,
        stream=SimpleNamespace(position=1, source=SimpleNamespace(train_row=lambda i: rows[i - 1])),
        tokenizer=make_tiny_tokenizer(),
        policy=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context)),
    )


def test_prompts_that_fit_the_context_pass_and_the_longest_is_refused():
    # ChatML around a 2-character prompt: "<|im_start|>user\n" (1 + 5) + 2 + "<|im_end|>\n" (2)
    # + "<|im_start|>assistant\n" (1 + 10) = 21 tokens of the character tokenizer.
    short = _trainer(["hi", "ho"], context=21 + 4, max_new_tokens=4)
    check_prompts(short, [])
    long = _trainer(["hi", "hello"], context=21 + 4, max_new_tokens=4)  # 24 + 4 > 25
    with pytest.raises(
        ConfigError,
        match=r"a training prompt of 24 tokens plus rollout.max_new_tokens=4 exceeds the model's context "
        r"of 25",
    ):
        check_prompts(long, [])
    with pytest.raises(ConfigError, match="a held-out prompt of 24 tokens"):
        check_prompts(short, [{"prompt": "hello"}])


# ----------------------------------------------------------------------------- take_run_dir


def test_a_new_run_takes_its_folder_and_writes_its_config(tmp_path):
    run = tmp_path / "new"
    cfg = _config(run)
    taken = take_run_dir(cfg, model_path="org/model", step=0, resume=None, is_main=True)
    try:
        assert taken.lock is not None and not taken.config_pending
        assert {"config.yaml", LOCK_FILE} <= set(os.listdir(run))
        assert (run / "config.yaml").read_text().count("org/model") == 1
    finally:
        taken.logger.close()
        taken.lock.release()


def test_other_ranks_write_nothing(tmp_path):
    taken = take_run_dir(_config(tmp_path / "r"), model_path="m", step=0, resume=None, is_main=False)
    assert taken.lock is None and not (tmp_path / "r").exists()


def test_a_resume_refuses_a_newer_checkpoint_written_meanwhile(tmp_path):
    run = _run(tmp_path / "run", 1)
    resume = check_resume(_config(run), run)
    _run(run, 2)  # another run saved step 2 after the checks
    with pytest.raises(
        TrainingError, match="another run wrote a newer checkpoint while this one was starting"
    ):
        take_run_dir(_config(run), model_path="m", step=1, resume=resume, is_main=True)
    RunLock.acquire(run).release()  # the lock was released: the folder can be taken again


def test_a_resume_with_changes_records_them_with_the_next_checkpoint(tmp_path):
    run = _run(tmp_path / "run", 1)
    before = open(os.path.join(run, "config.yaml")).read()
    os.makedirs(os.path.join(run, "checkpoints", ".step_2.tmp-5"))  # an interrupted save
    resume = check_resume(_config(run, optim={"lr": 5e-6}), run)
    taken = take_run_dir(
        _config(run, optim={"lr": 5e-6}), model_path="m", step=1, resume=resume, is_main=True
    )
    try:
        assert taken.config_pending
        assert open(os.path.join(run, "config.yaml")).read() == before  # unchanged until the next checkpoint
        assert os.listdir(os.path.join(run, "checkpoints")) == ["step_1"]  # the interrupted save is gone
    finally:
        taken.logger.close()
        taken.lock.release()
