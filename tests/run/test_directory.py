"""The pieces that keep a run safe, without a model: the run directory's layout, its lock and
its files, checkpoint transactions and completeness, ``metrics.jsonl`` with a torn last line,
the stop signals and the CLI's one-line errors."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from policygrad import cli
from policygrad.config.train import ConfigError, load_config
from policygrad.errors import TrainingError
from policygrad.run.checkpoint import (
    COMPLETE_FILE,
    CheckpointSaveError,
    checkpoint_path,
    checkpoint_problem,
    find_checkpoints,
    latest_checkpoint,
    prune_checkpoints,
    recover_interrupted_saves,
    save_checkpoint,
)
from policygrad.run.directory import (
    LOCK_FILE,
    RunLock,
    check_new_run_dir,
    checkpoints_dir,
    config_file,
    eval_file,
    holds_run,
    lock_owner,
    merged_model_dir,
    metrics_file,
    remove_run_files,
    run_files,
    start_model_dir,
    summary_file,
    write_config,
    write_summary,
)
from policygrad.run.interrupts import StopSignals
from policygrad.run.logging import MetricsLogger, read_metrics_rows

pytestmark = pytest.mark.unit


class FakeModel:
    """Writes a model folder like ``save_pretrained``; ``fail_after`` raises ENOSPC after that
    many bytes of its weights file."""

    def __init__(self, fail_after: int | None = None, payload: bytes = b"w" * 1000):
        self.fail_after, self.payload = fail_after, payload

    def save_pretrained(self, folder, **_):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            if self.fail_after is None:
                f.write(self.payload)
                return
            f.write(self.payload[: self.fail_after])
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(folder, "model.safetensors"))


class FakeTokenizer:
    def save_pretrained(self, folder, **_):
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write("{}")


def _save(run, step, model=None):
    return save_checkpoint(
        os.path.join(run, "checkpoints", f"step_{step}"),
        policy=model or FakeModel(),
        tokenizer=FakeTokenizer(),
        state={"step": step, "x": torch.zeros(3)},
    )


# ----------------------------------------------------------------------------- layout


def test_the_layout_names_each_file_and_each_is_one_a_run_wrote(tmp_path):
    run = str(tmp_path)
    assert config_file(run) == os.path.join(run, "config.yaml")
    assert metrics_file(run) == os.path.join(run, "metrics.jsonl")
    assert summary_file(run) == os.path.join(run, "summary.json")
    assert eval_file(run, "eval_step3") == os.path.join(run, "eval_step3.jsonl")
    assert checkpoints_dir(run) == os.path.join(run, "checkpoints")
    assert checkpoint_path(run, 2) == os.path.join(run, "checkpoints", "step_2")
    assert merged_model_dir(run) == os.path.join(run, "merged_model")
    assert start_model_dir(run) == os.path.join(run, "start_model")
    # Every path the layout names is one --overwrite recognises as the run's (run_files).
    write_summary(run, {"steps": 1})
    assert json.load(open(summary_file(run))) == {"steps": 1}
    for path in (metrics_file(run), eval_file(run, "eval_before"), eval_file(run, "eval_after")):
        open(path, "w").close()
    for folder in (checkpoint_path(run, 2), merged_model_dir(run), start_model_dir(run)):
        os.makedirs(folder)
    write_config(run, load_config(None, {"output_dir": run}))
    named = [
        config_file(run),
        metrics_file(run),
        summary_file(run),
        eval_file(run, "eval_before"),
        eval_file(run, "eval_after"),
        checkpoint_path(run, 2),
        merged_model_dir(run),
        start_model_dir(run),
    ]
    assert sorted(run_files(run)) == sorted(named)
    assert run_files(run, keep=("start_model",)) == sorted(set(named) - {start_model_dir(run)})


# ----------------------------------------------------------------------------- checkpoints


class TorchWriteFails:
    """A model whose save fails the way torch.save does on a full disk: a RuntimeError that
    never says so."""

    def save_pretrained(self, folder, **_):
        os.makedirs(folder, exist_ok=True)
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 261965440 vs 261965332"
        )


def test_a_failed_write_on_a_nearly_full_disk_says_the_disk_is_probably_full(tmp_path, monkeypatch):
    import shutil as shutil_module

    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(
        "policygrad.run.checkpoint.shutil.disk_usage", lambda _p: usage._replace(free=300 * 2**20)
    )
    with pytest.raises(
        CheckpointSaveError, match=r"step_1: the disk is probably full \(300 MiB free; RuntimeError"
    ):
        _save(tmp_path, 1, TorchWriteFails())
    monkeypatch.setattr(
        "policygrad.run.checkpoint.shutil.disk_usage", lambda _p: usage._replace(free=50 * 2**30)
    )
    with pytest.raises(CheckpointSaveError, match=r"step_1: RuntimeError: \[enforce fail"):
        _save(tmp_path, 1, TorchWriteFails())


def test_a_checkpoint_is_complete_only_with_its_marker_and_sizes(tmp_path):
    path = _save(tmp_path, 1)
    assert checkpoint_problem(path) is None
    marker = json.load(open(os.path.join(path, COMPLETE_FILE)))
    assert set(marker["files"]) == {"model/model.safetensors", "model/tokenizer.json", "trainer_state.pt"}
    with open(os.path.join(path, "model", "model.safetensors"), "ab") as f:
        f.write(b"!")
    assert "model/model.safetensors has 1001 bytes, not the 1000" in checkpoint_problem(path)
    os.remove(os.path.join(path, COMPLETE_FILE))
    assert checkpoint_problem(path) == "no completion marker (its save did not finish)"


def test_resume_takes_the_newest_complete_checkpoint_and_says_why(tmp_path, caplog):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    half = tmp_path / "checkpoints" / "step_3"
    (half / "model").mkdir(parents=True)  # a save killed before its marker
    with caplog.at_level(logging.INFO, logger="policygrad"):
        assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoints" / "step_2")
    assert f"skipped checkpoint {half}: no completion marker" in caplog.text
    assert "newest complete checkpoint: " in caplog.text
    assert find_checkpoints(str(tmp_path / "none")) == (None, [])


def test_a_failed_save_leaves_nothing_and_the_previous_checkpoint_intact(tmp_path):
    first = _save(tmp_path, 1)
    before = {n: open(os.path.join(first, n), "rb").read() for n in ("trainer_state.pt", COMPLETE_FILE)}
    with pytest.raises(CheckpointSaveError, match=r"step_2: No space left on device \(.*model.safetensors\)"):
        _save(tmp_path, 2, FakeModel(fail_after=100))
    assert os.listdir(tmp_path / "checkpoints") == ["step_1"]
    assert {n: open(os.path.join(first, n), "rb").read() for n in before} == before
    # Saving the same step again replaces it; if that fails, the old one comes back.
    with pytest.raises(CheckpointSaveError):
        _save(tmp_path, 1, FakeModel(fail_after=10))
    assert checkpoint_problem(first) is None and os.listdir(tmp_path / "checkpoints") == ["step_1"]


def test_an_interrupted_replacement_is_put_back(tmp_path):
    path = _save(tmp_path, 4)
    root = tmp_path / "checkpoints"
    os.rename(path, root / ".step_4.old-123")  # killed between moving the old one aside ...
    (root / ".step_4.tmp-123").mkdir()  # ... and renaming the new one into place
    recover_interrupted_saves(str(tmp_path))
    assert os.listdir(root) == ["step_4"] and checkpoint_problem(path) is None


# ----------------------------------------------------------------------------- metrics.jsonl


def test_a_torn_last_metrics_line_is_dropped_naming_the_file(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1}\n{"step": 2, "a": 2}\n{"step": 3, "a"')
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        logger = MetricsLogger(str(tmp_path), tensorboard=False, truncate_after_step=2)
    assert f"{path}: dropped its torn last line" in caplog.text
    logger.log(3, {"a": 3.0})
    assert [r["step"] for r in read_metrics_rows(str(path))] == [1, 2, 3]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(TrainingError, match=f"{path}: line 2 is not a JSON row"):
        read_metrics_rows(str(path))


# ----------------------------------------------------------------------------- the run directory


def test_a_new_run_refuses_a_run_and_a_foreign_config_and_overwrite_deletes_only_run_files(tmp_path):
    run = tmp_path / "run"
    assert run_files(str(run)) == []
    check_new_run_dir(str(run), overwrite=False)  # absent: fine, and still absent
    assert not run.exists()
    run.mkdir()
    write_config(str(run), load_config(None, {"overwrite": True}))
    assert "overwrite" not in yaml.safe_load((run / "config.yaml").read_text())
    for name in ("metrics.jsonl", "summary.json", "eval_before.jsonl", "eval_step10.jsonl", "notes.txt"):
        (run / name).write_text("x")
    _save(run, 1)
    (run / "checkpoints" / "mine").mkdir()
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host").write_text("x")
    with pytest.raises(ConfigError, match="already holds a run; continue it with --resume"):
        check_new_run_dir(str(run), overwrite=False)
    check_new_run_dir(str(run), overwrite=True)
    remove_run_files(str(run))
    assert sorted(os.listdir(run)) == ["checkpoints", "notes.txt"]
    assert os.listdir(run / "checkpoints") == ["mine"]
    (run / "config.yaml").write_text("name: my project\n")
    with pytest.raises(ConfigError, match="holds a config.yaml that is not a policygrad run's"):
        check_new_run_dir(str(run), overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        check_new_run_dir(str(tmp_path / "file"), overwrite=True)


def test_what_a_start_without_a_checkpoint_left_is_no_run_but_a_step_or_export_is(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_config(str(run), load_config(None, {}))
    for name in ("metrics.jsonl", "eval_before.jsonl", "notes.txt"):
        (run / name).write_text("x")
    (run / "summary.json").write_text(json.dumps({"steps": 0, "interrupted": "SIGTERM"}))
    (run / "checkpoints" / ".step_1.tmp-7").mkdir(parents=True)  # a save that never completed
    assert not holds_run(str(run))
    check_new_run_dir(str(run), overwrite=False)  # the corrected command may start here
    for kept in ("summary", "merged_model", "checkpoint"):
        if kept == "summary":
            (run / "summary.json").write_text(json.dumps({"steps": 3}))
        elif kept == "merged_model":
            (run / "summary.json").unlink()
            (run / "merged_model").mkdir()
        else:
            (run / "merged_model").rmdir()
            (run / "checkpoints" / "step_1").mkdir()  # complete or not, never deleted unasked
        assert holds_run(str(run)), kept
        with pytest.raises(ConfigError, match="already holds a run"):
            check_new_run_dir(str(run), overwrite=False)


def test_overwrite_deletes_the_trackers_stores_of_the_old_run(tmp_path):
    # W&B's offline runs, MLflow's file store and the tracker ids a resume continues: kept, they
    # would put the old run's tracker data beside the new run's.
    run = tmp_path / "run"
    (run / "wandb" / "offline-run-20260101_000000-abc").mkdir(parents=True)
    (run / "wandb" / "offline-run-20260101_000000-abc" / "run-abc.wandb").write_text("x")
    (run / "mlruns" / "1" / "0123").mkdir(parents=True)
    (run / "trackers.json").write_text('{"wandb_run_id": "abc"}')
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / "step_1").mkdir(parents=True)  # what makes the folder hold a run
    assert holds_run(str(run))
    with pytest.raises(ConfigError, match="already holds a run"):
        check_new_run_dir(str(run), overwrite=False)
    removed = remove_run_files(str(run))
    assert {"mlruns", "trackers.json", "wandb"} <= {os.path.basename(p) for p in removed}
    assert os.listdir(run) == ["notes.txt"]


HOLDER = textwrap.dedent(
    """
    import fcntl, json, os, socket, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": 1.7e9}).encode())
    print("locked", flush=True)
    sys.stdin.read()
    """
)


def test_a_directory_has_one_owner_and_a_dead_owner_is_taken_over(tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run / LOCK_FILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert lock_owner(str(run))["pid"] == holder.pid
        with pytest.raises(
            TrainingError, match=rf"in use by another run \(pid {holder.pid} on .*, started 2023-"
        ):
            RunLock.acquire(str(run))
        with pytest.raises(TrainingError, match="in use by another run"):
            check_new_run_dir(str(run), overwrite=True)
    finally:
        holder.kill()  # dies holding it: the kernel drops the flock, the file stays
        holder.wait()
    assert lock_owner(str(run)) is None
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        lock = RunLock.acquire(str(run))
    assert f"took over the lock of {run}: a run (pid {holder.pid} on " in caplog.text
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    with pytest.raises(TrainingError, match="in use by another Trainer in this process"):
        RunLock.acquire(str(run))
    lock.release()
    lock.release()
    assert not (run / LOCK_FILE).exists()


# ----------------------------------------------------------------------------- resume


# ----------------------------------------------------------------------------- runs that train nothing


# ----------------------------------------------------------------------------- signals and errors


def test_the_first_stop_signal_is_noted_and_the_second_stops_at_once():
    # Python's own handler to start from: a process started in the background by a shell
    # inherits SIGINT ignored, and StopSignals restores whatever it found.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGTERM)
            assert signals.received == "SIGTERM"
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


@pytest.mark.parametrize(
    "error, expected",
    [
        (MemoryError(), "error: out of memory (MemoryError); lower rollout.prompts_per_step"),
        (
            RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB"),
            "error: out of memory (DefaultCPUAllocator: not enough memory",
        ),
        (  # what torch raises on Linux when the allocation itself fails (torch.empty(2**46))
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 281474976710656 bytes. Error code 12 (Cannot allocate memory)"
            ),
            "error: out of memory ([enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't",
        ),
        (
            OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl"),
            "error: no space left on device writing /runs/x/metrics.jsonl; free space",
        ),
        (TrainingError("checkpoint x is corrupt"), "error: checkpoint x is corrupt"),
    ],
)
def test_user_errors_end_in_one_line(error, expected, monkeypatch, capsys):
    def fails(_argv):
        raise error

    monkeypatch.setitem(cli.COMMANDS, "train", fails)
    monkeypatch.delenv("POLICYGRAD_DEBUG", raising=False)
    assert cli.main(["train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1
    monkeypatch.setenv("POLICYGRAD_DEBUG", "1")
    with pytest.raises(type(error)):
        cli.main(["train"])


def test_keep_checkpoints_deletes_only_older_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    half = tmp_path / "checkpoints" / "step_5"
    (half / "model").mkdir(parents=True)  # a save in progress (or killed): not this function's
    deleted = prune_checkpoints(str(tmp_path), 2)
    assert deleted == [str(tmp_path / "checkpoints" / f"step_{n}") for n in (1, 2)]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_3", "step_4", "step_5"]
    assert prune_checkpoints(str(tmp_path), 2) == []  # nothing more to delete
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoints" / "step_4")
    assert prune_checkpoints(str(tmp_path / "no_run"), 1) == []
