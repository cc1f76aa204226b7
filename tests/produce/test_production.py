"""The sample stage's two halves: a production round-trips through a ``weights_only`` checkpoint
exactly, dynamic sampling chooses the same groups from raw rounds as it did from scored ones (with
episodes, from their raw returns), and episodes whose rewards sum beyond float32 fail."""

from __future__ import annotations

import math
import os

import pytest
import torch

from policygrad.envs.episodes import Episodes
from policygrad.envs.records import Segments
from policygrad.errors import TrainingError
from policygrad.produce.production import (
    Production,
    RawRound,
    check_segments_trainable,
    chosen_positions,
    fail_overflowing_episodes,
    production_from_state,
    production_state,
    signal_components,
)
from policygrad.produce.stages import groups_with_signal
from policygrad.rewards.registry import RewardOutput
from policygrad.rollout.base import Rollout, SamplingParams

pytestmark = pytest.mark.unit


def _round(n: int, G: int, T: int, with_episodes: bool) -> RawRound:
    B = n * G
    rollout = Rollout(
        prompt_ids=torch.arange(B * 3).reshape(B, 3),
        prompt_mask=torch.ones(B, 3, dtype=torch.long),
        response_ids=torch.arange(B * T).reshape(B, T),
        response_mask=torch.ones(B, T),
        truncated=torch.tensor([True] + [False] * (B - 1)),
        sampler_logprobs=-torch.rand(B, T, generator=torch.Generator().manual_seed(0)),
        group_index=torch.arange(n).repeat_interleave(G),
        group_size=G,
        sampling=SamplingParams(temperature=0.7, top_k=5),
    )
    rewards = RewardOutput(
        torch.linspace(0, 1, B),
        {"answer_correctness": torch.linspace(0, 1, B)},
        torch.ones(B, dtype=torch.bool),
    )
    episodes = None
    if with_episodes:
        episodes = Episodes(
            turn_rewards=torch.zeros(B, T),
            final_rewards=torch.ones(B),
            stop=torch.zeros(B, dtype=torch.long),
            turns=torch.ones(B, dtype=torch.long),
            failed=torch.zeros(B, dtype=torch.bool),
            info={"guesses": torch.full((B,), 2.0)},
            transcripts=[[{"role": "user", "content": "hi"}] for _ in range(B)],
            errors=[None] * B,
            env_seconds=0.5,
        )
        if with_episodes == "segments":  # episode 0 restarted once: a segment row of its own
            episodes.restarts = torch.tensor([1] + [0] * (B - 1))
            episodes.earlier_tokens = torch.tensor([[2, 1]] + [[0, 0]] * (B - 1))
            episodes.segments = Segments(rollout.select([0]), torch.tensor([0]))
    rows = [{"prompt": f"p{i}", "answer": str(i), "tags": ["a", "b"]} for i in range(n)]
    return RawRound(rows, [[1, 2, 3]] * n, rollout, [f"c{r}" for r in range(B)], rewards, episodes)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


@pytest.mark.parametrize(
    "with_episodes", [False, True, "segments"], ids=["single-turn", "episodes", "segments"]
)
def test_a_production_survives_a_weights_only_checkpoint(with_episodes, tmp_path):
    prod = Production(
        step=3,
        version=2,
        rounds=[_round(2, 3, 4, with_episodes), _round(2, 3, 5, with_episodes)],
        kept=[[1], [0, 1]],
        inputs={
            "baseline_rewards": {
                "rewards": torch.tensor([0.5, 1.0]),
                "truncated": torch.tensor([False, True]),
            }
        },
        seconds=1.25,
    )
    path = os.path.join(tmp_path, "state.pt")
    torch.save({"pipeline": production_state(prod)}, path)
    back = production_from_state(torch.load(path, weights_only=True)["pipeline"])
    assert isinstance(back, Production) and isinstance(back.rounds[0].rewards, RewardOutput)
    assert isinstance(back.rounds[0].rollout.sampling, SamplingParams)
    assert _same(back, prod)


def test_dynamic_sampling_takes_the_first_kept_groups_up_to_the_batch():
    rounds = [_round(3, 2, 2, False) for _ in range(3)]
    # round 0 keeps group 2, round 1 keeps groups 0 and 1, round 2 keeps 0: three are needed,
    # so round 0's and round 1's are taken and round 2's is not.
    assert chosen_positions(rounds, [[2], [0, 1], [0]]) == [(0, [2]), (1, [0, 1])]
    # more than needed in one round: cut at 3
    assert chosen_positions(rounds, [[0, 1], [0, 1, 2]]) == [(0, [0, 1]), (1, [0])]
    assert chosen_positions(rounds, [[], []]) is None  # no group with signal
    assert chosen_positions(rounds, None) is None  # no dynamic sampling


def _episodes(turn_rewards, final_rewards, failed=None) -> Episodes:
    B = len(final_rewards)
    return Episodes(
        turn_rewards=torch.tensor(turn_rewards, dtype=torch.float32),
        final_rewards=torch.tensor(final_rewards, dtype=torch.float32),
        stop=torch.zeros(B, dtype=torch.long),
        turns=torch.ones(B, dtype=torch.long),
        failed=torch.tensor(failed or [False] * B),
        errors=[None] * B,
    )


