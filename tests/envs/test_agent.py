"""Agents as episodes: the episode runner drives agent functions (tests/envs/agents.py) through the
agent endpoint, with a scripted engine. An agent whose calls extend their history gives exactly the
ids, masks, log-probs and rewards of the equivalent environment; every failure has its outcome."""

# ruff: noqa: ARG001 - scripts take (prompt, seed)
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from policygrad.envs.agent import AgentEnv, AgentFunction, _reward, load_agent
from policygrad.envs.base import STOP_REASONS, EnvironmentFailure
from policygrad.envs.episodes import EpisodeLimits, EpisodeRunner
from policygrad.envs.guess import GuessEnv
from policygrad.envs.registry import environment_factory
from policygrad.rollout.base import prompt_seed
from tests.envs import agents
from tests.envs.scripted import ScriptedEngine
from tests.tiny import EOS_ID, PAD_ID, make_tiny_tokenizer

pytestmark = pytest.mark.unit

TOK = make_tiny_tokenizer()
ROWS = [
    {"prompt": "Guess my number from 1 to 4.", "secret": 3, "low": 1, "high": 4},
    {"prompt": "Guess my number from 1 to 4!", "secret": 1, "low": 1, "high": 4},
]


def enc(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def guesses(prompt, seed):
    """A guess from the seed (1-4), sometimes with no integer, sometimes cut (no end id)."""
    if seed % 7 == 0:
        return enc("no idea") + [EOS_ID]
    return enc(str(1 + seed % 4)) + ([] if seed % 13 == 0 else [EOS_ID])


def make_runner(make_env, *, isolation=False, **limits):
    engine = ScriptedEngine(guesses)
    limits = {"max_turns": 4, "max_new_tokens": 6, "step_timeout_s": 20.0, "isolation": isolation, **limits}
    runner = EpisodeRunner(make_env, engine, TOK, EpisodeLimits(**limits), end_ids=[EOS_ID], pad_id=PAD_ID)
    return runner, engine


def run(runner, rows=ROWS, G=3, seeds=(8, 10)):
    try:
        return runner.run(list(rows), group_size=G, seeds=list(seeds), per_prompt_seeds=True, sampling={})
    finally:
        runner.close()


def agent_env(name: str, **options):
    return environment_factory(
        "policygrad.envs.agent:AgentEnv", {"function": f"tests.envs.agents:{name}", **options}
    )


@pytest.mark.parametrize("name", ["guess", "guess_sync"])
@pytest.mark.parametrize("isolation", [False, True])
def test_an_agent_that_extends_its_history_gives_the_environments_episodes_exactly(name, isolation):
    env_prompts, env_rollout, env_episodes, env_finals = run(make_runner(GuessEnv, isolation=isolation)[0])
    prompts, rollout, episodes, finals = run(make_runner(agent_env(name), isolation=isolation)[0])
    assert prompts == env_prompts
    for field in (
        "prompt_ids",
        "prompt_mask",
        "response_ids",
        "response_mask",
        "observation_mask",
        "sampler_logprobs",
        "truncated",
        "group_index",
    ):
        assert torch.equal(getattr(rollout, field), getattr(env_rollout, field)), field
    for field in ("turn_rewards", "final_rewards", "stop", "turns", "failed"):
        assert torch.equal(getattr(episodes, field), getattr(env_episodes, field)), field
    assert episodes.transcripts == env_episodes.transcripts and finals == env_finals
    assert episodes.errors == [None] * 6
    # The script makes every kind of episode: found (done), max_turns, cut turns, a turn without
    # an integer; so the equality covers each way an episode ends.
    stops = set(episodes.stop.tolist())
    assert {0, 1, 2} <= stops, stops  # done, max_turns, length
    assert episodes.final_rewards.sum() > 0


def test_an_agent_function_object_runs_as_its_spec_does():
    by_spec = run(make_runner(agent_env("guess"))[0])
    by_object = run(make_runner(environment_factory(AgentFunction(agents.guess)))[0])
    assert torch.equal(by_spec[1].response_ids, by_object[1].response_ids)
    assert torch.equal(by_spec[2].final_rewards, by_object[2].final_rewards)


def test_named_rewards_are_summed_and_logged_however_the_episode_ended():
    runner, _ = make_runner(agent_env("named"))
    _, _, episodes, _ = run(runner, rows=ROWS[:1], G=2, seeds=[3])
    assert episodes.final_rewards.tolist() == [0.75, 0.75]  # 1.0 - 0.25
    assert episodes.info["reward_found"].tolist() == [1.0, 1.0]
    assert episodes.info["reward_style"].tolist() == [-0.25, -0.25]
    # Ended by max_turns: the agent's return after the refused call is still logged by name.
    runner, _ = make_runner(agent_env("named_after_limit"), max_turns=2)
    _, _, episodes, _ = run(runner, rows=ROWS[:1], G=2, seeds=[3])
    assert episodes.stop.tolist() != [0, 0] and episodes.errors == [None, None]
    assert episodes.final_rewards.tolist() == [-1.0, -1.0]
    assert episodes.info["reward_found"].tolist() == [0.0, 0.0]


def test_an_object_with_an_async_call_gets_the_async_client():
    runner, _ = make_runner(agent_env("async_callable"), max_turns=1)
    _, _, episodes, _ = run(runner, rows=ROWS[:1], G=1, seeds=[3])
    assert episodes.errors == [None] and episodes.final_rewards.tolist() == [0.5]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (10**400, "the reward 1000"),
        (float("nan"), "the reward nan"),
        (True, "the reward True"),
        ("1.0", "the reward '1.0'"),
        ({}, "a dict of 0 rewards"),
        ({1: 1.0}, "(string keys)"),
        ({f"k{i}": 1.0 for i in range(33)}, "a dict of 33 rewards"),
        ({"a": float("inf")}, "'a': inf"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_or_a_small_dict_of_them_is_refused(value, words):
    with pytest.raises(EnvironmentFailure, match=re.escape(words)):
        _reward(value)
    assert _reward({"a": 1, "b": 0.5}) == (1.5, {"a": 1.0, "b": 0.5})


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("raises", "the agent raised ValueError: the agent's own bug"),
        ("never_calls", "the agent returned without calling the model"),
        ("rewrites", "does not extend its history (message 0 differs"),
    ],
)
def test_an_agent_failure_fails_the_episode_with_one_line_and_is_retried(name, error):
    runner, _ = make_runner(agent_env(name, rewritten_history="fail"), retries=1)
    _, rollout, episodes, _ = run(runner, rows=ROWS[:1], G=2, seeds=[3])
    assert episodes.failed.tolist() == [True, True]
    assert episodes.retries == 2  # one fresh session each
    assert all(error in e for e in episodes.errors), episodes.errors


