"""The episode runner with a scripted engine and scripted environments: token exactness, masks,
rewards on the right tokens, stop reasons, limits, errors, timeouts and groups."""

# ruff: noqa: ARG001, ARG002 - environments and scripts take the protocol's arguments
from __future__ import annotations

import time

import pytest
import torch

from policygrad.envs import Environment, StepResult
from policygrad.envs.episodes import EpisodeLimits, EpisodeRunner, call_all
from tests.envs.scripted import ScriptedEngine
from tests.tiny import BOS_ID, EOS_ID, PAD_ID, make_tiny_tokenizer

pytestmark = pytest.mark.unit

TOK = make_tiny_tokenizer()


def enc(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


class Replies(Environment):
    """Replies "ok N" to turn N; done when a turn holds "!"; turn reward = turn number / 10;
    final reward 1.0 when done."""

    def reset(self, row, *, seed):
        self.turn, self.seed = 0, seed
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.turn += 1
        return StepResult(
            [{"role": "user", "content": f"ok {self.turn}"}],
            reward=self.turn / 10,
            done="!" in action,
            info={"turn": float(self.turn)},
        )

    def final_reward(self, stop_reason):
        return 1.0 if stop_reason == "done" else 0.0


def runner(env, script, **limits) -> tuple[EpisodeRunner, ScriptedEngine]:
    engine = ScriptedEngine(script)
    limits = {"max_turns": 4, "max_new_tokens": 8, **limits}
    return EpisodeRunner(env, engine, TOK, EpisodeLimits(**limits), end_ids=[EOS_ID], pad_id=PAD_ID), engine


def run(r, rows=({"prompt": "hi"},), G=2, seeds=(11,)):
    return r.run(list(rows), group_size=G, seeds=list(seeds), per_prompt_seeds=False, sampling={})


def turns_script(turns: list[list[int]]):
    """The k-th call of an episode gets ``turns[k]`` (the episode's turn counted from its
    prompt: the number of assistant headers in it)."""

    def script(prompt, seed):
        text = TOK.decode(prompt)
        k = text.count("<|im_start|>assistant") - 1
        return turns[min(k, len(turns) - 1)]

    return script


def test_sampled_ids_are_trained_verbatim_even_when_text_would_re_encode_differently():
    # Turn 1 holds a <|im_start|> id inside the answer: its text "ab" would encode as two ids.
    odd = [enc("a")[0], BOS_ID, enc("b")[0], EOS_ID]
    r, engine = runner(Replies, turns_script([odd, enc("c!") + [EOS_ID]]))
    prompts, rollout, episodes, finals = run(r, G=1)
    assert enc(TOK.decode(odd, skip_special_tokens=True)) != odd[:-1]
    ids = rollout.response_ids[0].tolist()
    action = rollout.response_mask[0] > 0
    assert ids[:4] == odd and action[:4].all()
    # The sampler's log-probs at action positions are the engine's, exactly.
    first_call = engine.requests[0]
    assert first_call.group_size == 1
    assert torch.equal(rollout.sampler_logprobs[0, :4], -(torch.arange(4) + 1).float() / 100 - 1)
    # Each turn's engine input is a prefix of the trained sequence.
    sequence = prompts[0] + ids[: int((rollout.seen_mask()[0]).sum())]
    for request in engine.requests:
        assert sequence[: len(request.prompts[0])] == request.prompts[0]
    assert episodes.stop_reasons == ["done"] and finals == ["c!"]


def test_an_ascii_conversation_is_the_chat_template_of_the_whole_conversation():
    r, _ = runner(Replies, turns_script([enc("x") + [EOS_ID], enc("yy") + [EOS_ID], enc("z!") + [EOS_ID]]))
    prompts, rollout, episodes, _ = run(r, G=1)
    seen = rollout.seen_mask()[0]
    sequence = prompts[0] + rollout.response_ids[0][seen].tolist()
    conversation = episodes.transcripts[0]
    assert [m["role"] for m in conversation] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    rendered = TOK.apply_chat_template(conversation, tokenize=False)
    assert TOK.decode(sequence) + "\n" == rendered  # ChatML ends the last turn with "\n" after <|im_end|>
    assert enc(rendered)[:-1] == sequence


def test_masks_rewards_and_stop_reasons_sit_on_the_right_tokens():
    r, _ = runner(Replies, turns_script([enc("ab") + [EOS_ID], enc("c!") + [EOS_ID]]))
    _, rollout, episodes, _ = run(r, G=2)
    # Per row: 3 action ids, the observation "\n<|im_start|>user\nok 1<|im_end|>\n<|im_start|>assistant\n"
    # (the template's delta), then 3 action ids.
    observation = (
        enc("\n") + [BOS_ID] + enc("user\nok 1") + [EOS_ID] + enc("\n") + [BOS_ID] + enc("assistant\n")
    )
    n = len(observation)
    for row in range(2):
        action = rollout.response_mask[row].tolist()
        observed = rollout.observation_mask[row].tolist()
        assert action[: 6 + n] == [1.0] * 3 + [0.0] * n + [1.0] * 3
        assert observed[: 6 + n] == [0.0] * 3 + [1.0] * n + [0.0] * 3
        assert rollout.response_ids[row, 3 : 3 + n].tolist() == observation
        assert rollout.sampler_logprobs[row, 3 : 3 + n].abs().sum() == 0
        rewards = episodes.turn_rewards[row]
        assert rewards[2].item() == pytest.approx(0.1) and rewards[5 + n].item() == pytest.approx(0.2)
        assert rewards.abs().sum().item() == pytest.approx(0.3)
    assert episodes.stop_reasons == ["done", "done"]
    assert episodes.final_rewards.tolist() == [1.0, 1.0]
    assert episodes.turns.tolist() == [2, 2]
    assert not rollout.truncated.any()
    assert episodes.info["turn"].tolist() == [1.5, 1.5]


def test_a_turn_cut_at_max_new_tokens_ends_the_episode_as_truncated():
    r, engine = runner(Replies, turns_script([enc("abc"), enc("never")]), max_new_tokens=3)
    _, rollout, episodes, finals = run(r, G=2)
    assert episodes.stop_reasons == ["length", "length"]
    assert rollout.truncated.tolist() == [True, True]
    assert episodes.turns.tolist() == [1, 1] and len(engine.requests) == 1
    assert rollout.observation_mask is None  # nothing was observed
    # The environment still judged the cut turn: its reward sits on its last token.
    assert episodes.turn_rewards[:, 2].tolist() == pytest.approx([0.1, 0.1])
    assert finals == ["abc", "abc"]


def test_max_turns_stops_without_truncation():
    r, engine = runner(Replies, turns_script([enc("a") + [EOS_ID]]), max_turns=3)
    _, rollout, episodes, _ = run(r, G=1)
    assert episodes.stop_reasons == ["max_turns"] and episodes.turns.tolist() == [3]
    assert not rollout.truncated.any()
    assert len(engine.requests) == 3


def test_the_episode_budget_and_the_context_cut_an_episode():
    long_turn = enc("abcdef") + [EOS_ID]
    r, _ = runner(Replies, turns_script([long_turn]), max_episode_tokens=40)
    _, rollout, episodes, _ = run(r, G=1)
    assert episodes.stop_reasons == ["budget"] and rollout.truncated.tolist() == [True]
    assert rollout.seen_mask()[0].sum() <= 40
    r, _ = runner(Replies, turns_script([long_turn]), max_context=70)
    prompts, rollout, episodes, _ = run(r, G=1)
    assert episodes.stop_reasons == ["context"] and rollout.truncated.tolist() == [True]
    assert len(prompts[0]) + int(rollout.seen_mask()[0].sum()) <= 70


def test_a_long_observation_keeps_its_head_and_tail():
    class Loud(Replies):
        def step(self, action):
            return StepResult([{"role": "user", "content": "HEAD" + "x" * 200 + "TAIL"}])

    r, _ = runner(Loud, turns_script([enc("a") + [EOS_ID]]), max_turns=2, max_observation_tokens=20)
    _, _, episodes, _ = run(r, G=1)
    shown = episodes.transcripts[0][2]["content"]
    assert shown.startswith("HEADxxxxxx") and shown.endswith("xxxxxxTAIL") and "\n...\n" in shown
    assert len(enc(shown)) <= 20 + len(enc("\n...\n"))


class Broken(Replies):
    """Raises in step() for rows whose prompt says "break"."""

    def reset(self, row, *, seed):
        self.broken = row["prompt"] == "break"
        return super().reset(row, seed=seed)

    def step(self, action):
        if self.broken:
            raise RuntimeError("the tool server is down")
        return super().step(action)


def test_an_environment_error_fails_that_episode_only():
    r, _ = runner(Broken, turns_script([enc("a") + [EOS_ID], enc("b!") + [EOS_ID]]))
    _, rollout, episodes, _ = run(r, rows=[{"prompt": "break"}, {"prompt": "fine"}], G=2, seeds=[1, 2])
    assert episodes.stop_reasons == ["error", "error", "done", "done"]
    assert episodes.failed.tolist() == [True, True, False, False]
    assert episodes.errors[0] == "step() failed: RuntimeError: the tool server is down"
    assert episodes.final_rewards.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert rollout.response_mask[0].sum() > 0  # the failed rows keep their tokens (no loss: scores.valid)


def test_a_hanging_environment_times_out_and_the_run_goes_on():
    class Hangs(Replies):
        def step(self, action):
            time.sleep(30)

    r, _ = runner(Hangs, turns_script([enc("a") + [EOS_ID]]), step_timeout_s=0.5)
    start = time.monotonic()
    _, _, episodes, _ = run(r, G=2)
    assert time.monotonic() - start < 10
    assert episodes.stop_reasons == ["error", "error"]
    assert "timed out after 0.5 s (rollout.env_step_timeout_s)" in episodes.errors[0]


def test_call_all_keeps_order_and_bounds_concurrency():
    running, peak = [0], [0]

    def call(k):
        def fn():
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            time.sleep(0.05)
            running[0] -= 1
            if k == 3:
                raise ValueError("three")
            return k

        return fn

    out = call_all([call(k) for k in range(6)], workers=2, timeout_s=5)
    assert out == [(True, 0), (True, 1), (True, 2), (False, "ValueError: three"), (True, 4), (True, 5)]
    assert peak[0] <= 2


def test_groups_are_the_episodes_of_one_row_and_share_its_reset_seed():
    seen = []

    class Seeds(Replies):
        def reset(self, row, *, seed):
            seen.append((row["prompt"], seed))
            return super().reset(row, seed=seed)

    r, engine = runner(Seeds, turns_script([enc("a") + [EOS_ID], enc("b!") + [EOS_ID]]))
    _, rollout, episodes, _ = run(r, rows=[{"prompt": "p"}, {"prompt": "q"}], G=3, seeds=[5, 9])
    assert rollout.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert sorted(seen) == [("p", 5)] * 3 + [("q", 9)] * 3
    first, second = engine.requests[0], engine.requests[1]
    assert first.group_size == 3 and len(first.prompts) == 2  # turn 1: one call, G samples per row
    assert second.group_size == 1 and len(second.prompts) == 6  # later turns: one row per episode
    assert len(set(second.prompt_seeds)) == 6  # each episode its own seed


def test_an_episode_does_not_depend_on_which_others_are_still_running():
    def script(prompt, seed):
        if len(prompt) < 30:
            return enc("a") + [EOS_ID]
        return enc("b" * (1 + seed % 3)) + ([EOS_ID] if seed % 2 else []) + [EOS_ID]

    r, _ = runner(Replies, script, max_turns=3)
    _, together, _, _ = run(r, rows=[{"prompt": "p"}, {"prompt": "q"}], G=2, seeds=[5, 9])
    r, _ = runner(Replies, script, max_turns=3)
    _, alone, _, _ = run(r, rows=[{"prompt": "q"}], G=2, seeds=[9])
    seen = together.seen_mask()[2:]
    assert torch.equal(together.response_ids[2:][seen], alone.response_ids[alone.seen_mask()])


def test_sys_exit_in_an_environment_fails_its_episode_at_once():
    import sys

    class Exits(Replies):
        def step(self, action):
            sys.exit(0)

    r, _ = runner(Exits, turns_script([enc("a") + [EOS_ID]]), step_timeout_s=None)
    start = time.monotonic()
    _, _, episodes, _ = run(r, G=2)
    assert time.monotonic() - start < 10  # reported as it happens: no timeout to wait for, no hang
    assert episodes.stop_reasons == ["error", "error"]
    assert episodes.errors[0] == "step() failed: SystemExit: 0"


@pytest.mark.parametrize("value", [1e39, "1", None, float("nan")])
def test_a_final_reward_float32_cannot_hold_fails_the_episode(value):
    class Huge(Replies):
        def final_reward(self, stop_reason):
            return value

    r, _ = runner(Huge, turns_script([enc("a!") + [EOS_ID]]))
    _, _, episodes, _ = run(r, G=1)
    assert episodes.stop_reasons == ["error"] and episodes.final_rewards.tolist() == [0.0]
    assert episodes.errors[0].startswith("final_reward() must be ")
    assert torch.isfinite(episodes.final_rewards).all()
