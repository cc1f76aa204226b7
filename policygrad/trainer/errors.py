"""Errors a run ends with; each message says what went wrong and what to change."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointSaveError", "TrainingError"]


class TrainingError(RuntimeError):
    """The run cannot continue; the message says why and what to change."""


class CheckpointError(TrainingError):
    """A checkpoint cannot be used; the message names the folder and why."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (a full disk, a read-only folder): nothing of it was kept,
    and the checkpoints written before are intact."""
