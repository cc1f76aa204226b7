"""Checkpoints of a run (``RUN_DIR/checkpoints/step_N``) and the run directory itself.

A checkpoint folder holds ``model/`` (safetensors weights, or the LoRA adapter, plus the
tokenizer: a complete model folder for ``policygrad eval --model``), ``trainer_state.pt``
(optimizer, schedule, KL controller, data position, RNG states, reward normaliser, PPO-ptx
position; loaded with ``weights_only=True``, so a crafted file cannot run code) and, with a
critic, ``critic/``.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
from typing import Any

import torch

from policygrad.trainer.config import ConfigError
from policygrad.trainer.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "checkpoint_path",
    "latest_checkpoint",
    "load_policy_weights",
    "load_trainer_state",
    "prepare_new_run_dir",
    "restore_trainer_state",
    "save_checkpoint",
    "trainer_state",
]

STATE_FILE = "trainer_state.pt"


def checkpoint_path(run_dir: str, step: int) -> str:
    """``RUN_DIR/checkpoints/step_N``."""
    return os.path.join(run_dir, "checkpoints", f"step_{step}")


def latest_checkpoint(run_dir: str) -> str | None:
    """The ``checkpoints/step_N`` folder with the largest N under ``run_dir``, or None."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [
        int(d.split("_")[1]) for d in os.listdir(root) if d.startswith("step_") and d.split("_")[1].isdigit()
    ]
    return os.path.join(root, f"step_{max(steps)}") if steps else None


def save_checkpoint(path: str, *, policy, tokenizer, state: dict[str, Any], critic=None) -> str:
    """Write a checkpoint folder at ``path``: the policy (``save_pretrained``, safetensors; the
    adapter with LoRA) and tokenizer under ``model/``, ``state`` as ``trainer_state.pt``, and the
    critic under ``critic/`` when given. Returns ``path``."""
    os.makedirs(path, exist_ok=True)
    policy.save_pretrained(os.path.join(path, "model"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(path, "model"))
    if critic is not None:
        critic.save(os.path.join(path, "critic"))
    torch.save(state, os.path.join(path, STATE_FILE))
    return path


def trainer_state(trainer) -> dict[str, Any]:
    """What a :class:`~policygrad.trainer.loop.Trainer` needs to continue exactly where it is:
    step, data position, optimizer, schedule, KL controller, reward normaliser, RNG states; with
    a critic its optimizer and schedule; with PPO-ptx the text position."""
    state = {
        "step": trainer.step_idx,
        "data_position": trainer.stream.position,
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "kl_controller": trainer.kl_ctl.state_dict(),
        "reward_normalizer": trainer.scorer.normalizer.state_dict(),
        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
    }
    if trainer.critic_trainer is not None:
        state["critic"] = trainer.critic_trainer.state_dict()
    if trainer.ptx_data is not None:
        state["ptx_position"] = trainer.ptx_data.position
    return state


def restore_trainer_state(trainer, state: dict[str, Any], path: str) -> None:
    """Put :func:`trainer_state`'s output (read from checkpoint ``path``) back into ``trainer``.

    Raises:
        CheckpointError: the run has a critic but the checkpoint has no critic state.
    """
    trainer.step_idx = state["step"]
    trainer.stream.position = state["data_position"]
    trainer.optimizer.load_state_dict(state["optimizer"])
    fused = trainer.optimizer.defaults.get("fused")
    for group in trainer.optimizer.param_groups:  # a checkpoint may carry another implementation
        group["fused"] = fused
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.kl_ctl.load_state_dict(state["kl_controller"])
    if "reward_normalizer" in state:
        trainer.scorer.normalizer.load_state_dict(state["reward_normalizer"])
    if trainer.critic_trainer is not None:
        if "critic" not in state:
            raise CheckpointError(
                f"checkpoint {path} has no critic state; it was written by a run without a critic"
            )
        trainer.critic_trainer.load_state_dict(state["critic"])
    if trainer.ptx_data is not None:
        trainer.ptx_data.position = state.get("ptx_position", 0)
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])


def load_trainer_state(path: str) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint folder, loaded with ``weights_only=True``.

    Raises:
        CheckpointError: the file is missing, unreadable, or holds anything but tensors and plain
            containers (a file that would run code when unpickled).
    """
    file = os.path.join(path, STATE_FILE)
    try:
        return torch.load(file, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {STATE_FILE}; it is incomplete") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {file} cannot be loaded safely ({first[:200]}); it is corrupt or was not written "
            "by policygrad"
        ) from None


def load_policy_weights(model, folder: str) -> None:
    """Load saved policy weights (full model safetensors or a peft adapter) into ``model``.

    Raises:
        CheckpointError: the saved tensors do not match the model's.
    """
    from safetensors.torch import load_file

    adapter = os.path.join(folder, "adapter_model.safetensors")
    if os.path.exists(adapter):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(adapter))
        return
    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "lm_head" not in k]  # tied embeddings are saved once
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not match the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )


_RUN_MARKERS = ("checkpoints", "metrics.jsonl", "config.yaml", "summary.json")


def prepare_new_run_dir(run_dir: str, *, overwrite: bool) -> None:
    """A new run never mixes with an old one: an ``output_dir`` that already holds a run is an
    error unless ``overwrite`` is set, in which case the old run's files are removed.

    Raises:
        ConfigError: ``run_dir`` holds a run and ``overwrite`` is False, or it is a file.
    """
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"output_dir={run_dir!r} is a file; give a folder")
    if not os.path.isdir(run_dir) or not any(os.path.exists(os.path.join(run_dir, m)) for m in _RUN_MARKERS):
        return
    if not overwrite:
        raise ConfigError(
            f"output_dir={run_dir!r} already holds a run; continue it with --resume {run_dir}, choose a new "
            "--output_dir, or replace it with --overwrite=true"
        )
    for name in (*_RUN_MARKERS, "tensorboard"):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    for name in os.listdir(run_dir):
        if name.startswith("eval") and name.endswith(".jsonl"):
            os.remove(os.path.join(run_dir, name))
