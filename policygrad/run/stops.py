"""What a run says when it stops before its end: how to go on, what a full disk lost, and the one
warning of each kind of stop (before the first step, after a step, after the final checkpoint, at
once on a second Ctrl-C)."""

from __future__ import annotations

import logging
import os

from policygrad.run.checkpoint import checkpoint_path

__all__ = [
    "how_to_go_on",
    "unsaved_steps",
    "warn_stopped_after_step",
    "warn_stopped_at_once",
    "warn_stopped_twice",
]

log = logging.getLogger("policygrad")


def how_to_go_on(run_dir: str, saved_step: int | None) -> str:
    """Resume the newest checkpoint, or, with none saved, start again (the folder of a start that
    saved no checkpoint is taken as new)."""
    if saved_step is not None:
        return f"continue with: policygrad train --resume {run_dir}"
    return f"run the same command again: no checkpoint was saved, so the run starts over in {run_dir}"


def warn_stopped_at_once(
    signal_name: str, run_dir: str, saved_step: int | None, step: int, *, steps_done: bool
) -> None:
    """A signal stopped the run where there was nothing to wait for: before its first step (a
    new or a resumed run), or after its final checkpoint (``steps_done``)."""
    if saved_step is None:
        log.warning(
            "stopped by %s before the first step; nothing was trained or saved; %s",
            signal_name,
            how_to_go_on(run_dir, saved_step),
        )
    elif not steps_done:  # a resumed run, before its first step
        log.warning(
            "stopped by %s before step %d; checkpoint %s is saved; %s",
            signal_name,
            step + 1,
            checkpoint_path(run_dir, saved_step),
            how_to_go_on(run_dir, saved_step),
        )
    else:
        log.warning(
            "stopped by %s after the final checkpoint %s (step %d), before the run's end; the trained "
            "model is %s",
            signal_name,
            checkpoint_path(run_dir, saved_step),
            saved_step,
            os.path.join(checkpoint_path(run_dir, saved_step), "model"),
        )


def warn_stopped_after_step(signal_name: str, run_dir: str, saved_step: int | None, step: int) -> None:
    """A signal stopped the run after the current step (checkpoint saved, if any step was done)."""
    if saved_step is None:
        log.warning(
            "stopped by %s before the first step; nothing was trained or saved; %s",
            signal_name,
            how_to_go_on(run_dir, saved_step),
        )
    else:
        log.warning(
            "stopped by %s after step %d; checkpoint %s is saved; %s",
            signal_name,
            step,
            checkpoint_path(run_dir, saved_step),
            how_to_go_on(run_dir, saved_step),
        )


def warn_stopped_twice(run_dir: str, saved_step: int | None) -> None:
    """A second Ctrl-C stopped the run at once: the newest checkpoint and how to go on."""
    if saved_step:
        log.warning(
            "stopped at once; the newest checkpoint is %s; continue with: policygrad train --resume %s",
            checkpoint_path(run_dir, saved_step),
            run_dir,
        )
    else:
        log.warning(
            "stopped at once, before any checkpoint was saved; run the same command again to start over"
        )


def unsaved_steps(step: int, saved_step: int | None) -> str:
    """What a stop on a full disk loses: the completed steps after the newest checkpoint (the
    save after the error could not be written either), said so the user knows, or ''."""
    saved = saved_step or 0
    if step <= saved:
        return ""
    steps = f"step {step}" if step == saved + 1 else f"steps {saved + 1}-{step}"
    newest = f" (the newest checkpoint is of step {saved})" if saved else ""
    return f"the training of {steps} could not be saved on the full disk{newest} and is lost; "
