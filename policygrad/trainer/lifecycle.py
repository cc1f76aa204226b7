"""The life of a run around its steps: checks before anything is written, taking the run
directory, the training loop with its checkpoint cadence, interrupts and failures, evaluation,
checkpoints, the model card and the merged export. :class:`~policygrad.trainer.loop.Trainer`
inherits these methods; the RL step itself lives in ``loop.py``."""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from typing import Any

from policygrad.data.chat import encode_prompts
from policygrad.trainer import build, rundir
from policygrad.trainer.checkpoint import (
    checkpoint_path,
    find_checkpoints,
    latest_checkpoint,
    load_trainer_state,
    recover_interrupted_saves,
    save_checkpoint,
    trainer_state,
)
from policygrad.trainer.config import ConfigError
from policygrad.trainer.distributed import NullLogger
from policygrad.trainer.errors import CheckpointError, CheckpointSaveError, TrainingError
from policygrad.trainer.evaluate import evaluate as evaluate_rows
from policygrad.trainer.evaluate import write_jsonl
from policygrad.trainer.interrupts import Stopped, StopSignals
from policygrad.trainer.logging import MetricsLogger, peak_rss_gb
from policygrad.trainer.resume import TRAINING_OPTIONS, config_changes
from policygrad.trainer.trackers import build_trackers, read_tracker_ids

__all__ = ["RunLifecycle"]

log = logging.getLogger("policygrad")


