"""Code RL wired through the trainer: builtin:code rows, the code_tests reward configured by
reward.code, and held-out evaluation judged by the rows' tests (not by answer matching)."""

from __future__ import annotations

import json
import os

import pytest

from policygrad.config.train import ConfigError, load_config
from policygrad.rewards.code import CodeTests
from policygrad.run import Run
from policygrad.sandbox.runner import available_isolation
from tests.training import tiny_overrides

pytestmark = pytest.mark.integration

ISOLATION = "auto" if available_isolation() else "none"


def _config(eos_model_dir, tmp_path, **sections):
    tree = tiny_overrides(
        eos_model_dir, "code_tests", tmp_path / "run",
        data={"dataset": "builtin:code", "difficulty": "easy", "eval_size": 3},
        reward={"functions": ["code_tests"], "code": {"isolation": ISOLATION, "timeout_s": 5, "workers": 2}},
        # The tiny model passes no test, so every advantage is 0: the entropy bonus keeps the run
        # training (a run that moves no weight ends with an error).
        steps=1, eval_before=True, loss={"entropy_coef": 0.01}, **sections,
    )
    return load_config(None, tree)


def test_a_code_run_scores_with_the_sandbox_and_evaluates_by_tests(eos_model_dir, tmp_path):
    run = Run(_config(eos_model_dir, tmp_path))
    try:
        reward = run.trainer.scorer.reward_fn.entries[0][1]
        assert isinstance(reward, CodeTests) and reward.sandbox.limits.wall_time_s == 5.0
        summary = run.train()
        rows = run.eval_rows
        # The evaluation's verifier runs the tests: a reference answer passes, a wrong one fails.
        fields = {"tests": [r["tests"] for r in rows], "entry_point": [r["entry_point"] for r in rows]}
        prompts = [r["prompt"] for r in rows]
        assert run.eval_reward(prompts, [r["answer"] for r in rows], **fields) == [1.0] * 3
        assert run.eval_reward(prompts, ["def nothing():\n    pass\n"] * 3, **fields) == [0.0] * 3
    finally:
        close = getattr(run, "close", None)
        if close is not None:
            close()
    # A random tiny model writes no passing program: the held-out accuracy is exactly 0.
    assert summary["accuracy_before"] == 0.0
    with open(os.path.join(tmp_path / "run", "eval_before.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    assert len(records) == 3 and all(r["reward"] == 0.0 for r in records)
    with open(os.path.join(tmp_path / "run", "metrics.jsonl")) as handle:
        steps = [json.loads(line) for line in handle if '"reward_fn/code_tests/mean"' in line]
    assert steps and steps[0]["reward_fn/code_tests/mean"] == 0.0


def test_a_bad_isolation_names_the_field(eos_model_dir, tmp_path):
    bad = {"code": {"isolation": "docker"}}
    tree = tiny_overrides(eos_model_dir, "code_tests", tmp_path / "run", reward=bad)
    with pytest.raises(ConfigError, match="reward.code.isolation='docker' is not valid"):
        load_config(None, tree)


def test_policygrad_eval_on_code_rows_runs_their_tests(eos_model_dir, tmp_path, capsys):
    from policygrad.cli import main

    output = tmp_path / "code.jsonl"
    argv = ["eval", "--model", eos_model_dir, "--dataset", "builtin:code", "--difficulty", "easy",
            "--limit", "2", "--max-new-tokens", "4",
            "--engine", "hf", "--isolation", ISOLATION, "--output", str(output)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed[printed.index("{"):])
    assert result["n"] == 2 and result["accuracy"] == 0.0 and "maj@1" not in result
    with open(output) as handle:
        records = [json.loads(line) for line in handle]
    # The random tiny model's 4 tokens define no function: both rows fail their asserts.
    assert [r["reward"] for r in records] == [0.0, 0.0]
    assert records[0]["answer"].startswith("def ")