def test_episodes_whose_finite_rewards_sum_beyond_float32_fail_naming_them():
    big = 3e38  # float32 holds it (max 3.4028e38); twice it does not
    episodes = _episodes(
        [
            [0.0, big],  # 0: turn 3e38 + final 3e38 = 6e38
            [big, -big],  # 1: with final -3e38 the return is -3e38, but to the end from token 1: -6e38
            [0.5, 0.25],  # 2: 0.75 + 1: fine
            [0.0, 0.0],  # 3: the reward functions' 3e38 + final 3e38
            [float("inf"), 0.0],  # 4: two step() rewards on one token that overflowed float32
            [big, big],  # 5: already failed: left as it is
        ],
        [big, -big, 1.0, big, 0.0, 0.0],
        failed=[False] * 5 + [True],
    )
    ones = torch.ones(6, dtype=torch.bool)
    functions = RewardOutput(torch.tensor([0.0, 0.0, 0.0, big, 0.0, 0.0]), {}, ones)
    out = fail_overflowing_episodes(episodes, functions)
    assert out.failed.tolist() == [True, True, False, True, True, True]
    assert out.stop_reasons[:5] == ["error", "error", "done", "error", "error"]
    assert out.final_rewards.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # 0 on failed episodes
    assert out.errors[0] == (
        "the episode's rewards, each finite, sum to 6e+38, beyond float32's range (|x| <= 3.4e38): "
        "turn rewards summing to 3e+38, final reward 3e+38; scale the environment's rewards down"
    )
    assert "reward functions' weighted sum 3e+38" in out.errors[3] and "sum to 6e+38" in out.errors[3]
    assert "sum to -6e+38" in out.errors[1] and "sum to inf" in out.errors[4]
    assert out.errors[2] is None and out.errors[5] is None
    fine = _episodes([[0.5, 0.25]], [1.0])
    assert fail_overflowing_episodes(fine, RewardOutput(torch.zeros(1), {}, ones[:1])) is fine


def test_signal_components_of_episodes_are_their_raw_returns():
    # 2 groups of 2. Final rewards 1, 1 | 0, 0; turn rewards 0, 0.5 | 0, 0; the function 0, 0 | 1, 0;
    # episode 3 failed. env = final + turns: 1, 1.5 | 0, NaN; return = env + function: 1, 1.5 | 1, NaN.
    round_ = _round(2, 2, 2, True)
    episodes = _episodes([[0.0, 0.0], [0.0, 0.5], [0.0, 0.0], [0.0, 0.0]], [1.0, 1.0, 0.0, 0.0])
    episodes.failed[3] = True
    f = torch.tensor([0.0, 0.0, 1.0, 0.0])
    rewards = RewardOutput(f, {"f": f}, torch.ones(4, dtype=torch.bool))
    round_ = RawRound(round_.rows, round_.prompt_ids, round_.rollout, round_.completions, rewards, episodes)
    values = {k: v.tolist() for k, v in signal_components(round_).items()}
    assert values["f"] == [0.0, 0.0, 1.0, 0.0]
    assert values["env"][:3] == [1.0, 1.5, 0.0] and math.isnan(values["env"][3])
    assert values["return"][:3] == [1.0, 1.5, 1.0] and math.isnan(values["return"][3])
    # dynamic sampling on the return keeps group 0 only (group 1: a single present row decides nothing)
    assert groups_with_signal(signal_components(round_), round_.rollout.group_index, 2, 2, "return") == [0]
    assert groups_with_signal(signal_components(round_), round_.rollout.group_index, 2, 2, "f") == [1]


def test_no_group_left_suggests_the_step_timeout_only_after_a_timeout():
    from policygrad.produce.production import no_group_left

    head = (
        "every group of this step has an episode that failed in the environment env.name=m:E after "
        "rollout.env_retries=1 retries, so no group is left to train on; first error: "
    )
    raised = [None, "step() failed: RuntimeError: action length 3", None]
    assert (
        no_group_left("m:E", 1, raised)
        == head + "step() failed: RuntimeError: action length 3; fix the environment"
    )
    slow = [*raised, "step() failed: timed out after 3 s (rollout.env_step_timeout_s)"]
    assert no_group_left("m:E", 1, slow) == (
        head
        + "step() failed: RuntimeError: action length 3; fix the environment"
        + " (or raise rollout.env_step_timeout_s)"
    )
    assert no_group_left("m:E", 1, []) == head + "on another rank; fix the environment"


def test_an_environments_restart_stops_a_config_that_cannot_train_segments():
    """An agent's config is refused at start; an environment's restarts show when they happen:
    then a critic, a KL in the reward or a discount stop the run with one line naming the
    environment, the option and the fix; an outcome estimator goes on."""
    from policygrad.config.train import load_config  # the config of a run with an environment

    env = ["--env.name=builtin:guess"]
    check_segments_trainable(load_config(None, env))  # grpo, no KL in the reward: trains them
    for extra, words in (
        (["--algorithm=ppo"], "which the gae estimator's per-token advantages (a critic) does not give"),
        (["--kl.placement=reward", "--kl.beta=0.1"], "which kl.placement=reward (a KL penalty"),
    ):
        with pytest.raises(TrainingError) as info:
            check_segments_trainable(load_config(None, env + extra))
        assert str(info.value).startswith(
            "the environment env.name=builtin:guess restarted an episode's history (StepResult.restart)"
        )
        assert words in str(info.value)
        assert "use an outcome estimator (grpo, rloo, reinforce)" in str(info.value)
