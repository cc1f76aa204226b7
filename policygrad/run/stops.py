"""What a run says when it stops before its end: how to go on, and the one warning of each kind
of stop (before the first step, after a step, after the final checkpoint)."""

from __future__ import annotations

import logging
import os

from policygrad.run.checkpoint import checkpoint_path

__all__ = ["how_to_go_on", "warn_stopped_after_step", "warn_stopped_at_once"]

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
