"""The sample stage's two halves: a production round-trips through a ``weights_only`` checkpoint
exactly, and dynamic sampling chooses the same groups from raw rounds as it did from scored ones."""

from __future__ import annotations

import os

import pytest
import torch

from policygrad.envs.episodes import Episodes
from policygrad.rewards.registry import RewardOutput
from policygrad.rollout.base import Rollout, SamplingParams
from policygrad.trainer.production import (
    Production,
    RawRound,
    _chosen_positions,
    production_from_state,
    production_state,
)

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


@pytest.mark.parametrize("with_episodes", [False, True], ids=["single-turn", "episodes"])
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
    assert _chosen_positions(rounds, [[2], [0, 1], [0]]) == [(0, [2]), (1, [0, 1])]
    # more than needed in one round: cut at 3
    assert _chosen_positions(rounds, [[0, 1], [0, 1, 2]]) == [(0, [0, 1]), (1, [0])]
    assert _chosen_positions(rounds, [[], []]) is None  # no group with signal
    assert _chosen_positions(rounds, None) is None  # no dynamic sampling