@pytest.mark.parametrize("isolation", [False, True])
def test_a_hanging_agent_times_out_and_nothing_waits_on_it(isolation):
    runner, _ = make_runner(agent_env("hangs"), isolation=isolation, step_timeout_s=1.0, retries=0)
    start = time.monotonic()
    _, _, episodes, _ = run(runner, rows=ROWS[:1], G=2, seeds=[3])
    assert time.monotonic() - start < 15
    assert episodes.failed.tolist() == [True, True]
    assert all("timed out after 1 s" in e for e in episodes.errors), episodes.errors


def test_an_agent_calling_os_exit_costs_its_episode_not_the_run():
    runner, _ = make_runner(agent_env("exits"), isolation=True, retries=0)
    _, _, episodes, _ = run(runner, rows=ROWS[:1], G=2, seeds=[3])
    assert episodes.failed.all()
    assert all("worker process ended" in e or "lost" in e for e in episodes.errors), episodes.errors


def test_an_episode_over_at_max_turns_refuses_the_agents_next_call():
    # An episode that did not find the secret in its one turn: the agent's second call is refused
    # with 400 and it returns 0.0 (the reward of a search that did not find it), as GuessEnv scores.
    runner, engine = make_runner(agent_env("guess"), max_turns=1)
    _, _, episodes, _ = run(runner, seeds=(1, 4))
    assert episodes.errors == [None] * 6
    stops = episodes.stop.tolist()
    assert 1 in stops and 0 in stops  # max_turns and done both happen
    assert [r for r, s in zip(episodes.final_rewards.tolist(), stops) if s == 1] == [0.0] * stops.count(1)
    assert [r for r, s in zip(episodes.final_rewards.tolist(), stops) if s == 0] == [1.0] * stops.count(0)
    assert len(engine.requests) == 1  # one turn, one generate call


