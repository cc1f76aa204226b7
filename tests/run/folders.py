"""Run folders built without a model, for the tests of starting and resuming a run: a
``config.yaml`` and complete checkpoints whose weight files are a few bytes."""

from __future__ import annotations

import os

from policygrad.config.train import load_config
from policygrad.run.checkpoint import checkpoint_path, save_checkpoint
from policygrad.run.directory import write_config

STATE = {"data_position": 0, "optimizer": {}, "scheduler": {}, "kl_controller": {}, "rng": {}}


def run_config(run_dir, **fields):
    """A five-step config writing to ``run_dir``; ``fields`` replace top-level fields or update a
    section."""
    tree = {
        "model": {"name": "org/model"},
        "reward": {"functions": ["r.py:f"]},
        "output_dir": str(run_dir),
        "steps": 5,
        "tensorboard": False,
    }
    for key, value in fields.items():
        tree[key] = {**tree[key], **value} if isinstance(value, dict) and key in tree else value
    return load_config(None, tree)


class StubFiles:
    """Stands for a model or tokenizer in ``save_checkpoint``: writes a 10-byte weight file."""

    def save_pretrained(self, folder, **_):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(b"w" * 10)


def run_folder(run_dir, *steps):
    """A run folder with ``config.yaml`` and complete checkpoints at ``steps``."""
    os.makedirs(run_dir, exist_ok=True)
    write_config(str(run_dir), run_config(run_dir))
    for step in steps:
        save_checkpoint(
            checkpoint_path(str(run_dir), step),
            policy=StubFiles(),
            tokenizer=StubFiles(),
            state={**STATE, "step": step},
        )
    return str(run_dir)
