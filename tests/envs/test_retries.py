"""Episodes that fail in the environment: retried from scratch on a fresh environment
(``rollout.env_retries``), deterministically; a group still failed leaves the batch whole
(``env/groups_dropped``); a step left with no group ends the run naming the environment."""

# ruff: noqa: ARG002 - environments take the protocol's arguments
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from policygrad.config.train import load_config
from policygrad.envs import Environment, StepResult
from policygrad.errors import TrainingError
from policygrad.rollout.base import prompt_seed
from policygrad.run import Run
from tests.envs.test_episodes import enc, runner, turns_script
from tests.tiny import EOS_ID

TWO_TURNS = turns_script([enc("a") + [EOS_ID], enc("b") + [EOS_ID]])


class Flaky(Environment):
    """Two turns (reward 1 each); the first instance built fails in ``when`` (reset, step or
    final_reward)."""

    built = 0
    lock = threading.Lock()
    when = "step"

    def __init__(self):
        with Flaky.lock:
            self.bad = Flaky.built == 0
            Flaky.built += 1

    def _maybe(self, where):
        if self.bad and self.when == where:
            raise RuntimeError(f"flaky {where}")

    def reset(self, row, *, seed):
        self._maybe("reset")
        self.turn = 0
        return [{"role": "user", "content": "go"}]

    def step(self, action):
        self._maybe("step")
        self.turn += 1
        return StepResult([{"role": "user", "content": "more"}], reward=1.0, done=self.turn == 2)

    def final_reward(self, stop_reason):
        self._maybe("final_reward")
        return 0.5


def _run(r, G=3):
    return r.run([{"prompt": "p"}], group_size=G, seeds=[7], per_prompt_seeds=True, sampling={})


@pytest.mark.unit
@pytest.mark.parametrize("when", ["reset", "step", "final_reward"])
def test_an_episode_that_fails_once_is_retried_on_a_fresh_environment(when, monkeypatch):
    # Today the failed episode stays failed (no retry).
    monkeypatch.setattr(Flaky, "when", when)
    monkeypatch.setattr(Flaky, "built", 0)
    r, engine = runner(Flaky, TWO_TURNS, retries=1, isolation=False)
    _, rollout, episodes, _ = _run(r)
    assert episodes.failed.tolist() == [False] * 3 and episodes.retries == 1
    assert episodes.final_rewards.tolist() == [0.5] * 3 and episodes.stop_reasons == ["done"] * 3
    assert episodes.turn_rewards.sum(-1).tolist() == [2.0] * 3
    if when != "reset":  # a retry after the first turn samples its turns again, from its own seeds
        retried = [r.prompt_seeds for r in engine.requests if r.group_size == 1 and len(r.prompt_seeds) == 1]
        # Episode g's attempt 1 samples turn k from prompt_seed(prompt_seed(its seed, -1), k),
        # its seed being prompt_seed(row seed 7, g).
        expected = [[[prompt_seed(prompt_seed(prompt_seed(7, g), -1), k)] for k in (1, 2)] for g in range(3)]
        assert retried in expected


@pytest.mark.unit
def test_retries_exhausted_leave_the_episode_failed(monkeypatch):
    monkeypatch.setattr(Flaky, "when", "step")
    monkeypatch.setattr(Flaky, "built", 0)
    monkeypatch.setattr(Flaky, "__init__", lambda self: setattr(self, "bad", True))
    r, _ = runner(Flaky, TWO_TURNS, retries=2, isolation=False)
    _, _, episodes, _ = _run(r, G=2)
    assert episodes.failed.tolist() == [True, True] and episodes.retries == 4  # 2 episodes x 2 retries
    assert episodes.errors[0] == "step() failed: RuntimeError: flaky step"


@pytest.mark.unit
def test_a_timed_out_episode_is_retried(monkeypatch):
    class Slow(Flaky):
        def step(self, action):
            if self.bad:
                time.sleep(30)
            return super().step(action)

    monkeypatch.setattr(Flaky, "built", 0)
    r, _ = runner(Slow, TWO_TURNS, retries=1, isolation=False, step_timeout_s=0.5)
    _, _, episodes, _ = _run(r, G=2)
    assert episodes.failed.tolist() == [False, False] and episodes.retries == 1