TOOL_TURN = enc(
    '<tool_call>{"name": "calculate", "arguments": {"expression": "1+2"}}</tool_call>'
    "<tool_call>{oops}</tool_call>"
) + [EOS_ID]


def tool_script(prompt, seed):
    """Turn 1 writes a well-formed tool call and a malformed one; turn 2 answers in text."""
    if TOK.decode(prompt).count("<|im_start|>assistant") == 1:
        return TOOL_TURN
    return enc("3") + [EOS_ID]


def test_tool_calls_come_back_as_openai_tool_calls_and_their_results_are_observations():
    engine = ScriptedEngine(tool_script)
    limits = EpisodeLimits(max_turns=3, max_new_tokens=400, step_timeout_s=20.0)
    runner = EpisodeRunner(agent_env("tools"), engine, TOK, limits, end_ids=[EOS_ID], pad_id=PAD_ID)
    _, rollout, episodes, finals = run(runner, rows=ROWS[:1], G=1, seeds=[3])
    assert episodes.errors == [None]
    assert episodes.final_rewards.tolist() == [1.0]  # one well-formed call reached the agent
    assert episodes.info["tool_calls"].tolist() == [0.5]  # 1 then 0, averaged over the 2 turns
    assert episodes.info["malformed_tool_calls"].tolist() == [0.5]
    transcript = episodes.transcripts[0]
    assert [m["role"] for m in transcript] == ["user", "assistant", "tool", "assistant"]
    assert transcript[2]["content"] == "3"  # len("1+2"): the agent's tool result, as the template's input
    # The tool result is an observation: masked out of the loss, the sampled turns trained verbatim.
    mask, observed = rollout.response_mask[0].bool(), rollout.observation_mask[0].bool()
    ids = rollout.response_ids[0]
    assert ids[mask].tolist() == TOOL_TURN + enc("3") + [EOS_ID]
    assert TOK.decode(ids[observed].tolist()).count("3") == 1
    assert finals == ["3"]


def test_load_agent_names_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_agent("tests.envs.agents:nope")
    with pytest.raises(FileNotFoundError, match="agent file"):
        load_agent(str(tmp_path / "missing.py") + ":run")
    (tmp_path / "a.py").write_text("run = 3\n")
    with pytest.raises(TypeError, match="not a function"):
        load_agent(str(tmp_path / "a.py") + ":run")
    assert load_agent(agents.guess) is agents.guess


def test_the_turn_seeds_are_the_environments():
    runner, engine = make_runner(agent_env("guess"))
    run(runner)
    later = [s for r in engine.requests[1:] for s in r.prompt_seeds]
    assert later and all(isinstance(s, int) for s in later)
    assert engine.requests[0].prompt_seeds == [8, 10]  # turn 1: the rows' seeds, G samples each
    assert prompt_seed(prompt_seed(10, 2), 2) in later  # turn 2 of row 1's last episode


def test_agent_env_is_an_environment_with_native_tools():
    env = AgentEnv(function=agents.guess)
    assert env.describe_tools is False and env.tool_schemas() is None


