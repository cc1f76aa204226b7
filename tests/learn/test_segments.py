"""An episode's earlier segments take its advantage: values worked out by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from policygrad.errors import TrainingError
from policygrad.learn.segments import extend_to_segments, first_rows, row_value
from policygrad.rollout.base import Rollout

pytestmark = pytest.mark.unit


def make_rollout(B: int, T: int = 3) -> Rollout:
    ids = torch.arange(B * T).view(B, T)
    return Rollout(
        prompt_ids=ids,
        prompt_mask=torch.ones(B, T, dtype=torch.long),
        response_ids=ids + 100,
        response_mask=torch.ones(B, T),
        truncated=torch.zeros(B, dtype=torch.bool),
        sampler_logprobs=torch.zeros(B, T),
        group_index=torch.arange(B) // 2,
        group_size=2,
    )


def batch_of(valid, owner):
    segments = SimpleNamespace(owner=torch.tensor(owner))
    return SimpleNamespace(
        scores=SimpleNamespace(valid=torch.tensor(valid)), episodes=SimpleNamespace(segments=segments)
    )


def test_a_segment_row_holds_its_episodes_advantage_and_return_on_its_own_tokens():
    # Two episodes (rows 0, 1), then two segments: of episode 1, then of episode 0.
    advantages = torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 0.75, 0.0], [0.25, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 0]],  # episode rows, then segment rows
        dtype=torch.float64,
    )
    token_rewards = torch.tensor([[0.0, 1.0, 0.0], [0.25, 0.0, 0.0]], dtype=torch.float64)
    non_score = torch.tensor([0.0, 0.0], dtype=torch.float64)
    adv, ret, loss_mask, rewards, kl, sample_tokens = extend_to_segments(
        batch_of([True, False], [1, 0]), mask, advantages, returns, token_rewards, non_score
    )
    # Segment 0 (episode 1: advantage -0.5, return from its first token 0.25) on its 3 tokens;
    # segment 1 (episode 0: 0.5, return 1.0) on its middle token only.
    assert adv.tolist() == [[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.5, 0.0]]
    assert ret.tolist() == [[1.0, 0.75, 0.0], [0.25, 0.0, 0.0], [0.25, 0.25, 0.25], [0.0, 1.0, 0.0]]
    # Episode 1 is not valid: neither it nor its segment carries loss.
    assert loss_mask.tolist() == [[1, 1, 0], [0, 0, 0], [0, 0, 0], [0, 1, 0]]
    # The rewards stay on the episodes' rows.
    assert rewards.tolist() == [[0.0, 1.0, 0.0], [0.25, 0.0, 0.0], [0.0] * 3, [0.0] * 3]
    assert kl.tolist() == [0.0] * 4
    # Each row carries its episode's loss tokens: episode 0 has 2 on its row and 1 on its segment;
    # episode 1 carries no loss (0), nor does its segment.
    assert sample_tokens.tolist() == [3.0, 0.0, 0.0, 3.0]


def test_an_episode_whose_advantages_vary_over_its_tokens_is_refused():
    advantages = torch.tensor([[0.5, 0.25]])
    with pytest.raises(TrainingError, match="agent.rewritten_history=fail"):
        row_value(advantages, torch.ones(1, 2), what="advantages", constant=True)
    # Where the mask is 0 the values do not matter; a row with no token is 0.
    values = torch.tensor([[9.0, 2.0, 2.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert row_value(values, mask, what="x", constant=True).tolist() == [2.0, 0.0]


def test_first_rows_is_the_identity_without_segments():
    rollout = make_rollout(B=4)
    ref = torch.zeros(4, rollout.response_ids.shape[1])
    assert first_rows(4, rollout, ref, None) == (rollout, ref, None)
    head, head_ref, none = first_rows(3, rollout, ref, None)
    assert head.batch_size == 3 and head_ref.shape[0] == 3 and none is None
    assert torch.equal(head.response_ids, rollout.response_ids[:3])
