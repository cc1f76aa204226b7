"""A training run: a :class:`~policygrad.trainer.loop.Trainer` and what surrounds its steps.

The :class:`Run` checks before anything is written, builds the trainer, takes the run directory,
and then :meth:`Run.train` steps it with the checkpoint cadence, signals, failures, evaluation,
trackers, the summary, the model card and the merged export. The RL step itself is the trainer's.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import time
from typing import Any

from tqdm import tqdm

from policygrad.config.train import ConfigError, TrainConfig
from policygrad.data.sources import build_eval_rows
from policygrad.errors import TrainingError
from policygrad.evaluate.evaluation import eval_sampler, evaluate
from policygrad.evaluate.model import write_jsonl
from policygrad.evaluate.scoring import scoring_for
from policygrad.learn.health import check_finite_weights
from policygrad.models.adapters import is_peft_model
from policygrad.parallel.distributed import Dist, NullLogger
from policygrad.parallel.runtime import peak_rss_gb
from policygrad.rewards.code import TaskReward
from policygrad.run import directory, stops
from policygrad.run.checkpoint import check_room_for_checkpoint, checkpoint_bytes
from policygrad.run.export import export_merged, final_metrics, model_card
from policygrad.run.health import UpdateWatch
from policygrad.run.interrupts import Stopped, StopSignals
from policygrad.run.logging import MetricsLogger
from policygrad.run.resume import Resume, check_resume
from policygrad.run.saves import Checkpoints
from policygrad.run.start import check_prompts, take_run_dir
from policygrad.trainer.factory import build_trainer, prepare_config
from policygrad.trainer.loop import Trainer

__all__ = ["Run"]

log = logging.getLogger("policygrad")


def progress_label(max_minutes: float | None) -> str:
    """The progress bar's label: with ``max_minutes`` it names the time limit, since the bar's ETA
    counts ``steps`` only (the default job's 300 steps read as two hours on a busy CPU, but it stops
    after 24 minutes)."""
    return "train" if max_minutes is None else f"train (stops after {max_minutes:g} min)"


def write_above(bar: tqdm, line: str) -> None:
    """Print ``line`` on stdout above the progress bar (which draws on stderr).

    The bar is cleared, the line printed and flushed, then the bar redrawn: stdout piped to a file
    is block-buffered, so without the flush the line would land later, inside a redrawn bar.
    """
    with bar.external_write_mode():
        print(line, flush=True)


class Run:
    """Runs a :class:`TrainConfig`: checks, builds the :class:`Trainer`, takes the run directory,
    then :meth:`train`.

    Args:
        config: the validated run configuration.
        resume_from: a run directory to resume from (its newest complete checkpoint), or None;
            it must be ``config.output_dir``.
        engine: a rollout engine to use instead of the one ``rollout.engine`` names.
        model: a loaded transformers model (or peft model: its adapter trains) to train in
            place instead of ``model.name``; the config records it as ``model.name``.
        tokenizer: ``model``'s tokenizer.
        reward_functions: reward functions as objects (callables, sync or async, or specs)
            instead of ``reward.functions``; the config records each by its import path
            (``module:qualname``) or ``<callable NAME (not importable)>``.
        train_source: the training prompts as an object with ``train_row(i)`` (e.g. a
            :class:`~policygrad.data.sources.PromptDataset`) instead of ``data.dataset``.
        eval_rows: held-out rows (dicts with ``prompt`` and ``answer``) instead of ``data.eval_dataset``.
        environment: an :class:`~policygrad.envs.Environment` class (or factory) instead of
            ``env.name``; recorded like ``reward_functions``.

    Nothing is written until every check has passed and every part is built; then the run
    directory is locked (:mod:`policygrad.run.directory`) until :meth:`train` returns or
    :meth:`close` is called.

    Raises:
        ConfigError / ValueError: bad configuration or data (a prompt of the first batch too long
            for ``data.max_prompt_length`` or the model's context, non-finite model weights), a
            folder that holds a run without ``overwrite``, options that cannot change on resume;
            the field is named.
        TrainingError: another run owns the folder; ``resume_from`` has no complete checkpoint.
        CheckpointError: the checkpoint to resume from is corrupt or not a policygrad one.
    """

    config: TrainConfig
    trainer: Trainer
    dist: Dist
    run_dir: str
    eval_rows: list[dict[str, Any]]
    eval_reward: TaskReward  # the rows' own verifier: code_tests in the run's sandbox on code rows
    watch: UpdateWatch
    checkpoints: Checkpoints
    logger: MetricsLogger | NullLogger | None

    def __init__(
        self,
        config: TrainConfig,
        *,
        resume_from: str | None = None,
        engine=None,
        model=None,
        tokenizer=None,
        reward_functions: list | None = None,
        train_source=None,
        eval_rows: list[dict[str, Any]] | None = None,
        environment=None,
    ):
        self.dist = Dist.current()
        cfg, reward_objects = prepare_config(
            config, model=model, reward_functions=reward_functions, environment=environment, dist=self.dist
        )
        self.config, self.run_dir = cfg, cfg.output_dir
        self.logger, self._lock = None, None
        self._steps_done = False  # train() finished its steps (a signal then has nothing to wait for)
        self._summary: dict[str, Any] = {"run_dir": self.run_dir}  # train()'s summary so far
        # 1. Read-only checks of the run directory (and the checkpoint to resume from), once every
        # rank is here: a rank must not read the folder's lock while rank 0 of the same job is
        # still releasing it from a Run before this one (one process group, two runs in turn).
        self.dist.barrier()
        resume: Resume | None = None
        if resume_from is None:
            if not cfg.rollout.per_prompt_seeds:
                raise ConfigError(
                    "rollout.per_prompt_seeds=false only continues a run recorded with it (--resume); a new "
                    "run samples each prompt from its own seed, so drop the option"
                )
            directory.check_new_run_dir(self.run_dir, overwrite=cfg.overwrite)
        else:
            resume = check_resume(cfg, resume_from)
        self.dist.barrier()  # every rank has checked before rank 0 may write (step 3)
        # 2. Build: the held-out rows, then every part of the trainer.
        if eval_rows is not None:
            self.eval_rows = list(eval_rows)[: cfg.data.eval_size]
        else:
            self.eval_rows = build_eval_rows(cfg.data, seed=cfg.seed) if cfg.data.eval_size else []
        self.trainer = build_trainer(
            cfg,
            checkpoint=resume.checkpoint if resume is not None else None,
            checkpoint_precision=resume.state.get("precision") if resume is not None else None,
            engine=engine,
            model=model,
            tokenizer=tokenizer,
            reward_objects=reward_objects,
            train_source=train_source,
            environment=environment,
        )
        self.eval_reward = TaskReward(dataclasses.asdict(cfg.reward.code))
        self.watch = UpdateWatch(cfg)
        self.checkpoints = Checkpoints(cfg, self.trainer, self.watch, self.dist, self.model_card)
        if resume is not None:
            self.load_state_dict(resume)
        policy = self.trainer.policy
        where = f"model.name={cfg.model.name!r}" if resume is None else resume.checkpoint
        check_finite_weights(policy, where)
        check_prompts(cfg, self.trainer.tokenizer, policy, self.trainer.next_rows(), self.eval_rows)
        if self.dist.is_main:  # before the first step: a disk that cannot hold a checkpoint loses them all
            try:
                needed = checkpoint_bytes(policy, self.trainer.critic)
                check_room_for_checkpoint(cfg.output_dir, needed)
            except BaseException:
                self.close()
                raise
        # 3. Take the run directory: lock it, then write (or, on resume, update) the run's files.
        try:
            taken = take_run_dir(
                cfg,
                model_path=self.trainer.model_path,
                step=self.trainer.step_idx,
                resume=resume,
                is_main=self.dist.is_main,
            )
        except BaseException:
            self.close()
            raise
        self._lock, self.logger = taken.lock, taken.logger
        self.checkpoints.config_pending = taken.config_pending

    # ------------------------------------------------------------------------------------------
    # State.

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's trainer state (:meth:`Checkpoints.state_dict`)."""
        return self.checkpoints.state_dict()

    def load_state_dict(self, resume: Resume) -> None:
        """Continue from a checked checkpoint (:meth:`Checkpoints.load_state_dict`)."""
        self.checkpoints.load_state_dict(resume)

    # ------------------------------------------------------------------------------------------
    def evaluate(
        self, rows: list[dict[str, Any]] | None = None, *, batch_size: int | None = None, tag: str = "eval"
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Held-out evaluation through the run's rollout engine (with an environment, its greedy
        episodes; success = a final reward > 0), all rows in one sampler call (``batch_size`` caps
        it): greedy accuracy judged by the rows' verifier (``eval_reward``: answer correctness, or
        ``code_tests`` on rows with code tests) and, with ``eval_samples`` = n >= 2, pass@k (and
        maj@k of answers) for each k of ``eval_k`` (:func:`policygrad.evaluate.evaluation.evaluate`).

        Returns:
            ``(metrics, records)``: metrics under their :data:`METRICS` names (``eval/accuracy``,
            ``eval/pass@k``, ``eval/maj@k``; episodes: ``eval/turns_mean``,
            ``eval/turns_to_success``, ``eval/env/<key>``); the records (prompt, completion,
            answer, reward, samples; or the episodes') are also written to ``RUN_DIR/<tag>.jsonl``.
        """
        rows = self.eval_rows if rows is None else rows
        if not rows or not self.dist.is_main:  # data-parallel: rank 0 evaluates
            return {"eval/accuracy": float("nan")}, []
        cfg, trainer = self.config, self.trainer
        trainer.rollouts.drain()  # the engine samples one thing at a time: a job in flight first
        sampler = eval_sampler(cfg, trainer.engine, trainer.tokenizer, trainer.environment)
        scores, records = evaluate(
            sampler,
            rows,
            reward_fn=self.eval_reward,
            seed=trainer.seeds.evaluation(trainer.step_idx),
            samples=cfg.eval_samples,
            ks=cfg.eval_ks,
            temperature=cfg.eval_temperature,
            batch_size=batch_size,
        )
        write_jsonl(directory.eval_file(self.run_dir, tag), records)
        return scoring_for(sampler).run_metrics(scores), records

    def train(self) -> dict[str, Any]:
        """Run ``config.steps`` steps (or until ``max_minutes``), with held-out evaluation before
        and after. Returns a summary that is also written to ``RUN_DIR/summary.json``.

        ``max_minutes`` and ``summary["train_minutes"]`` count from the first step (periodic
        evaluations and checkpoints included, the evaluation before training not);
        ``summary["wall_minutes"]`` also counts that evaluation and the one after.

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
            Exception: any error of a step, after the checkpoint above.
        """
        try:
            with StopSignals(at_once=True) as signals:  # from the first line: a signal is a clean stop
                return self._train(signals)
        except Stopped as stop:
            return self._stopped_at_once(stop.signal)
        except KeyboardInterrupt as exc:  # a second Ctrl-C
            self.trainer.stop_at_once()
            stops.warn_stopped_twice(self.run_dir, self.checkpoints.saved_step)
            exc.reported = True  # the command line adds no line of its own
            raise
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            where = exc.filename or f"the run's files in {self.run_dir}"
            saved = self.checkpoints.saved_step
            lost = stops.unsaved_steps(self.trainer.step_idx, saved)
            raise TrainingError(
                f"no space left on device writing {where}; {lost}free space, then "
                f"{stops.how_to_go_on(self.run_dir, saved)}"
            ) from exc
        finally:
            self.logger.close()
            if self._lock is not None:
                self._lock.release()

    def _train(self, signals: StopSignals) -> dict[str, Any]:
        cfg, trainer = self.config, self.trainer
        self._steps_done = False
        start = time.perf_counter()
        summary: dict[str, Any] = {"run_dir": self.run_dir, "rollout_engine": trainer.engine_name}
        self._summary = summary  # so far: what a stop at once reports
        if cfg.eval_before and self.eval_rows and trainer.step_idx == 0:
            self._evaluate_before(summary)
        train_start = time.perf_counter()  # max_minutes counts training, not the evaluation before it
        bar = tqdm(
            total=cfg.steps,
            initial=trainer.step_idx,
            disable=not cfg.progress or not self.dist.is_main,
            desc=progress_label(cfg.max_minutes),
            dynamic_ncols=True,
        )
        signals.at_once = False  # Ctrl-C / SIGTERM: stop after the current step
        interrupted, stopped_early = self._steps(signals, bar, train_start)
        bar.close()
        summary["steps"] = trainer.step_idx
        summary["gradient_checkpointing"] = trainer.gradient_checkpointing
        summary["updates_applied"] = self.watch.applied
        summary["stopped_by_max_minutes"] = stopped_early
        summary["train_minutes"] = (time.perf_counter() - train_start) / 60
        if trainer.step_idx and self.checkpoints.saved_step != trainer.step_idx:
            self.save_checkpoint()  # before the final evaluation: Ctrl-C there loses nothing
        if interrupted:
            return self._stopped_after_step(interrupted, summary)
        self._steps_done = True
        signals.at_once = True  # the final checkpoint is saved: nothing is left to wait for
        try:
            self.watch.check_trained()
        except TrainingError:
            self._write_summary(summary)
            raise
        if cfg.eval_after and self.eval_rows:
            self._evaluate_after(summary)
        if cfg.export_merged:
            summary["merged_model"] = self.export_merged()
        summary["wall_minutes"] = (time.perf_counter() - start) / 60
        summary["peak_rss_gb"] = peak_rss_gb()
        self._write_summary(summary)
        log.info("applied %d updates in %d steps", self.watch.applied, self.watch.steps)
        warning = self.watch.end_warning()
        if warning:  # fewer empty steps than max_skipped_updates: the run ended, diverged
            log.warning("%s", warning)
        return summary

    def _steps(self, signals: StopSignals, bar, start: float) -> tuple[str | None, bool]:
        """The steps, each followed by a checkpoint when due. Returns ``(the signal that stopped
        the run or None, stopped by max_minutes)``. Data-parallel, every rank takes the same
        decisions: a signal on any rank stops them all (torchrun forwards one to each), and
        rank 0's clock decides the time."""
        cfg, trainer = self.config, self.trainer
        last_save = time.perf_counter()
        while trainer.step_idx < cfg.steps:
            interrupted = self._agreed_signal(signals.received)
            if interrupted:
                return interrupted, False
            minutes = (time.perf_counter() - start) / 60
            if self.dist.first(cfg.max_minutes is not None and minutes > cfg.max_minutes):
                return None, True
            safe = self.checkpoints.safe_point()
            try:
                self._train_step(bar)
                if self.dist.first(self.checkpoints.due(last_save)):
                    self.save_checkpoint()
                    last_save = time.perf_counter()
            except Exception as exc:
                self.checkpoints.save_after_error(safe, exc)
                raise
        return None, False

    def _evaluate_before(self, summary: dict[str, Any]) -> None:
        scores, _ = self.evaluate(tag="eval_before")
        summary["accuracy_before"] = acc = scores["eval/accuracy"]
        self.logger.log(0, scores)
        log.info("held-out greedy accuracy before training: %.3f (%d problems)", acc, len(self.eval_rows))

    def _evaluate_after(self, summary: dict[str, Any]) -> None:
        scores, _ = self.evaluate(tag="eval_after")  # Ctrl-C here: the final checkpoint is saved
        summary["accuracy_after"] = acc = scores["eval/accuracy"]
        sampled = {k.removeprefix("eval/"): v for k, v in scores.items() if k != "eval/accuracy"}
        summary.update({f"{k}_after": v for k, v in sampled.items()})  # pass@k_after, maj@k_after
        self.logger.log(self.trainer.step_idx, scores)
        log.info("held-out greedy accuracy after training:  %.3f (%d problems)", acc, len(self.eval_rows))
        if "accuracy_before" in summary:
            summary["accuracy_gain"] = acc - summary["accuracy_before"]
            log.info("change: %+.3f", summary["accuracy_gain"])

    def _train_step(self, bar) -> None:
        """One step of :meth:`train`: the step, an evaluation when due, its metrics row, the
        progress bar, and the empty-update watch (which may end the run)."""
        cfg, trainer = self.config, self.trainer
        metrics = trainer.step()
        step = trainer.step_idx
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            metrics.update(self.evaluate(tag=f"eval_step{step}")[0])
        self.logger.log(step, metrics)
        bar.update(1)
        bar.set_postfix(
            reward=f"{metrics['reward/mean']:.3f}",
            len=f"{metrics['response/length_mean']:.0f}",
            s=f"{metrics['time/step_s']:.1f}",
        )
        if cfg.log_completions and step % 10 == 1 and self.dist.is_main:  # rank 0 reports
            for sample in trainer.last_samples[: cfg.log_completions]:
                text = sample["completion"][:120]
                write_above(bar, f"  [step {step}] reward={sample['reward']:.2f} {text!r}")
        self.watch.observe(metrics)

    def _agreed_signal(self, received: str | None) -> str | None:
        """The signal that stops the run: this process's, or with several ranks, any rank's."""
        if not self.dist.active:
            return received
        return (received or "SIGTERM") if self.dist.any(received is not None) else None

    # ------------------------------------------------------------------------------------------
    # Stopping.

    def _stopped_at_once(self, signal_name: str) -> dict[str, Any]:
        """The summary (also written) and the one message of a run a signal stopped where there
        was nothing to wait for: before its first step, or after its final checkpoint."""
        summary = {**self._summary, "steps": self.trainer.step_idx, "interrupted": signal_name}
        self._write_summary(summary)
        saved, step = self.checkpoints.saved_step, self.trainer.step_idx
        stops.warn_stopped_at_once(signal_name, self.run_dir, saved, step, steps_done=self._steps_done)
        return summary

    def _stopped_after_step(self, signal_name: str, summary: dict[str, Any]) -> dict[str, Any]:
        summary["interrupted"] = signal_name
        self._write_summary(summary)
        saved, step = self.checkpoints.saved_step, self.trainer.step_idx
        stops.warn_stopped_after_step(signal_name, self.run_dir, saved, step)
        return summary

    def _write_summary(self, summary: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        directory.write_summary(self.run_dir, summary)

    def close(self) -> None:
        """Shut down the rollout engine (vLLM holds its own weights, KV cache and process state)
        and the reward worker, flush the metrics log and release the run directory. The run
        cannot generate afterwards. Safe to call more than once."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            trainer.close()
        if self.logger is not None:
            self.logger.close()
        if self._lock is not None:
            self._lock.release()

    # ------------------------------------------------------------------------------------------
    # Checkpoints and exports.

    def save_checkpoint(self, state: dict[str, Any] | None = None) -> str:
        """Write ``RUN_DIR/checkpoints/step_N`` from ``state`` (default: :meth:`state_dict` now) and
        return its path (:meth:`Checkpoints.save`: a transaction; a collective under FSDP).

        Raises:
            CheckpointSaveError: it could not be written; the older checkpoints are intact.
        """
        return self.checkpoints.save(state)

    def model_card(self, step: int, *, kind: str | None = None) -> str:
        """The ``README.md`` of a model folder this run exports at ``step`` (see
        :mod:`policygrad.run.export`): base model, algorithm and settings, data, steps, the
        last logged metrics, library version."""
        return model_card(
            self.config.to_dict(),
            steps=step,
            metrics=final_metrics(self.run_dir, up_to_step=step),
            kind=kind or ("LoRA adapter" if is_peft_model(self.trainer.policy) else "full model"),
            base_model=self.trainer.model_path,
        )

    def export_merged(self, folder: str | None = None) -> str:
        """Write the policy with every LoRA adapter merged in as a plain Hugging Face model folder
        (default ``RUN_DIR/merged_model``) with its model card. Returns the folder."""
        folder = folder or directory.merged_model_dir(self.run_dir)
        if not self.dist.is_main:
            return folder
        card = self.model_card(self.trainer.step_idx, kind="merged model")
        return export_merged(self.trainer.whole_policy, self.trainer.tokenizer, folder, card=card)
