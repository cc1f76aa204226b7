"""Starting a :class:`~policygrad.run.Run` once its parts are built: the prompt-length check
that needs the tokenizer, and taking the run directory (its lock, config, metrics log and
trackers).

Nothing is written until every check has passed; then :func:`take_run_dir` locks the folder
(:class:`~policygrad.run.directory.RunLock`) and writes the run's files, and a failure while
doing so leaves a new run's folder as empty as it was.
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
from policygrad.run import directory
from policygrad.run.checkpoint import checkpoint_path, find_checkpoints, recover_interrupted_saves
from policygrad.run.logging import MetricsLogger
from policygrad.run.resume import TRAINING_OPTIONS, Resume
from policygrad.run.trackers import build_trackers
from policygrad.trainer.build import engine_context

__all__ = ["TakenDir", "check_prompts", "take_run_dir"]

log = logging.getLogger("policygrad")


def check_prompts(
    cfg: TrainConfig, tokenizer, policy, first: list[dict[str, Any]], eval_rows: list[dict[str, Any]]
) -> None:
    """The first batch's prompts (``first``: its rows, read, not taken) and the held-out ones fit
    ``data.max_prompt_length``, and each plus ``rollout.max_new_tokens`` fits ``policy``'s context.

    Raises:
        ValueError / ConfigError: naming the prompt, its length and the fix.
    """
    for rows, what in ((first, "training"), (eval_rows, "held-out")):
        if not rows:
            continue
        longest = max(map(len, encode_prompts(tokenizer, rows, cfg.data)))
        need = longest + cfg.rollout.max_new_tokens
        limit = engine_context(policy, need)
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

    lock: directory.RunLock | None
    logger: MetricsLogger | NullLogger
    config_pending: bool = False


def take_run_dir(
    cfg: TrainConfig, *, model_path: str, step: int, resume: Resume | None, is_main: bool
) -> TakenDir:
    """Lock the run directory and write the run's files: a new run deletes what an old run wrote
    there (``overwrite``, or what a start that saved no checkpoint left: see
    :func:`~policygrad.run.directory.holds_run`) and writes ``config.yaml``; a resumed one tidies
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
    start_model = directory.start_model_dir(run_dir)
    ours = (
        (os.path.basename(start_model),)
        if os.path.realpath(model_path) == os.path.realpath(start_model)
        else ()
    )
    lock = directory.RunLock.acquire(run_dir)
    try:  # what was checked at the start still holds now that the folder is ours
        if resume is None:
            directory.check_new_run_dir(run_dir, overwrite=cfg.overwrite, owned=True, keep=ours)
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
            directory.write_config(run_dir, cfg)
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
            directory.remove_run_files(run_dir)
        lock.release()
        if resume is None and new_folder and os.path.isdir(run_dir) and not os.listdir(run_dir):
            os.rmdir(run_dir)
        raise
    return TakenDir(lock, logger, pending)


def _replace_old_run(run_dir: str, ours: tuple[str, ...]) -> None:
    """Delete what an earlier run (``--overwrite``) or a start that saved no checkpoint left."""
    a_run = directory.holds_run(run_dir, keep=ours)
    removed = directory.remove_run_files(run_dir, keep=ours)
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
