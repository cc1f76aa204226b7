"""The run directory around a :class:`~policygrad.run.Run`: the read-only checks of a new or
resumed run before anything is built, the prompt-length check once the tokenizer exists, and
taking the folder (lock, config, metrics log, trackers) once every part is built.

Nothing is written until every check has passed; then :func:`take_run_dir` locks the folder
(:mod:`policygrad.run.rundir`) and writes the run's files, and a failure while doing so
leaves a new run's folder as empty as it was.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from policygrad.config.train import ConfigError, TrainConfig
from policygrad.data.chat import encode_prompts
from policygrad.errors import TrainingError
from policygrad.parallel.distributed import NullLogger
from policygrad.run import rundir
from policygrad.run.checkpoint import (
    checkpoint_path,
    find_checkpoints,
    latest_checkpoint,
    load_trainer_state,
    recover_interrupted_saves,
)
from policygrad.run.logging import MetricsLogger
from policygrad.run.resume import TRAINING_OPTIONS, config_changes
from policygrad.run.trackers import build_trackers, read_tracker_ids
from policygrad.trainer.build import engine_context

__all__ = ["Resume", "TakenDir", "check_prompts", "check_resume", "take_run_dir"]

log = logging.getLogger("policygrad")


@dataclass(frozen=True)
class Resume:
    """A checked ``--resume``: the newest complete checkpoint, its trainer state, and the options
    that changed (``{field: (saved, new)}``, see :mod:`policygrad.run.resume`)."""

    checkpoint: str
    state: dict[str, Any]
    changes: dict[str, tuple[Any, Any]]


def check_resume(cfg: TrainConfig, resume_from: str) -> Resume:
    """Read-only checks of ``--resume``: the newest complete checkpoint, its trainer state, the
    folder not in use, and the options that changed.

    Raises:
        TrainingError: no complete checkpoint (with how to go on); ConfigError: another
            ``output_dir``, ``--overwrite``, options that cannot change, nothing left to train;
            CheckpointError: an unreadable trainer state.
    """
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
    return Resume(ckpt, state, changes)


def check_prompts(trainer, eval_rows: list[dict[str, Any]]) -> None:
    """The first batch's prompts and the held-out ones fit ``data.max_prompt_length``, and each
    plus ``rollout.max_new_tokens`` fits the model's context.

    Raises:
        ValueError / ConfigError: naming the prompt, its length and the fix.
    """
    cfg = trainer.config
    position, n = trainer.stream.position, cfg.rollout.prompts_per_step
    first = [trainer.stream.source.train_row(position + j) for j in range(n)]  # read, not taken
    for rows, what in ((first, "training"), (eval_rows, "held-out")):
        if not rows:
            continue
        longest = max(map(len, encode_prompts(trainer.tokenizer, rows, cfg.data)))
        need = longest + cfg.rollout.max_new_tokens
        limit = engine_context(trainer.policy, need)
        if limit < need:
            raise ConfigError(
                f"a {what} prompt of {longest} tokens plus rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens} exceeds the model's context of {limit} positions; lower "
                "rollout.max_new_tokens or data.max_prompt_length, or shorten the prompts"
            )


@dataclass
class TakenDir:
    """What :func:`take_run_dir` returns: the folder's lock (None on ranks other than 0), the
    metrics logger, and whether changed options wait for the next checkpoint's ``config.yaml``."""

    lock: rundir.RunLock | None
    logger: MetricsLogger | NullLogger
    config_pending: bool = False


def take_run_dir(
    cfg: TrainConfig, *, model_path: str, step: int, resume: Resume | None, is_main: bool
) -> TakenDir:
    """Lock the run directory and write the run's files: a new run deletes what an old run wrote
    there (``overwrite``, or what a start that saved no checkpoint left: see
    :func:`~policygrad.run.rundir.holds_run`) and writes ``config.yaml``; a resumed one tidies
    interrupted saves, records changed options and drops metrics logged after its checkpoint
    (``step``). Data-parallel: rank 0 alone (``is_main``); the other ranks write nothing.

    Raises:
        TrainingError: another run took the folder, or wrote a newer checkpoint meanwhile.
    """
    if not is_main:
        return TakenDir(None, NullLogger())
    run_dir = cfg.output_dir
    new_folder = not os.path.exists(run_dir)
    # A caller's model object without a folder of its own was written to start_model/ while
    # the run was built (engines and critics load from a folder): it is this run's, not an old one's.
    start_model = os.path.join(run_dir, "start_model")
    ours = ("start_model",) if os.path.realpath(model_path) == os.path.realpath(start_model) else ()
    lock = rundir.RunLock.acquire(run_dir)
    try:  # what was checked at the start still holds now that the folder is ours
        if resume is None:
            rundir.check_new_run_dir(run_dir, overwrite=cfg.overwrite, owned=True, keep=ours)
        elif find_checkpoints(run_dir)[0] != checkpoint_path(run_dir, step):
            raise TrainingError(
                f"--resume {run_dir}: another run wrote a newer checkpoint while this one was "
                "starting; resume again"
            )
    except BaseException:
        lock.release()
        raise
    try:
        pending = False
        if resume is None:
            _replace_old_run(run_dir, ours)
            rundir.write_config(run_dir, cfg)
        else:
            recover_interrupted_saves(run_dir)
            if resume.changes:
                # config.yaml records the options of the newest checkpoint: the changed ones
                # go in with the first checkpoint trained with them, so a resume that fails
                # before it leaves the file as it was.
                pending = True
                log.info(
                    "resumed with changed options (recorded in config.yaml with the next checkpoint): %s",
                    ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in resume.changes.items()),
                )
        logger = MetricsLogger(
            run_dir,
            tensorboard=False,  # TensorBoard is one of the trackers (report_to)
            truncate_after_step=step if resume is not None else None,
            trackers=build_trackers(
                cfg.trackers,
                run_dir,
                project=cfg.project,
                run_name=cfg.run_name,
                config=cfg.to_dict(),
                resume=resume is not None,
            ),
        )
        changes = resume.changes if resume is not None else {}
        recorded = {f"config/{k}": new for k, (_, new) in changes.items() if k in TRAINING_OPTIONS}
        if recorded:
            logger.log(step, recorded)
    except BaseException:
        if resume is None:  # leave the folder as empty as it was (or absent)
            rundir.remove_run_files(run_dir)
        lock.release()
        if resume is None and new_folder and os.path.isdir(run_dir) and not os.listdir(run_dir):
            os.rmdir(run_dir)
        raise
    return TakenDir(lock, logger, pending)


def _replace_old_run(run_dir: str, ours: tuple[str, ...]) -> None:
    """Delete what an earlier run (``--overwrite``) or a start that saved no checkpoint left."""
    a_run = rundir.holds_run(run_dir, keep=ours)
    removed = rundir.remove_run_files(run_dir, keep=ours)
    if removed and a_run:
        log.info("--overwrite: deleted %d files and folders of the previous run in %s", len(removed), run_dir)
    elif removed:
        names = [os.path.relpath(p, run_dir) for p in removed]
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        log.info(
            "%s holds what a start that saved no checkpoint left (%s%s): replaced by this run",
            run_dir,
            ", ".join(names[:5]),
            more,
        )
