"""What may change when a run resumes, and how a change is applied and recorded.

``--resume RUN_DIR`` starts from the run's saved ``config.yaml`` plus the options given on the
command line. Every option that differs from the saved one is either applied or refused, never
ignored:

* :data:`SESSION_OPTIONS` say how long and how visibly the run goes on (``steps``,
  ``max_minutes``, evaluation and checkpoint cadence, logging): applied, logged and written to
  ``config.yaml``;
* :data:`TRAINING_OPTIONS` change the numbers from the resumed step on (``optim.lr``, the
  reward call policy, ...): applied (a new ``optim.lr`` sets the optimizer's learning rate under
  the saved schedule), logged, written to ``config.yaml`` and recorded in ``metrics.jsonl`` as a
  ``config/<field>`` row at the step the run resumes from;
* anything else (the model, the algorithm, the data, the seed, ...) would make the checkpoint
  mean something else: refused, naming each option with its saved and given value.

:func:`check_resume` makes every read-only check of a ``--resume`` before anything is built
(the newest complete checkpoint, the folder not in use, the changes) and returns a
:class:`Resume`; a new learning rate is applied by the trainer (``Trainer.set_base_lr``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from policygrad.config.train import ConfigError, TrainConfig, load_config
from policygrad.errors import TrainingError
from policygrad.run import directory
from policygrad.run.checkpoint import find_checkpoints, latest_checkpoint, load_trainer_state
from policygrad.run.directory import checkpoints_dir, config_file
from policygrad.run.trackers import read_tracker_ids

__all__ = ["SESSION_OPTIONS", "TRAINING_OPTIONS", "Resume", "check_resume", "config_changes", "saved_config"]

SESSION_OPTIONS = frozenset(
    {
        "steps",
        "max_minutes",
        "eval_every",
        "eval_before",
        "eval_after",
        "save_every",
        "save_every_minutes",
        "keep_checkpoints",
        "max_skipped_updates",
        "log_completions",
        "num_threads",
        "tensorboard",
        "progress",
        "distributed.strategy",  # how the same numbers are spread over ranks (see distributed.py)
        "rollout.async_executor",  # thread or inline: the same numbers
    }
)
TRAINING_OPTIONS = frozenset(
    {
        "optim.lr",
        "optim.max_grad_norm",
        "optim.target_kl",
        "optim.micro_batch_size",
        "model.gradient_checkpointing",  # memory for time; without it the shared-prompt forward (rounding)
        "reward.on_error",
        "reward.timeout_s",
        "reward.isolation",
        "data.eval_size",
        "data.eval_dataset",
        "rollout.per_prompt_seeds",  # e.g. a one-process run continued by several processes
    }
)
_IGNORED = frozenset({"overwrite", "output_dir"})  # not options of the run itself


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in ("options",):
            out.update(_flatten(value, f"{path}."))
        else:
            out[path] = list(value) if isinstance(value, tuple) else value
    return out


def saved_config(run_dir: str) -> TrainConfig:
    """The config a run saved (``RUN_DIR/config.yaml``), validated.

    Raises:
        FileNotFoundError: the run has no ``config.yaml``.
        ConfigError: the saved config is not valid any more (the message names the field).
    """
    path = config_file(run_dir)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--resume {run_dir}: {path} not found; is this a policygrad run directory?")
    try:
        return load_config(path, {"overwrite": False})
    except ConfigError as e:
        raise ConfigError(f"--resume {run_dir}: its config.yaml is not valid: {e}") from None


def config_changes(run_dir: str, config: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """The options of ``config`` that differ from the run's saved ones: ``{field: (saved, new)}``
    (dotted names; ``output_dir`` and ``overwrite`` are not compared).

    Raises:
        ConfigError: a changed option that cannot change on resume; the message names each one
            with its saved and given value.
        FileNotFoundError: as :func:`saved_config`.
    """
    old = _flatten(saved_config(run_dir).to_dict())
    new = _flatten(config.to_dict())
    changes = {
        key: (old.get(key), new.get(key))
        for key in sorted(set(old) | set(new))
        if key not in _IGNORED and old.get(key) != new.get(key)
    }
    refused = [k for k in changes if k not in SESSION_OPTIONS and k not in TRAINING_OPTIONS]
    if refused:
        listed = "; ".join(f"{k}: {changes[k][0]!r} -> {changes[k][1]!r}" for k in refused)
        raise ConfigError(
            f"--resume {run_dir}: these options cannot change on resume (the checkpoint was trained with the "
            f"saved ones): {listed}; drop them, or start a new run from the checkpoint's weights "
            f"(model.name={os.path.join(checkpoints_dir(run_dir), 'step_N', 'model')}) in a new --output_dir"
        )
    return changes


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
        saved = config_file(resume_from)
        if not skipped and os.path.isfile(saved) and not directory.holds_run(resume_from):
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
    directory.check_not_in_use(resume_from)
    changes = config_changes(resume_from, cfg)
    read_tracker_ids(resume_from)  # a corrupt file is refused now, not after the run is taken
    state = load_trainer_state(ckpt)
    if state["step"] >= cfg.steps:
        raise ConfigError(
            f"--resume {resume_from}: the run is at step {state['step']} of steps={cfg.steps}, so there "
            f"is nothing to train; give --steps larger than {state['step']} to continue it"
        )
    return Resume(ckpt, state, changes)
