"""The records of an episode run (:mod:`policygrad.envs.records`): episodes of two runs joined and
picked by row, the limits checked where they are made."""

from __future__ import annotations

import pytest
import torch

from policygrad.envs.records import Episodes
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
