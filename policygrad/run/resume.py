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
"""

from __future__ import annotations

import os
from typing import Any

from policygrad.config.train import ConfigError, TrainConfig, load_config

__all__ = ["SESSION_OPTIONS", "TRAINING_OPTIONS", "config_changes", "set_base_lr"]

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
    path = os.path.join(run_dir, "config.yaml")
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
            f"(model.name={os.path.join(run_dir, 'checkpoints', 'step_N', 'model')}) in a new --output_dir"
        )
    return changes


def set_base_lr(optimizer, scheduler, lr: float) -> None:
    """Give every parameter group the base learning rate ``lr``, keeping the schedule's position:
    the current rate becomes ``lr`` x the schedule's factor at its step (``LambdaLR``)."""
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, _factors(scheduler)):
        group["initial_lr"] = lr
        group["lr"] = lr * factor


def _factors(scheduler) -> list[float]:
    return [fn(scheduler.last_epoch) for fn in scheduler.lr_lambdas]
