"""Training with an environment, end to end on the tiny model: a one-turn environment trains bit
for bit like its reward function, and a multi-turn one runs, logs its metrics and resumes."""

# ruff: noqa: ARG002 - the environments take the protocol's arguments
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from policygrad.config.train import load_config
from policygrad.envs import Environment, StepResult
from policygrad.run import Run
from policygrad.trainer import TrainingError
from tests.training import tiny_overrides

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


class OneTurnStep(OneTurn):
    """The same reward as OneTurn, paid by ``step()`` as a turn reward (final reward 0)."""

    def step(self, action):
        return StepResult(reward=digits(action), done=True)

    def final_reward(self, stop_reason):
        return 0.0


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


@pytest.mark.parametrize("env", ["OneTurn", "OneTurnStep"])
def test_a_one_turn_environment_trains_like_its_reward_function(env, eos_model_dir, rewards_py, tmp_path):
    # The reward as the final reward or as the turn reward: the same training and the same
    # metrics, reward/* included (their group statistics are of each sample's return, so a turn
    # reward counts in reward/score, reward/std and reward/zero_variance_group_frac, and not in
    # reward/non_score, the KL part).
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
    tree["env"] = {"name": f"tests.envs.test_training:{env}"}
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
    assert {k for k in a[0] if k.startswith("reward/")} <= set(b[0])  # every reward/* was compared
    assert any(row["reward/std"] > 0 for row in a)  # the reward varied
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


