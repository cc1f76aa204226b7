"""What :class:`Run` decides around the steps: when a checkpoint is due, what it saves after an
error in a step (and when it cannot), which signal stops the ranks, what a resume restores,
and, with the tiny model, the save cadence of a whole run. (End-to-end behaviour of runs:
tests/trainer/test_loop.py and tests/trainer/test_runs_are_sacred.py.)"""

from __future__ import annotations

import json
import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch

from policygrad.config.train import load_config
from policygrad.errors import CheckpointError, CheckpointSaveError
from policygrad.learn.health import UpdateWatch
from policygrad.parallel.distributed import Dist
from policygrad.run import Run
from policygrad.run.checkpoint import checkpoint_problem, load_trainer_state
from policygrad.run.directory import Resume
from policygrad.run.rundir import RunLock

pytestmark = pytest.mark.integration  # the last test trains the tiny model; the others need none


def _fake_run(step=2, saved=1, *, saves_alone=True, last_epoch=4):
    """A Run without its parts: a trainer at ``step`` (``last_epoch`` optimizer steps so far), the
    newest checkpoint at ``saved``, and a ``save_checkpoint`` that records what it would save."""
    run = Run.__new__(Run)
    run.run_dir, run._saved_step, run.saved = "/r", saved, []
    run.trainer = SimpleNamespace(
        step_idx=step,
        strategy=SimpleNamespace(saves_alone=saves_alone),
        scheduler=SimpleNamespace(last_epoch=last_epoch),
        critic_trainer=None,
    )
    run.state_dict = lambda: {"step": run.trainer.step_idx, "now": True}

    def save(state=None):
        run.saved.append(state)
        return f"/r/checkpoints/step_{state['step']}"

    run.save_checkpoint = save
    return run


def _warnings(caplog):
    return " | ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


# ----------------------------------------------------------------------------- after an error


def test_an_error_before_the_update_saves_the_state_before_the_failing_step(caplog):
    run = _fake_run(step=3, saved=2)  # step 4 failed (e.g. in its reward) before any optimizer step
    safe = ({"step": 3, "now": False}, (4, 0))
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run._save_after_error(safe, RuntimeError("reward failed"))
    assert run.saved == [{"step": 3, "now": False}]
    assert "saved checkpoint /r/checkpoints/step_3 before stopping on the error" in _warnings(caplog)
    assert "policygrad train --resume /r" in _warnings(caplog)


def test_an_error_after_a_completed_step_saves_it():
    run = _fake_run(step=4, saved=2, last_epoch=6)  # step 4 finished, then e.g. its logging failed
    run._save_after_error(({"step": 3, "now": False}, (4, 0)), RuntimeError("x"))
    assert run.saved == [{"step": 4, "now": True}]


def test_an_error_during_the_update_cannot_save_that_step(caplog):
    run = _fake_run(step=3, saved=2, last_epoch=5)  # one optimizer step of step 4 was applied
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run._save_after_error(({"step": 3}, (4, 0)), RuntimeError("x"))
    assert run.saved == []
    assert (
        "the error came during step 4, after an optimizer step of it, so that step cannot be saved; the "
        "newest checkpoint is of step 2" in _warnings(caplog)
    )


@pytest.mark.parametrize(
    "step, saved, exc",
    [
        (0, None, RuntimeError("x")),  # no step completed
        (3, 3, RuntimeError("x")),  # the last completed step is saved already
        (3, 2, CheckpointSaveError("disk full")),  # the save itself failed
    ],
)
def test_nothing_to_save_after_an_error(step, saved, exc, caplog):
    run = _fake_run(step=step, saved=saved)
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run._save_after_error(({"step": step}, (4, 0)), exc)
    assert run.saved == [] and _warnings(caplog) == ""


@pytest.mark.parametrize("saved, says", [(2, "is of step 2"), (None, "does not exist yet")])
def test_a_sharded_run_cannot_save_after_an_error(saved, says, caplog):
    run = _fake_run(step=3, saved=saved, saves_alone=False)
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run._save_after_error(({"step": 3}, (4, 0)), RuntimeError("x"))
    assert run.saved == []
    assert (
        _warnings(caplog)
        == f"note: a sharded run cannot save after an error on one rank; the newest checkpoint {says}"
    )


def test_a_failed_save_after_an_error_is_a_note(caplog):
    run = _fake_run(step=3, saved=2)

    def fail(state=None):  # noqa: ARG001 (Run.save_checkpoint's signature: called with state=)
        raise CheckpointError("no room")

    run.save_checkpoint = fail
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run._save_after_error(({"step": 3}, (4, 0)), RuntimeError("x"))
    assert _warnings(caplog) == "note: could not save a checkpoint before stopping: no room"