def test_an_agent_built_with_the_openai_agents_sdk_runs_its_tool_calls_as_turns():
    # examples/agents/agents_sdk_agent.py: the SDK sends its instructions, the tool result and its
    # own copy of the history; every call extends the session (else the episode would fail).
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents) is not installed")
    example = Path(__file__).resolve().parents[2] / "examples" / "agents" / "agents_sdk_agent.py"
    engine = ScriptedEngine(tool_script)
    limits = EpisodeLimits(max_turns=3, max_new_tokens=400, step_timeout_s=60.0)
    make = environment_factory("policygrad.envs.agent:AgentEnv", {"function": f"{example}:run"})
    runner = EpisodeRunner(make, engine, TOK, limits, end_ids=[EOS_ID], pad_id=PAD_ID)
    _, rollout, episodes, finals = run(
        runner, rows=[{"prompt": "What is 1+2?", "answer": "3"}], G=1, seeds=[3]
    )
    assert episodes.errors == [None]
    assert [m["role"] for m in episodes.transcripts[0]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]
    assert episodes.transcripts[0][3]["content"] == "3"  # the SDK ran calculate("1+2")
    assert episodes.final_rewards.tolist() == [1.0] and finals == ["3"]
    assert rollout.response_ids[0][rollout.response_mask[0].bool()].tolist() == TOOL_TURN + enc("3") + [
        EOS_ID
    ]


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` of the runs of ones in a [T] mask."""
    out, start = [], None
    for j, v in enumerate(mask.tolist() + [0]):
        if v and start is None:
            start = j
        elif not v and start is not None:
            out.append((start, j))
            start = None
    return out


def _unpadded(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return ids[mask > 0].tolist()


@pytest.mark.parametrize("isolation", [False, True])
def test_an_agent_that_rewrites_its_history_leaves_one_segment_per_rewritten_call(isolation):
    """guess_summary plays GuessEnv's game with the same seeds, but sends a summary instead of its
    history after the first turn: the turns, stops and rewards are the environment's, and each
    turn but the last is a segment row (the opening prompt or the previous summary as its prompt,
    that turn's sampled ids as its response); the episode's row holds its last turn."""
    _, env_rollout, env_episodes, _ = run(make_runner(GuessEnv, isolation=isolation)[0])
    _, rollout, episodes, finals = run(make_runner(agent_env("guess_summary"), isolation=isolation)[0])
    for field in ("final_rewards", "stop", "turns", "failed"):
        assert torch.equal(getattr(episodes, field), getattr(env_episodes, field)), field
    cut = episodes.truncated
    # An episode restarts after every turn but its last (a cut turn ends it without a restart).
    assert episodes.restarts.tolist() == (episodes.turns - 1).tolist()
    seg = episodes.segments
    assert seg.owner.tolist() == [r for r, n in enumerate(episodes.restarts.tolist()) for _ in range(n)]
    assert seg.rollout.observation_mask is None  # a segment here is one turn: no observation in it
    env_turns = [  # each environment episode's actions, turn by turn
        [env_rollout.response_ids[r, a:b].tolist() for a, b in _runs(env_rollout.response_mask[r])]
        for r in range(env_rollout.batch_size)
    ]
    opening = [_unpadded(env_rollout.prompt_ids[r], env_rollout.prompt_mask[r]) for r in range(6)]
    s = 0
    for r in range(rollout.batch_size):
        turns = env_turns[r]
        for k in range(len(turns) - 1):  # the segments of episode r, in order
            assert _unpadded(seg.rollout.response_ids[s], seg.rollout.response_mask[s]) == turns[k]
            prompt = _unpadded(seg.rollout.prompt_ids[s], seg.rollout.prompt_mask[s])
            if k == 0:
                assert prompt == opening[r]
            else:
                assert prompt != opening[r] and "You guessed" in TOK.decode(prompt)
            s += 1
        assert _unpadded(rollout.response_ids[r], rollout.response_mask[r]) == turns[-1]
        assert rollout.observation_mask is None or not rollout.observation_mask[r].any()
        if len(turns) > 1:  # the last turn's prompt: the summary of the turn before, rendered afresh
            row = ROWS[r // 3]
            summary = f"You guessed {TOK.decode(turns[-2], skip_special_tokens=True).strip()!r}. "
            messages = [
                {"role": "user", "content": row["prompt"]},
                {"role": "user", "content": summary + judge_text(turns[-2], row)},
            ]
            text = TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert _unpadded(rollout.prompt_ids[r], rollout.prompt_mask[r]) == enc(text)
            assert episodes.transcripts[r][-2]["content"].startswith("You guessed")
    assert s == seg.rollout.batch_size > 0
    assert bool(cut.any()) and episodes.restarts.sum() > 0
    # Log-probs travel with their ids; a segment's turn is never re-sampled.
    assert not seg.rollout.sampler_logprobs[seg.rollout.response_mask == 0].any()
    assert (seg.rollout.sampler_logprobs[seg.rollout.response_mask > 0] < 0).all()
    # env/history_rewrites: the share of an episode's turns answered by a call that rewrote the
    # history, a restart or not (after the turn that ends an episode at a limit, the agent's next
    # call still comes); only the turn the agent answers by returning (found: done) has none.
    done = STOP_REASONS.index("done")
    turns, stops = episodes.turns.tolist(), episodes.stop.tolist()
    shares = [(t - 1) / t if stop == done else 1.0 for t, stop in zip(turns, stops)]
    assert torch.equal(episodes.info["history_rewrites"], torch.tensor(shares))  # float32, as logged
    assert finals == [TOK.decode(t[-1], skip_special_tokens=True) for t in env_turns]


def judge_text(ids: list[int], row) -> str:
    return agents.judge(TOK.decode(ids, skip_special_tokens=True), row)


def test_a_rewritten_history_fails_the_episode_when_the_config_says_fail():
    runner, _ = make_runner(agent_env("rewrites", rewritten_history="fail"), retries=1)
    _, _, episodes, _ = run(runner, rows=ROWS[:1], G=2, seeds=[3])
    assert episodes.failed.tolist() == [True, True] and episodes.retries == 2
    assert all("agent.rewritten_history=segment" in e for e in episodes.errors), episodes.errors
    assert episodes.segments is None and episodes.restarts.tolist() == [0, 0]


def test_a_restart_whose_prompt_leaves_no_room_stops_the_episode_as_it_was():
    """max_context fits the opening and a turn, not the summary's longer prompt: the episode
    stops on ``context`` at the restart, with no segment, its row the first turn."""
    runner, _ = make_runner(agent_env("guess_summary"), max_context=40)
    _, rollout, episodes, _ = run(runner, rows=ROWS[:1], G=3, seeds=[8])
    restarting = (episodes.turns == 1) & (episodes.stop == STOP_REASONS.index("context"))
    assert bool(restarting.any()), episodes.stop
    assert episodes.segments is None and episodes.restarts.tolist() == [0, 0, 0]


@pytest.mark.parametrize("isolation", [False, True])
def test_a_turn_cut_by_a_limit_comes_back_with_finish_reason_length(isolation):
    # max_new_tokens 1 cuts every guess (a digit, then the end id); at 6 only the scripted cut
    # ones (seed % 13 == 0, no end id) are: the reward (1.0 for "length") is the truncation.
    for max_new_tokens in (1, 6):
        limits = {"isolation": isolation, "max_turns": 1, "max_new_tokens": max_new_tokens}
        runner, _ = make_runner(agent_env("finish_reason"), **limits)
        _, rollout, episodes, _ = run(runner, rows=ROWS, G=3, seeds=[13 * 5, 10])
        assert episodes.errors == [None] * 6
        assert episodes.final_rewards.tolist() == rollout.truncated.float().tolist()
        assert bool(rollout.truncated.any()) and (max_new_tokens == 1) == bool(rollout.truncated.all())


def test_a_restarted_prompt_counts_in_the_episode_budget():
    """guess_summary's restart prompts are longer than the first turn: with a budget of 30
    tokens after the opening, a restart's prompt (the opening and the summary, ~40 tokens) no
    longer fits, so an episode that would restart stops on budget instead, without a segment;
    the same run without the budget restarts."""
    free, _ = make_runner(agent_env("guess_summary"))
    assert run(free, rows=ROWS[:1], G=3, seeds=[8])[2].restarts.sum() > 0
    runner, _ = make_runner(agent_env("guess_summary"), max_episode_tokens=30)
    _, _, episodes, _ = run(runner, rows=ROWS[:1], G=3, seeds=[8])
    assert episodes.segments is None and episodes.restarts.tolist() == [0, 0, 0]
    budget, done = STOP_REASONS.index("budget"), STOP_REASONS.index("done")
    assert all(stop in (budget, done) for stop in episodes.stop.tolist()), episodes.stop
    assert budget in episodes.stop.tolist()


def test_a_huge_restart_is_refused_before_it_is_tokenised(monkeypatch):
    runner, _ = make_runner(agent_env("restarts_huge"), max_episode_tokens=200)
    prompt = runner.delta.prompt

    def guarded(messages, **kwargs):
        assert sum(len(m["content"]) for m in messages) < 100_000, "a huge history was rendered"
        return prompt(messages, **kwargs)

    monkeypatch.setattr(runner.delta, "prompt", guarded)
    start = time.monotonic()
    _, _, episodes, _ = run(runner, rows=ROWS[:1], G=2, seeds=[3])
    assert time.monotonic() - start < 15
    assert episodes.stop.tolist() == [STOP_REASONS.index("budget")] * 2 and episodes.segments is None
    assert episodes.final_rewards.tolist() == [0.5, 0.5]  # its call refused: the episode is over
