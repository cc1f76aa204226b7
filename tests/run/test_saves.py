"""What a run's :class:`Checkpoints` decide: when a checkpoint is due, what is saved after an
error in a step (and when it cannot be), and what a resume restores. (The cadence of a whole
run with the tiny model: tests/run/test_run.py.)"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from policygrad.config.train import load_config
from policygrad.errors import CheckpointError, CheckpointSaveError
from policygrad.learn.optim import set_base_lr
from policygrad.parallel.distributed import Dist
from policygrad.run.health import UpdateWatch
from policygrad.run.resume import Resume
from policygrad.run.saves import Checkpoints

pytestmark = pytest.mark.unit


def _fake_run(step=2, saved=1, *, saves_alone=True, last_epoch=4):
    """Checkpoints without their parts: a trainer at ``step`` (``last_epoch`` optimizer steps so
    far), the newest checkpoint at ``saved``, and a ``save`` that records what it would save."""
    run = Checkpoints.__new__(Checkpoints)
    run.run_dir, run.saved_step, run.saved = "/r", saved, []
    run.trainer = SimpleNamespace(
        step_idx=step,
        saves_alone=saves_alone,
        optimizer_steps=lambda: (last_epoch, 0),
    )
    run.state_dict = lambda: {"step": run.trainer.step_idx, "now": True}

    def save(state=None):
        run.saved.append(state)
        return f"/r/checkpoints/step_{state['step']}"

    run.save = save
    return run


def _warnings(caplog):
    return " | ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


# ----------------------------------------------------------------------------- after an error


def test_an_error_before_the_update_saves_the_state_before_the_failing_step(caplog):
    run = _fake_run(step=3, saved=2)  # step 4 failed (e.g. in its reward) before any optimizer step
    safe = ({"step": 3, "now": False}, (4, 0))
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run.save_after_error(safe, RuntimeError("reward failed"))
    assert run.saved == [{"step": 3, "now": False}]
    assert "saved checkpoint /r/checkpoints/step_3 before stopping on the error" in _warnings(caplog)
    assert "policygrad train --resume /r" in _warnings(caplog)


def test_an_error_after_a_completed_step_saves_it():
    run = _fake_run(step=4, saved=2, last_epoch=6)  # step 4 finished, then e.g. its logging failed
    run.save_after_error(({"step": 3, "now": False}, (4, 0)), RuntimeError("x"))
    assert run.saved == [{"step": 4, "now": True}]


def test_an_error_during_the_update_cannot_save_that_step(caplog):
    run = _fake_run(step=3, saved=2, last_epoch=5)  # one optimizer step of step 4 was applied
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run.save_after_error(({"step": 3}, (4, 0)), RuntimeError("x"))
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
        run.save_after_error(({"step": step}, (4, 0)), exc)
    assert run.saved == [] and _warnings(caplog) == ""


@pytest.mark.parametrize("saved, says", [(2, "is of step 2"), (None, "does not exist yet")])
def test_a_sharded_run_cannot_save_after_an_error(saved, says, caplog):
    run = _fake_run(step=3, saved=saved, saves_alone=False)
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run.save_after_error(({"step": 3}, (4, 0)), RuntimeError("x"))
    assert run.saved == []
    assert (
        _warnings(caplog)
        == f"note: a sharded run cannot save after an error on one rank; the newest checkpoint {says}"
    )


def test_a_failed_save_after_an_error_is_a_note(caplog):
    run = _fake_run(step=3, saved=2)

    def fail(state=None):  # noqa: ARG001 (Checkpoints.save's signature: called with state=)
        raise CheckpointError("no room")

    run.save = fail
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run.save_after_error(({"step": 3}, (4, 0)), RuntimeError("x"))
    assert _warnings(caplog) == "note: could not save a checkpoint before stopping: no room"


# ----------------------------------------------------------------------------- cadence


def test_a_checkpoint_is_due_by_steps_or_by_minutes():
    run = _fake_run(step=4)
    run.config = SimpleNamespace(save_every=2, save_every_minutes=0)
    now = time.perf_counter()
    assert run.due(now - 3600)  # step 4 of every 2 (minutes off)
    run.trainer.step_idx = 3
    assert not run.due(now - 3600)
    run.config = SimpleNamespace(save_every=0, save_every_minutes=1.0)
    assert run.due(time.perf_counter() - 61) and not run.due(time.perf_counter())


# ----------------------------------------------------------------------------- resume


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
    trainer = SimpleNamespace(
        step_idx=5,
        load_state_dict=lambda state, checkpoint: loaded.append((state, checkpoint)),
        set_base_lr=lambda lr: set_base_lr(optimizer, scheduler, lr),  # as Trainer.set_base_lr
    )
    run = Checkpoints(cfg, trainer, UpdateWatch(cfg), Dist(), model_card=str)
    state = {"step": 5, "updates": {"applied": 4, "steps": 5, "empty_in_a_row": 1}}
    run.load_state_dict(Resume("/r/checkpoints/step_5", state, {"optim.lr": (1e-3, 4e-4)}))
    assert loaded == [(state, "/r/checkpoints/step_5")]
    assert (run.watch.applied, run.watch.steps, run.watch.empty_in_a_row) == (4, 5, 1)
    assert run.saved_step == 5
    # the schedule keeps its position: factor 1 / (3 + 1) at step 3, so lr = 4e-4 / 4 = 1e-4.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4, rel=1e-12)
    assert scheduler.last_epoch == 3
