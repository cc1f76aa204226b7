"""The records of an episode run (:mod:`policygrad.envs.records`): episodes of two runs joined and
picked by row, the limits checked where they are made."""

from __future__ import annotations

import pytest
import torch

from policygrad.envs.records import Episodes, Segments
from policygrad.rollout.base import Rollout
from tests.envs.test_episodes import Replies, enc, run, runner, turns_script
from tests.tiny import EOS_ID

pytestmark = pytest.mark.unit


def test_episodes_select_and_concat():
    r, _ = runner(Replies, turns_script([enc("a") + [EOS_ID], enc("b!") + [EOS_ID]]))
    _, _, a, _ = run(r, G=2)
    r, _ = runner(Replies, turns_script([enc("abc!") + [EOS_ID]]))
    _, _, b, _ = run(r, G=2)
    joined = Episodes.concat([a, b])
    assert joined.turn_rewards.shape == (4, max(a.turn_rewards.shape[1], b.turn_rewards.shape[1]))
    assert joined.stop_reasons == a.stop_reasons + b.stop_reasons
    picked = joined.select(torch.tensor([3, 0]))
    assert picked.turns.tolist() == [b.turns[1].item(), a.turns[0].item()]
    assert picked.transcripts == [b.transcripts[1], a.transcripts[0]]


def _segments(owner: list[int], first_id: int) -> Segments:
    S = len(owner)
    ids = torch.arange(first_id, first_id + S)[:, None]
    return Segments(
        Rollout(
            prompt_ids=ids,
            prompt_mask=torch.ones(S, 1, dtype=torch.long),
            response_ids=ids + 100,
            response_mask=torch.ones(S, 1),
            truncated=torch.zeros(S, dtype=torch.bool),
            sampler_logprobs=torch.zeros(S, 1),
            group_index=torch.tensor(owner),
            group_size=2,
        ),
        torch.tensor(owner),
    )


def test_segments_follow_their_episodes_through_select_and_concat():
    # Batch a: 3 episodes, segments of episode 2 (ids 10, 11) and 0 (id 12); batch b: 2 episodes,
    # a segment of episode 1 (id 20).
    a, b = _segments([2, 2, 0], 10), _segments([1], 20)
    joined = Segments.concat([(a, 3), (None, 4), (b, 2)])  # b's episodes come after 3 + 4
    assert joined.owner.tolist() == [2, 2, 0, 8]
    assert joined.rollout.prompt_ids.flatten().tolist() == [10, 11, 12, 20]
    assert joined.rollout.group_index.tolist() == [2, 2, 0, 1]  # kept: a segment's group is its episode's
    picked = joined.select([8, 5, 2])  # episodes 8, 5 (none), 2 become rows 0, 1, 2
    assert picked.owner.tolist() == [0, 2, 2]
    assert picked.rollout.prompt_ids.flatten().tolist() == [20, 10, 11]
    assert joined.select([1, 3]) is None
    assert Segments.concat([(None, 3)]) is None
