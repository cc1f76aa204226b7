"""Training with an environment, end to end on the tiny model: a one-turn environment trains bit
for bit like its reward function, and a multi-turn one runs, logs its metrics and resumes."""

# ruff: noqa: ARG002 - the environments take the protocol's arguments
from __future__ import annotations

import json
import math

import pytest

from policygrad.envs import Environment, StepResult
from policygrad.run import Run
from policygrad.trainer.config import load_config
from tests.trainer.conftest import tiny_overrides

pytestmark = pytest.mark.integration


def digits(text: str) -> float:
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


class OneTurn(Environment):
    """The digit_fraction reward function of tests/trainer/conftest.py as a one-turn episode."""

    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.action = action
        return StepResult(done=True)

    def final_reward(self, stop_reason):
        return digits(self.action)


class Echo(Environment):
    """Answers every turn with "Say more." and a turn reward of 0.1; done when the turn holds a 7."""

    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        return StepResult(
            [{"role": "user", "content": "Say more."}], reward=0.1, done="7" in action, info={"x": 2.0}
        )

    def final_reward(self, stop_reason):
        return 1.0 if stop_reason == "done" else 0.0


def _metrics(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


VOLATILE = ("time/", "perf/", "memory/", "reward_fn/", "episode/", "env/")


def test_a_one_turn_environment_trains_like_its_reward_function(eos_model_dir, rewards_py, tmp_path):
    steps = {
        "steps": 5,
        "rollout": {"engine": "hf", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
    }
    single = load_config(
        None, tiny_overrides(eos_model_dir, f"{rewards_py}:digit_fraction", tmp_path / "a", **steps)
    )
    tree = tiny_overrides(eos_model_dir, f"{rewards_py}:digit_fraction", tmp_path / "b", **steps)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {**tree["rollout"], "max_turns": 1}
    tree["env"] = {"name": "tests.envs.test_training:OneTurn"}
    episodic = load_config(None, tree)
    for cfg in (single, episodic):
        run = Run(cfg)
        try:
            run.train()
        finally:
            run.close()
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    assert len(a) == len(b) == 5
    compared = 0
    for row_a, row_b in zip(a, b):
        for key, value in row_a.items():
            if key.startswith(VOLATILE):
                continue
            assert key in row_b, key
            same = value == row_b[key] or (
                isinstance(value, float) and math.isnan(value) and math.isnan(row_b[key])
            )
            assert same, (row_a["step"], key, value, row_b[key])
            compared += 1
    assert compared > 5 * 30
    # Every episode either ended its turn (done) or was cut at max_new_tokens (length), as the
    # single-turn run's truncated_frac says.
    assert b[-1]["episode/stop_done"] + b[-1]["episode/stop_length"] == 1.0
    assert b[-1]["episode/stop_length"] == a[-1]["response/truncated_frac"]
    assert b[-1]["episode/turns_mean"] == 1.0


def _train_echo(model_dir, rewards_py, out, *, steps: int, **rollout) -> None:
    """A run of the Echo environment: episodes of up to 3 turns of 4 new tokens."""
    tree = tiny_overrides(model_dir, f"{rewards_py}:digit_fraction", out, steps=steps)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {**tree["rollout"], "max_turns": 3, "max_new_tokens": 4, **rollout}
    tree["env"] = {"name": "tests.envs.test_training:Echo"}
    run = Run(load_config(None, tree))
    try:
        run.train()
    finally:
        run.close()


def test_a_multi_turn_run_logs_its_episodes(eos_model_dir, rewards_py, tmp_path):
    _train_echo(eos_model_dir, rewards_py, tmp_path / "m", steps=2)
    last = _metrics(tmp_path / "m")[-1]
    assert 1.0 <= last["episode/turns_mean"] <= 3.0
    stops = sum(
        last[f"episode/stop_{r}"] for r in ("done", "max_turns", "length", "budget", "context", "error")
    )
    assert stops == pytest.approx(1.0)
    assert last["env/x"] == 2.0
    assert last["episode/observation_tokens_mean"] > 0


class Down(Environment):
    """Every step fails: the tool server is down."""

    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        raise ConnectionError("tool server unreachable")


def test_past_the_error_budget_the_run_stops_with_one_line(eos_model_dir, rewards_py, tmp_path, capsys):
    from policygrad.cli import main

    tree = tiny_overrides(eos_model_dir, f"{rewards_py}:digit_fraction", tmp_path / "down", steps=2)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {**tree["rollout"], "max_new_tokens": 40, "env_error_budget": 0.5}
    tree["env"] = {"name": "tests.envs.test_training:Down"}
    path = tmp_path / "down.yaml"
    path.write_text(__import__("yaml").safe_dump(tree))
    assert main(["train", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    # Every episode whose turn ended reached step() and failed; the cut ones (no end id in 40
    # tokens) failed too, as step() judges them as well: 100% > 50%.
    assert len(err) == 1
    assert "100% of this step's episodes failed in the environment" in err[0]
    assert "env.name=tests.envs.test_training:Down" in err[0]
    assert "(rollout.env_error_budget=0.5)" in err[0]
    assert "first error: step() failed: ConnectionError: tool server unreachable" in err[0]


def test_multi_turn_episodes_sampled_ahead_are_the_same_in_a_thread_and_inline(
    eos_model_dir, rewards_py, tmp_path
):
    # Episodes (the engine and the environment's calls) run in the producer; the error budget and
    # the scores' normalisation in the trainer's thread: thread == inline, bit for bit.
    rows = {}
    for executor in ("thread", "inline"):
        _train_echo(
            eos_model_dir, rewards_py, tmp_path / executor, steps=3, max_staleness=1, async_executor=executor
        )
        rows[executor] = [
            {
                k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
                for k, v in r.items()
                if not k.startswith(("time/", "perf/", "memory/", "async/overlap", "async/queue"))
            }
            for r in _metrics(tmp_path / executor)
        ]
    assert rows["thread"] == rows["inline"]
    assert [r["async/staleness"] for r in rows["thread"]] == [0.0, 1.0, 1.0]
    assert all(r["episode/turns_mean"] >= 1.0 for r in rows["thread"])