# ----------------------------------------------------------------------------------------------
# In training.


class FailsOnSomeSeeds(Environment):
    """One turn, reward 1 for an answer of 3+ characters; ``step`` raises on rows whose seed is
    even (every episode of such a group, on every attempt)."""

    def reset(self, row, *, seed):
        self.seed = seed
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, action):
        if self.seed % 2 == 0:
            raise RuntimeError("even seed")
        return StepResult(reward=float(len(action) >= 3), done=True)


class HangsAlways(FailsOnSomeSeeds):
    def step(self, action):
        time.sleep(60)


class ExitsOnce(FailsOnSomeSeeds):
    """``os._exit(0)`` in the first ``step`` of the run (a marker file says it happened)."""

    def __init__(self, marker: str):
        self.marker = marker

    def step(self, action):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return StepResult(reward=float(len(action) >= 3), done=True)
        os._exit(0)


def _train(eos_model_dir, rewards_py, out, env, steps=2, top=None, **rollout):
    from tests.training import tiny_overrides

    tree = tiny_overrides(eos_model_dir, f"{rewards_py}:digit_fraction", out, steps=steps)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {
        **tree["rollout"],
        "max_turns": 1,
        "max_new_tokens": 6,
        "prompts_per_step": 4,
        **rollout,
    }
    tree["env"] = env
    tree.update(top or {})
    run = Run(load_config(None, tree))
    try:
        run.train()
    finally:
        run.close()
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.integration
def test_groups_with_a_failed_episode_leave_the_batch_whole(eos_model_dir, rewards_py, tmp_path):
    # Today no group is dropped and nothing is retried (env/groups_dropped, env/retries absent).
    metrics = _train(
        eos_model_dir,
        rewards_py,
        tmp_path / "r",
        {"name": "tests.envs.test_retries:FailsOnSomeSeeds"},
        env_error_budget=1.0,
    )
    G = 4  # tiny_overrides' group size
    dropped = sum(m["env/groups_dropped"] for m in metrics)
    assert dropped > 0
    for m in metrics:
        failed = round(m["env/failed_frac"] * 4 * G)  # every episode of an even-seed group fails
        assert m["env/groups_dropped"] == failed / G
        assert m["env/retries"] == failed  # each failed episode was tried once more


@pytest.mark.integration
def test_a_step_whose_every_episode_times_out_names_the_environment(eos_model_dir, rewards_py, tmp_path):
    # Today: "the reward functions failed on every row and reward.on_error=skip ...".
    with pytest.raises(TrainingError) as info:
        _train(
            eos_model_dir,
            rewards_py,
            tmp_path / "t",
            {"name": "tests.envs.test_retries:HangsAlways"},
            steps=1,
            env_error_budget=1.0,
            env_step_timeout_s=0.5,
            env_retries=0,
        )
    message = str(info.value)
    assert "env.name=tests.envs.test_retries:HangsAlways" in message and "reward functions" not in message
    assert "timed out after 0.5 s (rollout.env_step_timeout_s)" in message


class FailsAlways(FailsOnSomeSeeds):
    def step(self, action):
        raise RuntimeError("always")


@pytest.mark.integration
@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_a_step_with_every_group_dropped_ends_the_run_with_or_without_dynamic_sampling(
    eos_model_dir, rewards_py, tmp_path, dynamic_sampling
):
    # Before: with drop_zero_variance_groups the step logged env/groups_dropped 4,
    # dynamic_sampling/groups_kept 0, no update, and the run ended normally with no line.
    with pytest.raises(TrainingError) as info:
        _train(
            eos_model_dir,
            rewards_py,
            tmp_path / "d",
            {"name": "tests.envs.test_retries:FailsAlways"},
            steps=1,
            top={"drop_zero_variance_groups": dynamic_sampling},
            env_error_budget=1.0,
            env_retries=0,
        )
    message = str(info.value)
    assert "env.name=tests.envs.test_retries:FailsAlways" in message and "no group is left" in message
    assert "always" in message  # the first error