class RunLifecycle:
    """The run-level methods of :class:`~policygrad.trainer.loop.Trainer` (a mixin: it reads the
    trainer's attributes set up in ``Trainer.__init__``)."""

    def _check_resume(self, resume_from: str):
        """Read-only checks of ``--resume``: the newest complete checkpoint, its trainer state,
        the folder not in use, and the options that changed (see :mod:`policygrad.trainer.resume`).

        Returns:
            ``(checkpoint path, trainer state, {changed field: (saved, new)})``.
        """
        cfg = self.config
        ckpt = latest_checkpoint(resume_from)
        if ckpt is None:
            _, skipped = find_checkpoints(resume_from)
            saved = os.path.join(resume_from, "config.yaml")
            if not skipped and os.path.isfile(saved) and not rundir.holds_run(resume_from):
                # A start that failed before its first checkpoint: starting again is what works.
                raise TrainingError(
                    f"--resume {resume_from}: no checkpoint found under {resume_from}/checkpoints: the run "
                    "saved no checkpoint before it stopped, so there is nothing to continue; start it again "
                    f"instead (its folder is taken as new): policygrad train {saved} [--key=value ...]"
                )
            why = "; ".join(f"{os.path.basename(p)}: {reason}" for p, reason in skipped)
            raise TrainingError(
                f"--resume {resume_from}: no checkpoint found under {resume_from}/checkpoints"
                + (f" that is complete ({why})" if skipped else "")
            )
        if os.path.realpath(cfg.output_dir) != os.path.realpath(resume_from):
            raise ConfigError(
                f"--resume {resume_from} with output_dir={cfg.output_dir!r}: a resumed run continues in its "
                f"own folder; to branch it, copy the folder (cp -r {resume_from} {cfg.output_dir}) and "
                "resume the copy"
            )
        if cfg.overwrite:
            raise ConfigError(f"--overwrite cannot be combined with --resume {resume_from}; give one of them")
        rundir.check_not_in_use(resume_from)
        changes = config_changes(resume_from, cfg)
        read_tracker_ids(resume_from)  # a corrupt file is refused now, not after the run is taken
        state = load_trainer_state(ckpt)
        if state["step"] >= cfg.steps:
            raise ConfigError(
                f"--resume {resume_from}: the run is at step {state['step']} of steps={cfg.steps}, so there "
                f"is nothing to train; give --steps larger than {state['step']} to continue it"
            )
        return ckpt, state, changes

    def _check_prompts(self) -> None:
        """The first batch's prompts and the held-out ones fit ``data.max_prompt_length``, and
        each plus ``rollout.max_new_tokens`` fits the model's context.

        Raises:
            ValueError / ConfigError: naming the prompt, its length and the fix.
        """
        cfg = self.config
        position, n = self.stream.position, cfg.rollout.prompts_per_step
        first = [self.stream.source.train_row(position + j) for j in range(n)]  # read, not taken
        for rows, what in ((first, "training"), (self.eval_rows, "held-out")):
            if not rows:
                continue
            longest = max(map(len, encode_prompts(self.tokenizer, rows, cfg.data)))
            need = longest + cfg.rollout.max_new_tokens
            limit = build.engine_context(self.policy, need)
            if limit < need:
                raise ConfigError(
                    f"a {what} prompt of {longest} tokens plus rollout.max_new_tokens="
                    f"{cfg.rollout.max_new_tokens} exceeds the model's context of {limit} positions; lower "
                    "rollout.max_new_tokens or data.max_prompt_length, or shorten the prompts"
                )

    def _take_run_dir(self, resume_from: str | None, changes: dict[str, tuple[Any, Any]]) -> None:
        """Lock the run directory and write the run's files: a new run deletes what an old run
        wrote there (``overwrite``, or what a start that saved no checkpoint left: see
        :func:`~policygrad.trainer.rundir.holds_run`) and writes ``config.yaml``; a resumed one
        tidies interrupted saves, records changed options and drops metrics logged after its
        checkpoint. Data-parallel: rank 0 alone; the other ranks write nothing."""
        cfg = self.config
        if not self.dist.is_main:
            self.logger = NullLogger()
            return
        new_folder = not os.path.exists(self.run_dir)
        # A caller's model object without a folder of its own was written to start_model/ while
        # the run was built (engines and critics load from a folder): it is this run's, not an old one's.
        start_model = os.path.join(self.run_dir, "start_model")
        ours = ("start_model",) if os.path.realpath(self.model_path) == os.path.realpath(start_model) else ()
        self._lock = rundir.RunLock.acquire(self.run_dir)
        try:  # what was checked at the start still holds now that the folder is ours
            if resume_from is None:
                rundir.check_new_run_dir(self.run_dir, overwrite=cfg.overwrite, owned=True, keep=ours)
            elif find_checkpoints(self.run_dir)[0] != checkpoint_path(self.run_dir, self.step_idx):
                raise TrainingError(
                    f"--resume {resume_from}: another run wrote a newer checkpoint while this one was "
                    "starting; resume again"
                )
        except BaseException:
            self._lock.release()
            raise
        try:
            if resume_from is None:
                a_run = rundir.holds_run(self.run_dir, keep=ours)
                removed = rundir.remove_run_files(self.run_dir, keep=ours)
                if removed and a_run:
                    log.info(
                        "--overwrite: deleted %d files and folders of the previous run in %s",
                        len(removed),
                        self.run_dir,
                    )
                elif removed:
                    names = [os.path.relpath(p, self.run_dir) for p in removed]
                    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
                    log.info(
                        "%s holds what a start that saved no checkpoint left (%s%s): replaced by this run",
                        self.run_dir,
                        ", ".join(names[:5]),
                        more,
                    )
                rundir.write_config(self.run_dir, cfg)
            else:
                recover_interrupted_saves(self.run_dir)
                if changes:
                    # config.yaml records the options of the newest checkpoint: the changed ones
                    # go in with the first checkpoint trained with them, so a resume that fails
                    # before it leaves the file as it was.
                    self._config_pending = True
                    log.info(
                        "resumed with changed options (recorded in config.yaml with the next checkpoint): %s",
                        ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()),
                    )
            self.logger = MetricsLogger(
                self.run_dir,
                tensorboard=False,  # TensorBoard is one of the trackers (report_to)
                truncate_after_step=self.step_idx if resume_from is not None else None,
                trackers=build_trackers(
                    cfg.trackers,
                    self.run_dir,
                    project=cfg.project,
                    run_name=cfg.run_name,
                    config=cfg.to_dict(),
                    resume=resume_from is not None,
                ),
            )
            recorded = {f"config/{k}": new for k, (_, new) in changes.items() if k in TRAINING_OPTIONS}
            if recorded:
                self.logger.log(self.step_idx, recorded)
        except BaseException:
            if resume_from is None:  # leave the folder as empty as it was (or absent)
                rundir.remove_run_files(self.run_dir)
                self._lock.release()
                if new_folder and os.path.isdir(self.run_dir) and not os.listdir(self.run_dir):
                    os.rmdir(self.run_dir)
            raise

    def evaluate(
        self, rows: list[dict[str, Any]] | None = None, *, batch_size: int | None = None, tag: str = "eval"
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Held-out evaluation through the run's rollout engine, all rows in one ``generate`` call
        (``batch_size`` caps it): greedy accuracy judged by the rows' verifier (``self.eval_reward``:
        answer correctness, or ``code_tests`` on rows with code tests) and, with ``eval_samples`` =
        n >= 2, pass@k and maj@k for each k of ``eval_k`` (:func:`policygrad.trainer.evaluate.evaluate`).

        Returns:
            ``(metrics, records)``: metrics under their :data:`METRICS` names (``eval/accuracy``,
            ``eval/pass@k``, ``eval/maj@k``); the records (prompt, completion, answer, reward,
            samples) are also written to ``RUN_DIR/<tag>.jsonl``.
        """
        rows = self.eval_rows if rows is None else rows
        if not rows or not self.dist.is_main:  # data-parallel: rank 0 evaluates
            return {"eval/accuracy": float("nan")}, []
        cfg = self.config
        scores, records = evaluate_rows(
            self.engine,
            self.tokenizer,
            rows,
            data=cfg.data,
            max_new_tokens=cfg.rollout.max_new_tokens,
            samples=cfg.eval_samples,
            ks=cfg.eval_ks,
            temperature=cfg.eval_temperature,
            batch_size=batch_size,
            seed=cfg.seed * 1_000_003 + self.step_idx,
            reward_fn=self.eval_reward,
        )
        write_jsonl(os.path.join(self.run_dir, f"{tag}.jsonl"), records)
        return {f"eval/{name}": value for name, value in scores.items()}, records

    def train(self) -> dict[str, Any]:
        """Run ``config.steps`` steps (or until ``max_minutes``), with held-out evaluation before
        and after. Returns a summary that is also written to ``RUN_DIR/summary.json``.

        Checkpoints: every ``save_every`` steps and ``save_every_minutes`` minutes; after the
        current step on the first Ctrl-C or SIGTERM (the run then stops without the final
        evaluation, ``summary["interrupted"]`` names the signal); on an error after the first
        completed step (the last completed step is saved, then the error propagates); and at the
        end, before the final evaluation. Where waiting would save nothing (the evaluation
        before the first step, and after the final checkpoint) the first signal stops the run at
        once, with the same summary. The run directory's lock is released on return.

        Raises:
            TrainingError: ``max_skipped_updates`` steps in a row applied no update, or the run
                ended without applying any (after its checkpoint and summary are written); the
                disk is full (naming the file, and whether ``--resume`` or a new start goes on).
            KeyboardInterrupt: a second Ctrl-C (stops at once).
            Any error of a step, after the checkpoint above.
        """
        try:
            with StopSignals(at_once=True) as signals:  # from the first line: a signal is a clean stop
                return self._train(signals)
        except Stopped as stop:
            return self._stopped_at_once(stop.signal)
        except KeyboardInterrupt:  # a second Ctrl-C
            saved = self._saved_step
            newest = checkpoint_path(self.run_dir, saved) if saved else None
            log.warning("stopped at once; the newest checkpoint is %s", newest or "none (nothing was saved)")
            raise
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            where = exc.filename or f"the run's files in {self.run_dir}"
            raise TrainingError(
                f"no space left on device writing {where}; free space, then {self._go_on()}"
            ) from exc
        finally:
            self.logger.close()
            if self._lock is not None:
                self._lock.release()

    def _go_on(self) -> str:
        """How to go on after this run stopped: resume its newest checkpoint, or, with none
        saved, start it again (the folder of a start that saved no checkpoint is taken as new)."""
        if self._saved_step:
            return f"continue with: policygrad train --resume {self.run_dir}"
        return (
            f"run the same command again: no checkpoint was saved, so the run starts over in {self.run_dir}"
        )

    def _stopped_at_once(self, signal_name: str) -> dict[str, Any]:
        """The summary (also written) and the one message of a run a signal stopped where there
        was nothing to wait for: before its first step, or after its final checkpoint."""
        summary = {**self._summary, "steps": self.step_idx, "interrupted": signal_name}
        self._write_summary(summary)
        if self._saved_step is None:
            log.warning(
                "stopped by %s before the first step; nothing was trained or saved; %s",
                signal_name,
                self._go_on(),
            )
        elif not self._steps_done:  # a resumed run, before its first step
            log.warning(
                "stopped by %s before step %d; checkpoint %s is saved; %s",
                signal_name,
                self.step_idx + 1,
                checkpoint_path(self.run_dir, self._saved_step),
                self._go_on(),
            )
        else:
            log.warning(
                "stopped by %s after the final checkpoint %s (step %d), before the run's end; the trained "
                "model is %s",
                signal_name,
                checkpoint_path(self.run_dir, self._saved_step),
                self._saved_step,
                os.path.join(checkpoint_path(self.run_dir, self._saved_step), "model"),
            )
        return summary

    def _train(self, signals: StopSignals) -> dict[str, Any]:
        from tqdm import tqdm

        cfg = self.config
        self._steps_done = False
        start = time.perf_counter()
        summary: dict[str, Any] = {"run_dir": self.run_dir, "rollout_engine": self.engine_name}
        self._summary = summary  # so far: what a stop at once reports
        if cfg.eval_before and self.eval_rows and self.step_idx == 0:
            scores, _ = self.evaluate(tag="eval_before")
            summary["accuracy_before"] = acc = scores["eval/accuracy"]
            self.logger.log(0, scores)
            log.info("held-out greedy accuracy before training: %.3f (%d problems)", acc, len(self.eval_rows))
        bar = tqdm(
            total=cfg.steps,
            initial=self.step_idx,
            disable=not cfg.progress or not self.dist.is_main,
            desc="train",
            dynamic_ncols=True,
        )
        stopped_early = False
        last_save = time.perf_counter()
        interrupted = None
        signals.at_once = False  # Ctrl-C / SIGTERM: stop after the current step
        while self.step_idx < cfg.steps:
            # Data-parallel, every rank takes the same decisions: a signal on any rank stops
            # them all (torchrun forwards one to each), and rank 0's clock decides the time.
            interrupted = self._agreed_signal(signals.received)
            if interrupted:
                break
            minutes = (time.perf_counter() - start) / 60
            if self.dist.first(cfg.max_minutes is not None and minutes > cfg.max_minutes):
                stopped_early = True
                break
            safe = self._safe_point()
            try:
                self._train_step(bar)
                if self.dist.first(self._checkpoint_due(last_save)):
                    self.save_checkpoint()
                    last_save = time.perf_counter()
            except Exception as exc:
                self._save_after_error(safe, exc)
                raise
        bar.close()
        summary["steps"] = self.step_idx
        summary["updates_applied"] = self.watch.applied
        summary["stopped_by_max_minutes"] = stopped_early
        summary["train_minutes"] = (time.perf_counter() - start) / 60
        if self.step_idx and self._saved_step != self.step_idx:
            self.save_checkpoint()  # before the final evaluation: Ctrl-C there loses nothing
        if interrupted:
            summary["interrupted"] = interrupted
            self._write_summary(summary)
            if self._saved_step is None:
                log.warning(
                    "stopped by %s before the first step; nothing was trained or saved; %s",
                    interrupted,
                    self._go_on(),
                )
            else:
                log.warning(
                    "stopped by %s after step %d; checkpoint %s is saved; %s",
                    interrupted,
                    self.step_idx,
                    checkpoint_path(self.run_dir, self._saved_step),
                    self._go_on(),
                )
            return summary
        self._steps_done = True
        signals.at_once = True  # the final checkpoint is saved: nothing is left to wait for
        try:
            self.watch.check_trained()
        except TrainingError:
            self._write_summary(summary)
            raise
        if cfg.eval_after and self.eval_rows:
            scores, _ = self.evaluate(tag="eval_after")  # Ctrl-C here: the final checkpoint is saved
            summary["accuracy_after"] = acc = scores["eval/accuracy"]
            sampled = {k.removeprefix("eval/"): v for k, v in scores.items() if k != "eval/accuracy"}
            summary.update({f"{k}_after": v for k, v in sampled.items()})  # pass@k_after, maj@k_after
            self.logger.log(self.step_idx, scores)
            log.info("held-out greedy accuracy after training:  %.3f (%d problems)", acc, len(self.eval_rows))
            if "accuracy_before" in summary:
                summary["accuracy_gain"] = acc - summary["accuracy_before"]
                log.info("change: %+.3f", summary["accuracy_gain"])
        if cfg.export_merged:
            summary["merged_model"] = self.export_merged()
        summary["wall_minutes"] = (time.perf_counter() - start) / 60
        summary["peak_rss_gb"] = peak_rss_gb()
        self._write_summary(summary)
        log.info("applied %d updates in %d steps", self.watch.applied, self.watch.steps)
        return summary

    def _train_step(self, bar) -> None:
        """One step of :meth:`train`: the step, an evaluation when due, its metrics row, the
        progress bar, and the empty-update watch (which may end the run)."""
        cfg = self.config
        metrics = self.step()
        if cfg.eval_every and self.step_idx % cfg.eval_every == 0 and self.step_idx < cfg.steps:
            metrics.update(self.evaluate(tag=f"eval_step{self.step_idx}")[0])
        self.logger.log(self.step_idx, metrics)
        bar.update(1)
        bar.set_postfix(
            reward=f"{metrics['reward/mean']:.3f}",
            len=f"{metrics['response/length_mean']:.0f}",
            s=f"{metrics['time/step_s']:.1f}",
        )
        if cfg.log_completions and self.step_idx % 10 == 1 and self.dist.is_main:  # rank 0 reports
            for sample in self.last_samples[: cfg.log_completions]:
                text = sample["completion"][:120]
                bar.write(f"  [step {self.step_idx}] reward={sample['reward']:.2f} {text!r}")
        self.watch.observe(metrics)

    def _agreed_signal(self, received: str | None) -> str | None:
        """The signal that stops the run: this process's, or with several ranks, any rank's."""
        if not self.dist.active:
            return received
        return (received or "SIGTERM") if self.dist.any(received is not None) else None

    def _checkpoint_due(self, last_save: float) -> bool:
        cfg = self.config
        by_steps = bool(cfg.save_every) and self.step_idx % cfg.save_every == 0
        minutes = (time.perf_counter() - last_save) / 60
        by_time = bool(cfg.save_every_minutes) and minutes >= cfg.save_every_minutes
        return by_steps or by_time

    def _optimizer_steps(self) -> tuple[int, ...]:
        critic = self.critic_trainer
        return (self.scheduler.last_epoch, critic.scheduler.last_epoch if critic is not None else 0)

    def _safe_point(self) -> tuple[dict[str, Any], tuple[int, ...]]:
        """The trainer state before a step (tensors by reference: they stay valid until an
        optimizer step) and the optimizer-step counts that tell whether one happened since."""
        return trainer_state(self), self._optimizer_steps()

    def _save_after_error(self, safe, exc: Exception) -> None:
        """Keep the finished steps when a step fails: save the last completed step (the state
        before the failing step, if no optimizer step of it was applied yet)."""
        state, steps_then = safe
        if isinstance(exc, CheckpointSaveError) or not self.step_idx:
            return  # the save itself failed (the disk is full), or no step was completed
        if self.strategy == "fsdp":
            # A sharded save needs every rank, and the others are not here: the newest checkpoint stands.
            newest = f"is of step {self._saved_step}" if self._saved_step else "does not exist yet"
            log.warning(
                "note: a sharded run cannot save after an error on one rank; the newest checkpoint %s", newest
            )
            return
        if self.step_idx == state["step"] and self._optimizer_steps() != steps_then:
            log.warning(
                "note: the error came during the update of step %d, so that step cannot be saved; the newest "
                "checkpoint is of step %s",
                self.step_idx + 1,
                self._saved_step,
            )
            return
        if self.step_idx != state["step"]:
            state = trainer_state(self)  # the step completed; the error came after it
        if state["step"] in (0, self._saved_step):
            return
        try:
            path = self.save_checkpoint(state=state)
        except CheckpointError as e:
            log.warning("note: could not save a checkpoint before stopping: %s", e)
            return
        log.warning(
            "saved checkpoint %s before stopping on the error; once it is fixed, continue with: "
            "policygrad train --resume %s",
            path,
            self.run_dir,
        )

    def _write_summary(self, summary: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        rundir.atomic_write_text(os.path.join(self.run_dir, "summary.json"), json.dumps(summary, indent=2))

    def close(self) -> None:
        """Shut down the rollout engine (vLLM holds its own weights, KV cache and process state)
        and the reward worker, flush the metrics log and release the run directory. The
        trainer cannot generate afterwards. Safe to call more than once."""
        close = getattr(getattr(self, "engine", None), "close", None)
        if callable(close):
            close()
        if getattr(self, "logger", None) is not None:
            self.logger.close()
        if getattr(self, "scorer", None) is not None:
            self.scorer.close()
        if getattr(self, "_lock", None) is not None:
            self._lock.release()

    def save_checkpoint(self, state: dict[str, Any] | None = None) -> str:
        """Write ``RUN_DIR/checkpoints/step_N`` as a transaction (see
        :mod:`policygrad.trainer.checkpoint`) from ``state`` (default: the trainer's state now).
        Returns its path.

        Raises:
            CheckpointSaveError: it could not be written; the older checkpoints are intact.
        """
        state = trainer_state(self) if state is None else state
        path = checkpoint_path(self.run_dir, state["step"])
        policy, critic_state, tmp = self.policy, None, None
        if self.strategy == "fsdp":  # the ranks write their shards first; the whole copy is current
            policy, (tmp, critic_state) = self.full_policy, self._write_shards(path)
        if self.dist.is_main:  # ddp: every rank holds the same full weights and state
            save_checkpoint(
                path,
                policy=policy,
                tokenizer=self.tokenizer,
                state=state,
                critic=self.critic,
                critic_state=critic_state,
                model_card=self.model_card(state["step"]),
                tmp=tmp,
            )
            if self._config_pending:
                rundir.write_config(self.run_dir, self.config)
                self._config_pending = False
        if self.strategy == "fsdp":
            self.dist.barrier()  # the checkpoint is complete before any rank goes on
        self._saved_step = state["step"]
        return path

    def _write_shards(self, path: str) -> tuple[str, dict[str, Any] | None]:
        """An FSDP run's part of a checkpoint that needs every rank: each writes its shards
        (``sharded/``) into rank 0's temporary folder, and the critic's weights are gathered to
        rank 0. Rank 0 then completes the transaction from that folder with the unsharded model
        folder, written from the engine's whole copy (synced after every update). A collective.

        Returns:
            ``(temporary folder, the critic's full weights on rank 0 or None)``.

        Raises:
            CheckpointSaveError: a shard could not be written (the temporary folder is removed).
        """
        import shutil

        from policygrad.trainer.checkpoint import SHARDED_DIR, save_sharded_state, temp_folder
        from policygrad.trainer.sharding import full_state_dict

        tmp = self.dist.broadcast_object(temp_folder(path) if self.dist.is_main else None)
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self.dist.barrier()
        try:
            save_sharded_state(os.path.join(tmp, SHARDED_DIR), self)
            critic_state = full_state_dict(self.critic, rank0_cpu=True) if self.critic is not None else None
        except Exception as exc:
            if self.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveError(f"could not write the shards of checkpoint {path}: {exc}") from exc
        return tmp, critic_state

    def model_card(self, step: int, *, kind: str | None = None) -> str:
        """The ``README.md`` of a model folder this run exports at ``step`` (see
        :mod:`policygrad.trainer.export`): base model, algorithm and settings, data, steps, the
        last logged metrics, library version."""
        from policygrad.models.adapters import is_peft_model
        from policygrad.trainer.export import final_metrics, model_card

        return model_card(
            self.config.to_dict(),
            steps=step,
            metrics=final_metrics(self.run_dir, up_to_step=step),
            kind=kind or ("LoRA adapter" if is_peft_model(self.policy) else "full model"),
            base_model=self.model_path,
        )

    def export_merged(self, folder: str | None = None) -> str:
        """Write the policy with every LoRA adapter merged in as a plain Hugging Face model folder
        (default ``RUN_DIR/merged_model``) with its model card. Returns the folder."""
        from policygrad.trainer.export import export_merged

        folder = folder or os.path.join(self.run_dir, "merged_model")
        if not self.dist.is_main:
            return folder
        card = self.model_card(self.step_idx, kind="merged model")
        policy = self.full_policy if self.full_policy is not None else self.policy  # fsdp: the whole copy
        return export_merged(policy, self.tokenizer, folder, card=card)
