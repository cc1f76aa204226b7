"""What a stopped run says: how to go on (resume, or start again when nothing was saved) and the
one warning of each kind of stop."""

from __future__ import annotations

import logging
import os

import pytest

from policygrad.run.stops import how_to_go_on, warn_stopped_after_step, warn_stopped_at_once

pytestmark = pytest.mark.unit


def test_how_to_go_on_resumes_a_saved_run():
    assert how_to_go_on("/runs/a", 3) == "continue with: policygrad train --resume /runs/a"


def test_how_to_go_on_starts_again_without_a_checkpoint():
    assert how_to_go_on("/runs/a", None) == (
        "run the same command again: no checkpoint was saved, so the run starts over in /runs/a"
    )


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_stopped_before_the_first_step_of_a_new_run(caplog):
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        warn_stopped_at_once("SIGTERM", "/r", None, 0, steps_done=False)
        warn_stopped_after_step("SIGINT", "/r", None, 0)
    assert _warnings(caplog) == [
        f"stopped by {sig} before the first step; nothing was trained or saved; {how_to_go_on('/r', None)}"
        for sig in ("SIGTERM", "SIGINT")
    ]


def test_stopped_before_the_first_step_of_a_resumed_run_names_the_next_step(caplog):
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        warn_stopped_at_once("SIGTERM", "/r", 4, 4, steps_done=False)
    ckpt = os.path.join("/r", "checkpoints", "step_4")
    assert _warnings(caplog) == [
        f"stopped by SIGTERM before step 5; checkpoint {ckpt} is saved; "
        "continue with: policygrad train --resume /r"
    ]


def test_stopped_after_the_final_checkpoint_names_the_trained_model(caplog):
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        warn_stopped_at_once("SIGINT", "/r", 6, 6, steps_done=True)
    ckpt = os.path.join("/r", "checkpoints", "step_6")
    (text,) = _warnings(caplog)
    assert text == (
        f"stopped by SIGINT after the final checkpoint {ckpt} (step 6), before the run's end; "
        f"the trained model is {os.path.join(ckpt, 'model')}"
    )
    assert "--resume" not in text  # nothing is left to train


def test_stopped_after_a_step(caplog):
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        warn_stopped_after_step("SIGTERM", "/r", 2, 3)
    ckpt = os.path.join("/r", "checkpoints", "step_2")
    assert _warnings(caplog) == [
        f"stopped by SIGTERM after step 3; checkpoint {ckpt} is saved; "
        "continue with: policygrad train --resume /r"
    ]
