"""Errors a run ends with; each message says what went wrong and what to change."""

from __future__ import annotations

__all__ = ["CheckpointError", "CheckpointSaveError", "TrainingError"]  # and the message fsdp_lora_refusal


def fsdp_lora_refusal(*, strategy: str, lora: str, ddp: str) -> str:
    """Why FSDP with LoRA is refused, in the words of the command that refuses it: ``train``
    (``distributed.strategy`` ...) and ``policygrad memory`` (``--strategy`` ...) say the same, so
    the planner never prices a job the trainer will not run. Torch-free (the planner imports it)."""
    return (
        f"{strategy}=fsdp shards full fine-tuning; a LoRA run ({lora}) trains a small adapter that every "
        f"rank can hold: set {ddp}"
    )


class TrainingError(RuntimeError):
    """The run cannot continue; the message says why and what to change."""


class CheckpointError(TrainingError):
    """A checkpoint cannot be used; the message names the folder and why."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (a full disk, a read-only folder): nothing of it was kept,
    and the checkpoints written before are intact."""