class TurnLength(Environment):
    """Pays only turn rewards (final reward 0): on a prompt holding "same", 0.5 for one turn and
    done, so every episode of its group returns 0.5; on any other prompt, two turns of
    len(turn) / 40 each, which differ between a group's episodes."""

    def reset(self, row, *, seed):
        self.same = "same" in row["prompt"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        if self.same:
            return StepResult(reward=0.5, done=True)
        return StepResult([{"role": "user", "content": "More."}], reward=len(action) / 40, done=False)

    def final_reward(self, stop_reason):
        return 0.0


def test_dynamic_sampling_keeps_the_groups_whose_turn_rewards_differ(eos_model_dir, rewards_py, tmp_path):
    from tests.training import write_jsonl

    data = write_jsonl(
        tmp_path / "same.jsonl",
        [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": "the same: 2+2?", "answer": "4"}],
    )
    tree = tiny_overrides(eos_model_dir, f"{rewards_py}:digit_fraction", tmp_path / "ds", steps=1)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {**tree["rollout"], "max_turns": 2, "max_new_tokens": 4}
    tree["env"] = {"name": "tests.envs.test_training:TurnLength"}
    tree["data"] = {**tree["data"], "dataset": data, "shuffle": False}
    tree["drop_zero_variance_groups"] = True
    tree["dynamic_sampling"] = {"max_extra_rounds": 1}
    run = Run(load_config(None, tree))
    try:
        m = run.trainer.step()
        prompts = [s["prompt"] for s in run.trainer.last_samples]
    finally:
        run.close()
    # Each round samples both prompts: the "same" group (every return 0.5) is dropped, the other
    # kept, and one extra round refills the batch: 2 of the 4 groups sampled, both "1+1".
    assert m["dynamic_sampling/rounds"] == 2.0
    assert (m["dynamic_sampling/groups_sampled"], m["dynamic_sampling/groups_kept"]) == (4.0, 2.0)
    assert prompts == ["What is 1+1?"] * 8
    # the statistics see the returns: half the sampled groups are uniform, the kept ones vary
    assert m["reward/zero_variance_group_frac"] == 0.5
    assert m["reward/std"] > 0 and m["env/final_reward_mean"] == 0.0
    assert m["optim/steps"] == 1 and m["optim/grad_norm"] > 0


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_reward_non_score_is_the_kl_part_of_the_token_rewards(beta, eos_model_dir, rewards_py, tmp_path):
    from policygrad.core.masking import masked_sum

    tree = tiny_overrides(eos_model_dir, f"{rewards_py}:digit_fraction", tmp_path / "kl", steps=2)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {**tree["rollout"], "max_turns": 1}
    tree["env"] = {"name": "tests.envs.test_training:TurnLength"}  # turn rewards len / 40 only
    if beta:
        tree["kl"] = {"placement": "reward", "beta": beta}
    run = Run(load_config(None, tree))
    shaped = []
    token_rewards = run.trainer.kl.token_rewards

    def record(scores, logprobs, ref, mask, **kw):
        out = token_rewards(scores, logprobs, ref, mask, **kw)
        shaped.append(masked_sum(out, mask, dim=-1) - scores.to(out))  # what the placement added
        return out

    run.trainer.kl = copy.copy(run.trainer.kl)
    run.trainer.kl.token_rewards = record
    try:
        steps = [run.trainer.step() for _ in range(2)]
    finally:
        run.close()
    for m, kl_part in zip(steps, shaped):
        assert m["env/turn_reward_mean"] > 0  # turn rewards were paid, and are not in non_score
        assert m["reward/non_score"] == kl_part.mean().item()
        assert m["reward/score"] == m["env/turn_reward_mean"]  # score 0 + turn rewards, no row failed
    if beta:  # the policy moved after the first step: a KL part
        assert steps[1]["reward/non_score"] != 0.0
    else:
        assert [m["reward/non_score"] for m in steps] == [0.0, 0.0]


class Huge(Environment):
    """A turn reward and a final reward of 3e38 each (float32 holds each; their sum, 6e38, not)
    when ``sum`` is set, else the final reward alone."""

    sum = True

    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        return StepResult(reward=3e38 if self.sum else 0.0, done=True)

    def final_reward(self, stop_reason):
        return 3e38


class HugeFinal(Huge):
    sum = False


def test_rewards_that_sum_beyond_float32_end_the_run_naming_them(eos_model_dir, rewards_py, tmp_path, capsys):
    from policygrad.cli import main

    tree = tiny_overrides(eos_model_dir, f"{rewards_py}:digit_fraction", tmp_path / "huge", steps=2)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {**tree["rollout"], "max_turns": 1}
    tree["env"] = {"name": "tests.envs.test_training:Huge"}
    path = tmp_path / "huge.yaml"
    path.write_text(__import__("yaml").safe_dump(tree))
    assert main(["train", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1
    assert "100% of this step's episodes failed in the environment" in err[0]
    assert (
        "first error: the episode's rewards, each finite, sum to 6e+38, beyond float32's range "
        "(|x| <= 3.4e38): turn rewards summing to 3e+38, final reward 3e+38; scale the environment's "
        "rewards down"
    ) in err[0]


def test_metrics_of_rewards_near_float32s_range_are_finite(eos_model_dir, rewards_py, tmp_path):
    # Every episode's return is 3e38: no episode fails, but float32 means of 8 such values are inf.
    tree = tiny_overrides(eos_model_dir, f"{rewards_py}:digit_fraction", tmp_path / "big", steps=1)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {**tree["rollout"], "max_turns": 1}
    tree["env"] = {"name": "tests.envs.test_training:HugeFinal"}
    run = Run(load_config(None, tree))
    try:
        with pytest.raises(Exception, match="the same score"):  # every group's returns are equal: true
            run.train()
    finally:
        run.close()
    text = (tmp_path / "big" / "metrics.jsonl").read_text()
    assert "Infinity" not in text
    (row,) = _metrics(tmp_path / "big")
    for key in ("reward/mean", "reward/score", "reward/score_raw_mean", "env/final_reward_mean"):
        assert row[key] == pytest.approx(3e38, rel=1e-7), key
    assert row["reward/std"] == 0.0 and row["reward/zero_variance_group_frac"] == 1.0


class OddBig(Environment):
    """One turn, paid 3e38 when the turn's text has an odd length, else 1: each return fits
    float32, three of them in one group do not."""

    def reset(self, row, *, seed):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        return StepResult(reward=3e38 if len(action) % 2 else 1.0, done=True)


ODD_BIG = """
def odd_big(prompts, completions, **fields):
    return [3e38 if len(c) % 2 else 1.0 for c in completions]
"""


@pytest.mark.parametrize("source", ["env", "function"])
def test_rewards_whose_group_statistics_overflow_float32_end_the_run_naming_them(
    source, eos_model_dir, tmp_path
):
    # Each sample's return fits float32 (3e38 or 1), but GRPO's group sum of three 3e38 does not:
    # the advantages would be NaN and every optimizer step skipped; the step names the rewards.
    functions = tmp_path / "odd_big.py"
    functions.write_text(ODD_BIG)
    tree = tiny_overrides(eos_model_dir, f"{functions}:odd_big", tmp_path / "odd", steps=1)
    if source == "env":
        tree["reward"] = {"functions": []}
        tree["rollout"] = {**tree["rollout"], "max_turns": 1}
        tree["env"] = {"name": "tests.envs.test_training:OddBig"}
        named = "scale the environment's rewards (env.name=tests.envs.test_training:OddBig) down"
    else:
        named = f"scale reward.functions=['{functions}:odd_big'] down"
    run = Run(load_config(None, tree))
    try:
        with pytest.raises(TrainingError) as info:
            run.trainer.step()
    finally:
        run.close()
    message = str(info.value)
    assert message.startswith(
        "the advantages are not finite though every reward is (the largest |return| this step is 3e+38): "
        "the advantage estimator's sums or variances of rewards this large leave float32's range"
    )
    assert message.endswith(named)


def test_the_positive_samples_are_those_with_the_highest_return(eos_model_dir, rewards_py, tmp_path):
    # VAPO's positive-example LM loss trains on the samples of the batch's highest return: here
    # the turn rewards (len / 40) are the whole return, the scores all 0.
    tree = tiny_overrides(eos_model_dir, f"{rewards_py}:digit_fraction", tmp_path / "pos", steps=1)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {**tree["rollout"], "max_turns": 1}
    tree["env"] = {"name": "tests.envs.test_training:TurnLength"}
    tree["loss"] = {"positive_lm_coef": 0.1}
    run = Run(load_config(None, tree))
    seen = []
    experience = run.trainer.experience

    def recorded(batch, *args, **kwargs):
        seen.append((batch, experience(batch, *args, **kwargs)))
        return seen[-1][1]

    run.trainer.experience = recorded
    try:
        m = run.trainer.step()
    finally:
        run.close()
    ((batch, exp),) = seen
    returns = batch.episodes.turn_rewards.sum(-1)
    assert torch.equal(batch.scores.scores, torch.zeros(8)) and returns.min() < returns.max()
    assert torch.equal(exp.positive, (returns == returns.max()).float())
    assert 0 < m["policy/positive_frac"] < 1
