"""The checkpoints one :class:`~policygrad.run.Run` takes: the state a checkpoint holds (the
trainer's, :meth:`Trainer.state_dict`, and the update counts), when one is due, writing it (a
collective under FSDP), keeping the finished steps when a step fails, and loading a resume.

Where a checkpoint folder sits and how its save is made a transaction is
:mod:`policygrad.run.checkpoint`'s; the trainer is asked only through its state and a few
named questions (``shards_state``, ``saves_alone``, ``optimizer_steps()``, ``write_shards``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from policygrad.config.train import TrainConfig
from policygrad.errors import CheckpointError, CheckpointSaveError
from policygrad.parallel.distributed import Dist
from policygrad.run import directory
from policygrad.run.checkpoint import checkpoint_path, prune_checkpoints, save_checkpoint, temp_folder
from policygrad.run.health import UpdateWatch
from policygrad.run.resume import Resume

__all__ = ["Checkpoints"]

log = logging.getLogger("policygrad")


class Checkpoints:
    """The checkpoints of one run (see the module docstring).

    Args:
        config: the run's configuration (``output_dir``, ``save_every``, ``save_every_minutes``,
            ``keep_checkpoints``, ``optim.lr``).
        trainer: the run's :class:`~policygrad.trainer.loop.Trainer`.
        watch: the run's :class:`~policygrad.run.health.UpdateWatch` (its counts are saved too).
        dist: the run's :class:`~policygrad.parallel.distributed.Dist` (rank 0 writes).
        model_card: ``step -> README.md`` of the checkpoint's model folder.

    Attributes:
        saved_step: the step of the newest checkpoint on disk (None: none yet).
        config_pending: options changed on resume wait for the next checkpoint's ``config.yaml``.
    """

    def __init__(
        self,
        config: TrainConfig,
        trainer,
        watch: UpdateWatch,
        dist: Dist,
        model_card: Callable[[int], str],
    ):
        self.config, self.trainer, self.watch, self.dist = config, trainer, watch, dist
        self.run_dir = config.output_dir
        self.model_card = model_card
        self.saved_step: int | None = None
        self.config_pending = False

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's trainer state: :meth:`Trainer.state_dict` and the counts of applied
        and skipped updates (:class:`~policygrad.run.health.UpdateWatch`)."""
        return {**self.trainer.state_dict(), "updates": self.watch.state_dict()}

    def load_state_dict(self, resume: Resume) -> None:
        """Continue from a checked checkpoint: the trainer's state, the update counts, and the
        learning rate given anew on resume."""
        self.trainer.load_state_dict(resume.state, checkpoint=resume.checkpoint)
        if "updates" in resume.state:
            self.watch.load_state_dict(resume.state["updates"])
        self.saved_step = self.trainer.step_idx
        if "optim.lr" in resume.changes:
            self.trainer.set_base_lr(self.config.optim.lr)

    def due(self, last_save: float) -> bool:
        """A checkpoint is due after this step: every ``save_every`` steps, or ``save_every_minutes``
        after the last save (``last_save``, a ``time.perf_counter()``)."""
        cfg = self.config
        by_steps = bool(cfg.save_every) and self.trainer.step_idx % cfg.save_every == 0
        minutes = (time.perf_counter() - last_save) / 60
        by_time = bool(cfg.save_every_minutes) and minutes >= cfg.save_every_minutes
        return by_steps or by_time

    def save(self, state: dict[str, Any] | None = None) -> str:
        """Write ``RUN_DIR/checkpoints/step_N`` as a transaction (see
        :mod:`policygrad.run.checkpoint`) from ``state`` (default: :meth:`state_dict` now).
        Returns its path. A collective under FSDP (the ranks write their shards first).

        Raises:
            CheckpointSaveError: it could not be written; the older checkpoints are intact.
        """
        trainer = self.trainer
        state = self.state_dict() if state is None else state
        path = checkpoint_path(self.run_dir, state["step"])
        tmp, critic_state = trainer.write_shards(path, tmp=temp_folder(path))
        if self.dist.is_main:  # ddp: every rank holds the same full weights and state
            save_checkpoint(
                path,
                policy=trainer.whole_policy,
                tokenizer=trainer.tokenizer,
                state=state,
                critic=trainer.critic,
                critic_state=critic_state,
                model_card=self.model_card(state["step"]),
                tmp=tmp,
            )
            if self.config_pending:
                directory.write_config(self.run_dir, self.config)
                self.config_pending = False
            if self.config.keep_checkpoints:
                prune_checkpoints(self.run_dir, self.config.keep_checkpoints)
        if trainer.shards_state:
            self.dist.barrier()  # the checkpoint is complete before any rank goes on
        self.saved_step = state["step"]
        return path

    def safe_point(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        """The state before a step (tensors by reference: they stay valid until an optimizer
        step) and the optimizer-step counts that tell whether one happened since."""
        return self.state_dict(), self.trainer.optimizer_steps()

    def save_after_error(self, safe, exc: Exception) -> None:
        """Keep the finished steps when a step fails: save the last completed step (the state
        before the failing step, if no optimizer step of it was applied yet)."""
        state, steps_then = safe
        step = self.trainer.step_idx
        if isinstance(exc, CheckpointSaveError) or not step:
            return  # the save itself failed (the disk is full), or no step was completed
        if not self.trainer.saves_alone:
            # A sharded save needs every rank, and the others are not here: the newest checkpoint stands.
            newest = f"is of step {self.saved_step}" if self.saved_step else "does not exist yet"
            log.warning(
                "note: a sharded run cannot save after an error on one rank; the newest checkpoint %s", newest
            )
            return
        if step == state["step"] and self.trainer.optimizer_steps() != steps_then:
            log.warning(
                "note: the error came during step %d, after an optimizer step of it, so that step cannot be "
                "saved; the newest checkpoint is of step %s",
                step + 1,
                self.saved_step,
            )
            return
        if step != state["step"]:
            state = self.state_dict()  # the step completed; the error came after it
        if state["step"] in (0, self.saved_step):
            return
        try:
            path = self.save(state=state)
        except CheckpointError as e:
            log.warning("note: could not save a checkpoint before stopping: %s", e)
            return
        log.warning(
            "saved checkpoint %s before stopping on the error; once it is fixed, continue with: "
            "policygrad train --resume %s",
            path,
            self.run_dir,
        )
