"""One episode while it runs, and what finished episodes become (:mod:`policygrad.envs.episode_state`):
the rollout's columns and the Episodes record, by hand; a call's outcome accepted or failing its
episode in one line; a group's native tools."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.envs.base import STOP_REASONS, EnvironmentFailure
from policygrad.envs.episode_state import EpisodeState, accept, group_tools, to_episodes, to_rollout
from policygrad.rollout.base import Rollout, SamplingParams

pytestmark = pytest.mark.unit

PAD = 3


def _first() -> Rollout:
    """The first turn's rollout of 2 episodes (one prompt, G = 2): only its prompt part stays."""
    return Rollout(
        prompt_ids=torch.tensor([[1, 2], [1, 2]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.long),
        response_ids=torch.tensor([[5, 6], [9, PAD]]),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        truncated=torch.tensor([False, False]),
        sampler_logprobs=torch.tensor([[-0.5, -0.25], [-2.0, 0.0]]),
        group_index=torch.tensor([0, 0]),
        group_size=2,
        sampling=SamplingParams(0.7, 5),
    )


def _episodes() -> list[EpisodeState]:
    # Episode 0: action 5 6 | observation 7 | action 8, done; turn rewards 0.5 (on 6) and 1.0 (on 8).
    done = EpisodeState({"prompt": "p"}, seed=11, reset_seed=7, ids=[5, 6, 7, 8])
    done.action = [True, True, False, True]
    done.logprobs, done.rewards, done.info = [-0.5, -0.25, 0.0, -1.0], {1: 0.5, 3: 1.0}, {"hits": [1.0, 3.0]}
    done.turns, done.final, done.stop, done.attempts = 2, 2.0, "done", 1
    done.messages = [{"role": "user", "content": "go"}]
    # Episode 1: one action 9 cut at the length limit, then its environment failed.
    cut = EpisodeState({"prompt": "p"}, seed=12, reset_seed=7, ids=[9], action=[True], logprobs=[-2.0])
    cut.turns, cut.close_error = 1, "close() raised"
    cut.fail("step() failed: boom")
    return [done, cut]


def test_the_rollout_holds_every_id_after_the_prompt_with_its_masks():
    out = to_rollout(_first(), _episodes(), PAD)
    assert out.prompt_ids.tolist() == [[1, 2], [1, 2]]  # the first turn's, unchanged
    assert out.response_ids.tolist() == [[5, 6, 7, 8], [9, PAD, PAD, PAD]]
    assert out.response_mask.tolist() == [[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    assert out.observation_mask.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert out.sampler_logprobs.tolist() == [[-0.5, -0.25, 0.0, -1.0], [-2.0, 0.0, 0.0, 0.0]]
    assert out.truncated.tolist() == [False, False]  # "error" is no cut turn
    single = _episodes()[:1]
    single[0].action, single[0].stop = [True] * 4, "length"
    alone = to_rollout(_first().select(torch.tensor([0])), single, PAD)
    assert alone.observation_mask is None and alone.truncated.tolist() == [True]  # no observation


def test_the_episodes_record_by_hand():
    out = to_episodes(_episodes(), 1.5, to_rollout(_first(), _episodes(), PAD), PAD)
    assert out.turn_rewards.tolist() == [[0.0, 0.5, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert out.final_rewards.tolist() == [2.0, 0.0] and out.turns.tolist() == [2, 1]
    assert out.stop.tolist() == [STOP_REASONS.index("done"), STOP_REASONS.index("error")]
    assert out.failed.tolist() == [False, True]
    assert out.info["hits"][0].item() == 2.0 and math.isnan(out.info["hits"][1].item())  # (1 + 3) / 2
    assert out.errors == [None, "step() failed: boom"]
    assert out.transcripts == [[{"role": "user", "content": "go"}], []]
    assert (out.env_seconds, out.retries, out.close_errors) == (1.5, 1, 1)
    assert out.restarts.tolist() == [0, 0] and out.earlier_tokens.tolist() == [[0, 0], [0, 0]]
    assert out.segments is None


def test_a_restarted_episode_by_hand():
    """Episode 0 restarted once: its earlier segment (prompt 1 2; action 5, observation 6, turn
    reward 0.5 on 5) is a row of its own, its last segment (prompt 1 4 4; action 8 with turn
    reward 1.0) is its row, and the earlier turn reward moves onto the row's last action token."""
    episodes = _episodes()
    restarted = episodes[0]
    restarted.segments = [([1, 2], [5, 6], [True, False], [-0.5, 0.0])]
    restarted.prompt, restarted.ids, restarted.action, restarted.logprobs = [1, 4, 4], [8], [True], [-1.0]
    restarted.rewards, restarted.carried, restarted.spent = {0: 1.0}, 0.5, 2
    episodes[1].prompt = [1, 2]
    rollout = to_rollout(_first(), episodes, PAD)
    assert rollout.prompt_ids.tolist() == [[1, 4, 4], [PAD, 1, 2]]  # each row's last prompt
    assert rollout.prompt_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert rollout.response_ids.tolist() == [[8], [9]]
    out = to_episodes(episodes, 0.0, rollout, PAD)
    assert out.turn_rewards.tolist() == [[1.5], [0.0]]  # 1.0 + the earlier segment's 0.5
    assert out.restarts.tolist() == [1, 0] and out.earlier_tokens.tolist() == [[1, 1], [0, 0]]
    seg = out.segments
    assert seg.owner.tolist() == [0]
    assert seg.rollout.prompt_ids.tolist() == [[1, 2]] and seg.rollout.prompt_mask.tolist() == [[1, 1]]
    assert seg.rollout.response_ids.tolist() == [[5, 6]]
    assert seg.rollout.response_mask.tolist() == [[1.0, 0.0]]
    assert seg.rollout.observation_mask.tolist() == [[0.0, 1.0]]
    assert seg.rollout.sampler_logprobs.tolist() == [[-0.5, 0.0]]
    assert seg.rollout.truncated.tolist() == [False]
    assert seg.rollout.sampling == rollout.sampling and seg.rollout.group_size == 2


def test_an_outcome_is_accepted_checked_or_fails_its_episode_in_one_line():
    e = EpisodeState({}, seed=0, reset_seed=0)
    assert accept(e, (True, 2), "step()", lambda v: v * 10) == 20 and e.stop is None
    assert accept(e, (False, "TypeError: x"), "reset()", lambda v: v) is None
    assert (e.stop, e.error) == ("error", "reset() failed: TypeError: x")

    def refuse(message):
        def check(_value):
            raise EnvironmentFailure(message)

        return check

    e = EpisodeState({}, seed=0, reset_seed=0)
    accept(e, (True, None), "step()", refuse("step() must return a StepResult"))
    assert e.error == "step() must return a StepResult"  # already names the call
    accept(e, (True, None), "final_reward()", refuse("not a number"))
    assert e.error == "final_reward() failed: not a number"


def test_a_groups_native_tools_are_its_first_live_episodes():
    tools = [{"name": "calc"}]
    failed = EpisodeState({}, seed=0, reset_seed=0, env=0, tools=[{"name": "other"}])
    failed.fail("reset() failed: x")
    unbuilt = EpisodeState({}, seed=0, reset_seed=0, tools=[{"name": "other"}])
    live = EpisodeState({}, seed=0, reset_seed=0, env=2, tools=tools)
    assert group_tools([failed, unbuilt, live]) is tools
    assert group_tools([failed, unbuilt]) is None