@pytest.mark.integration
def test_an_environment_calling_os_exit_costs_a_retry_not_the_run(eos_model_dir, rewards_py, tmp_path):
    # Today the run (here: the test process) ends with exit status 0 and the steps are lost.
    marker = tmp_path / "exited"
    metrics = _train(
        eos_model_dir,
        rewards_py,
        tmp_path / "x",
        {"name": "tests.envs.test_retries:ExitsOnce", "options": {"marker": str(marker)}},
    )
    assert marker.exists() and len(metrics) == 2
    assert metrics[0]["env/retries"] >= 1 and metrics[0]["env/failed_frac"] == 0.0
    assert all(m["env/groups_dropped"] == 0.0 for m in metrics)
    assert os.path.isdir(tmp_path / "x")


class ExitsOnceByEnviron(ExitsOnce):
    """:class:`ExitsOnce` with its marker in ``$EXITS_ONCE_MARKER`` (the API passes a class)."""

    def __init__(self):
        super().__init__(os.environ["EXITS_ONCE_MARKER"])


@pytest.mark.integration
def test_the_api_survives_an_environment_calling_os_exit(eos_model_dir, tmp_path, monkeypatch):
    # Today policygrad.train(env=...) ends the process with exit status 0 and no line.
    import policygrad

    monkeypatch.setenv("EXITS_ONCE_MARKER", str(tmp_path / "exited"))
    summary = policygrad.train(
        eos_model_dir,
        [],
        [{"prompt": f"say {i}"} for i in range(4)],
        env=ExitsOnceByEnviron,
        steps=2,
        output_dir=str(tmp_path / "api"),
        progress=False,
        tensorboard=False,
        log_completions=0,
        rollout={"engine": "hf", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6, "max_turns": 1},
        data={"eval_size": 0},
    )
    assert summary["steps"] == 2 and (tmp_path / "exited").exists()
    assert os.path.isfile(tmp_path / "api" / "metrics.jsonl")


@pytest.mark.integration
def test_eval_env_survives_an_environment_calling_os_exit(eos_model_dir, tmp_path, monkeypatch, capsys):
    # Today `eval --env` ends with exit status 0, no line, and writes nothing.
    from policygrad.cli import main

    monkeypatch.setenv("EXITS_ONCE_MARKER", str(tmp_path / "exited"))
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say {i}.", "answer": str(i)}) + "\n" for i in range(3)))
    out = tmp_path / "episodes.jsonl"
    argv = ["eval", "--engine", "hf", "--env", "tests.envs.test_retries:ExitsOnceByEnviron", "--model"]
    argv += [eos_model_dir, "--dataset", str(data), "--max-new-tokens", "6", "--max-turns", "1"]
    assert main([*argv, "--output", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (tmp_path / "exited").exists() and result["n"] == 3 and result["failed_frac"] == 0.0
    assert len(out.read_text().splitlines()) == 3


class ChangesDirectory(FailsOnSomeSeeds):
    def step(self, action):
        os.chdir("/")
        return StepResult(reward=float(len(action) >= 3), done=True)


@pytest.mark.integration
def test_chdir_in_an_environment_leaves_the_run_where_it_is(eos_model_dir, rewards_py, tmp_path, monkeypatch):
    # Today the environment's chdir moves the trainer: a relative output_dir then lands under /.
    monkeypatch.chdir(tmp_path)
    metrics = _train(
        eos_model_dir,
        rewards_py,
        "rel",
        {"name": "tests.envs.test_retries:ChangesDirectory"},
        top={"save_every": 2},
    )
    assert os.getcwd() == str(tmp_path) and len(metrics) == 2
    assert os.path.isfile(tmp_path / "rel" / "metrics.jsonl")
    assert os.listdir(tmp_path / "rel" / "checkpoints") == ["step_2"]