# ----------------------------------------------------------------------------- cadence and signals


def test_a_checkpoint_is_due_by_steps_or_by_minutes():
    run = _fake_run(step=4)
    run.config = SimpleNamespace(save_every=2, save_every_minutes=0)
    now = time.perf_counter()
    assert run._checkpoint_due(now - 3600)  # step 4 of every 2 (minutes off)
    run.trainer.step_idx = 3
    assert not run._checkpoint_due(now - 3600)
    run.config = SimpleNamespace(save_every=0, save_every_minutes=1.0)
    assert run._checkpoint_due(time.perf_counter() - 61) and not run._checkpoint_due(time.perf_counter())


def test_the_signal_that_stops_the_ranks():
    run = _fake_run()
    run.dist = Dist()
    assert run._agreed_signal("SIGINT") == "SIGINT" and run._agreed_signal(None) is None
    anyone = SimpleNamespace(active=True, any=lambda _flag: True)
    run.dist = anyone  # another rank received one: this rank stops too (SIGTERM when it got none)
    assert run._agreed_signal(None) == "SIGTERM" and run._agreed_signal("SIGINT") == "SIGINT"
    run.dist = SimpleNamespace(active=True, any=lambda flag: flag)
    assert run._agreed_signal(None) is None


def test_no_held_out_rows_evaluate_to_nan():
    run = _fake_run()
    run.eval_rows, run.dist = [], Dist()
    scores, records = run.evaluate()
    assert list(scores) == ["eval/accuracy"] and scores["eval/accuracy"] != scores["eval/accuracy"]
    assert records == []


# ----------------------------------------------------------------------------- state


def test_load_state_dict_restores_the_counts_and_a_new_base_lr(tmp_path):
    cfg = load_config(
        None,
        {
            "model": {"name": "m"},
            "reward": {"functions": ["answer_correctness"]},
            "output_dir": str(tmp_path),
            "optim": {"lr": 4e-4},
        },
    )
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    loaded = []
    run = Run.__new__(Run)
    run.config, run.watch = cfg, UpdateWatch(cfg)
    run.trainer = SimpleNamespace(
        optimizer=optimizer,
        scheduler=scheduler,
        step_idx=5,
        load_state_dict=lambda state, checkpoint: loaded.append((state, checkpoint)),
    )
    state = {"step": 5, "updates": {"applied": 4, "steps": 5, "empty_in_a_row": 1}}
    run.load_state_dict(Resume("/r/checkpoints/step_5", state, {"optim.lr": (1e-3, 4e-4)}))
    assert loaded == [(state, "/r/checkpoints/step_5")]
    assert (run.watch.applied, run.watch.steps, run.watch.empty_in_a_row) == (4, 5, 1)
    assert run._saved_step == 5
    # the schedule keeps its position: factor 1 / (3 + 1) at step 3, so lr = 4e-4 / 4 = 1e-4.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4, rel=1e-12)
    assert scheduler.last_epoch == 3


# ----------------------------------------------------------------------------- a whole tiny run


def count_digits(_prompts, completions, **_fields):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.mark.usefixtures("one_thread")
def test_checkpoints_follow_save_every_and_the_final_step(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        {
            "steps": 3,
            "save_every": 2,
            "save_every_minutes": 0,
            "output_dir": str(run_dir),
            "progress": False,
            "tensorboard": False,
            "eval_before": False,
            "eval_after": False,
            "log_completions": 0,
            "model": {"name": tiny_model_dir},
            "data": {"eval_size": 0, "difficulty": "easy"},
            "rollout": {"engine": "hf", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
            "reward": {"functions": ["tests.run.test_run:count_digits"], "isolation": False},
            "optim": {"lr": 1e-3, "micro_batch_size": 4},
        },
    )
    run = Run(cfg)
    summary = run.train()
    assert summary["steps"] == 3
    names = sorted(os.listdir(run_dir / "checkpoints"))
    assert names == ["step_2", "step_3"]  # every 2 steps, and the final one; not step 1
    for name in names:
        assert checkpoint_problem(str(run_dir / "checkpoints" / name)) is None
    state = load_trainer_state(str(run_dir / "checkpoints" / "step_3"))
    assert state["step"] == 3 and state["updates"]["steps"] == 3
    assert json.load(open(run_dir / "summary.json"))["steps"] == 3
    run.close()  # after train(): safe, and the folder is free
    RunLock.acquire(str(run_dir)).release()
