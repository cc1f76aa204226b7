"""Fixtures of the trainer tests: a tiny model whose responses often end early, reward functions
in a file (loaded as ``path.py:function``), small JSONL datasets and a config factory with tiny
settings (2 prompts x G 4, 6 new tokens, no evaluation, no progress bar, no TensorBoard)."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import GenerationConfig

from policygrad.config.train import load_config
from tests.tiny import BOS_ID, PAD_ID, make_tiny_llama

# Every 7th id from <|im_end|> (2, 9, ..., 93: 14 of the 100 ids) ends a response, so 6-token
# responses of the random model both stop early (post-EOS padding in [B, T]) and get truncated.
MANY_EOS = list(range(2, 100, 7))

REWARDS_PY = '''
def digit_fraction(prompts, completions, **fields):
    """Fraction of the completion's characters that are digits: varies between samples, so the
    advantages of a random model are not all zero."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def length_fraction(prompts, completions, **fields):
    """Characters of the completion over 40: varies with the sampled length even when no sample
    holds a digit (a tiny random model's first step)."""
    return [len(c) / 40 for c in completions]


def flaky(prompts, completions, bad=None, **fields):
    """Like digit_fraction, but raises on rows whose dataset field ``bad`` is true."""
    bad = bad or [False] * len(completions)
    if any(bad):
        raise RuntimeError("cannot score this row")
    return digit_fraction(prompts, completions)


def constant_if_same(prompts, completions, **fields):
    """1.0 for every sample of a prompt containing "same" (a zero-variance group), else
    length_fraction (which varies between a group's samples even when none holds a digit)."""
    scores = length_fraction(prompts, completions)
    return [1.0 if "same" in p else s for p, s in zip(prompts, scores)]


def not_a_number(prompts, completions, bad=None, **fields):
    """Returns a string instead of a score on rows whose field ``bad`` is true."""
    bad = bad or [False] * len(completions)
    return ["n/a" if b else s for b, s in zip(bad, digit_fraction(prompts, completions))]
'''


@pytest.fixture(autouse=True)
def _every_test_on_one_thread(one_thread):
    """The ``one_thread`` fixture of tests/conftest.py for every test here."""


@pytest.fixture(scope="session")
def eos_model_dir(tmp_path_factory) -> str:
    """Tiny Llama (seed 0, peaked next-token distributions) that stops at any of ``MANY_EOS``."""
    path = tmp_path_factory.mktemp("tiny_llama_many_eos")
    model, _ = make_tiny_llama(path, seed=0, initializer_range=0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=MANY_EOS, pad_token_id=PAD_ID
    )
    model.generation_config.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def rewards_py(tmp_path_factory) -> str:
    """Path of a .py file holding the reward functions of ``REWARDS_PY``."""
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return str(path)


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture
def bad_row_dataset(tmp_path) -> str:
    """Two prompts in file order; the second has ``bad: true`` (rows 4..7 of a G=4 batch)."""
    return write_jsonl(
        tmp_path / "bad_row.jsonl",
        [
            {"prompt": "What is 2+3?", "answer": "5", "bad": False},
            {"prompt": "What is 7-4?", "answer": "3", "bad": True},
        ],
    )


def tiny_overrides(model_dir: str, reward_spec: str, output_dir, **sections) -> dict:
    """The override mapping of a tiny run; ``sections`` replace top-level fields or update a
    section's mapping (``rollout={"group_size": 2}`` keeps the other rollout fields)."""
    tree = {
        "algorithm": "grpo",
        "steps": 2,
        "seed": 0,
        "output_dir": os.fspath(output_dir),
        "progress": False,
        "tensorboard": False,
        "eval_before": False,
        "eval_after": False,
        "log_completions": 0,
        # fp32 whatever the CPU: a run in a subprocess (torchrun ranks, the CLI) is not covered by
        # the float32_auto_precision fixture, and auto is bf16-mixed on CPUs with bf16 instructions
        "model": {"name": model_dir, "precision": "fp32"},
        "data": {"eval_size": 0, "difficulty": "easy"},
        "rollout": {"engine": "hf", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
        "reward": {"functions": [reward_spec]},
        "optim": {"lr": 1e-2, "micro_batch_size": 8},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            tree[key] = {**tree[key], **value}
        else:
            tree[key] = value
    return tree


@pytest.fixture
def make_config(eos_model_dir, rewards_py, tmp_path):
    """``make_config(name="run", reward_fn="digit_fraction", **sections)`` -> a validated
    TrainConfig of a tiny run writing to ``tmp_path / name``, scored by ``reward_fn`` of the
    reward file."""

    def factory(name: str = "run", *, reward_fn: str = "digit_fraction", **sections):
        spec = f"{rewards_py}:{reward_fn}"
        return load_config(None, tiny_overrides(eos_model_dir, spec, tmp_path / name, **sections))

    return factory


REWARDS_PY += '''

def zero(prompts, completions, **fields):
    """0.0 for every completion: no group has signal in this component."""
    return [0.0 for _ in completions]
'''


def checkpoint_weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    """The policy tensors saved in ``RUN_DIR/checkpoints/step_N/model`` (every safetensors file)."""
    out = {}
    folder = os.path.join(run_dir, "checkpoints", f"step_{step}", "model")
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(path))
    assert out, f"no weights saved at step {step} of {run_dir}"
    return out


def config_with(tmp_path, model_name: str, **sections):
    """A validated config of an hf-engine run named ``model_name`` (never loaded by the tests that
    use it) in ``tmp_path/run``, with ``sections`` merged into its tree."""
    tree = {
        "model": {"name": model_name},
        "reward": {"functions": ["answer_correctness"]},
        "rollout": {"engine": "hf"},
        "output_dir": str(tmp_path / "run"),
    }
    for key, value in sections.items():
        tree[key] = {**tree[key], **value} if isinstance(value, dict) and key in tree else value
    return load_config(None, tree)


def interrupted_and_resumed(make_config, monkeypatch, sections: dict, *, dies_at: int, save_every: int = 2):
    """A straight run of ``sections`` (``straight``), and the same config (``cfg``, output
    ``resumed``) saving every ``save_every`` steps and killed by a KeyboardInterrupt at the start
    of step index ``dies_at``, then resumed from its newest checkpoint (``resumed``: the Run after
    ``train()``). Returns ``(straight, cfg, resumed)``; ``resumed.trainer.step_idx`` was
    ``save_every * (dies_at // save_every)`` when it restarted (checked)."""
    from policygrad.run import Run
    from policygrad.trainer.loop import Trainer

    straight = Run(make_config("straight", **sections))
    straight.train()
    cfg = make_config("resumed", save_every=save_every, **sections)
    step = Trainer.step

    def dies(self):
        if self.step_idx == dies_at:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Trainer, "step", dies)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg).train()
    monkeypatch.setattr(Trainer, "step", step)
    resumed = Run(cfg, resume_from=cfg.output_dir)
    assert resumed.trainer.step_idx == save_every * (dies_at // save_every)
    resumed.train()
    return straight, cfg, resumed
