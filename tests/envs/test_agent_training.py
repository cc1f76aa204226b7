"""Training an agent, end to end on the tiny model: an agent whose calls extend their history
trains bit for bit like the equivalent environment (metrics and weights), through the config
(``agent.function``), the Python API (``policygrad.train(agent=...)``) and a resume."""

# ruff: noqa: ARG002 - the environment takes the protocol's arguments
from __future__ import annotations

import json
import math

import openai
import pytest
import torch
from safetensors.torch import load_file

from policygrad.config.train import load_config
from policygrad.envs import Environment, StepResult
from policygrad.run import Run
from tests.training import tiny_overrides

pytestmark = pytest.mark.integration

SAY_MORE = {"role": "user", "content": "Say more."}


def digits(text: str) -> float:
    return sum(ch.isdigit() for ch in text) / max(len(text), 1)


class Digits(Environment):
    """ "Say more." after every turn; done when a turn holds a 7; the final reward is the digit
    fraction of the last turn."""

    def reset(self, row, *, seed):
        self.last = ""
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.last = action
        return StepResult([SAY_MORE], done="7" in action)

    def final_reward(self, stop_reason):
        return digits(self.last)


async def digits_agent(client, row, *, window: bool = False):
    """:class:`Digits` as agent code (``window``: each call keeps only the opening, the last turn
    and the request after it)."""
    messages, last = [{"role": "user", "content": row["prompt"]}], ""
    try:
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages)
            last = reply.choices[0].message.content
            if "7" in last:
                return digits(last)
            turn = [{"role": "assistant", "content": last}, SAY_MORE]
            messages = [messages[0], *turn] if window else [*messages, *turn]
    except openai.BadRequestError:  # a limit ended the episode
        return digits(last)


def metrics(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def train(tree) -> None:
    run = Run(load_config(None, tree))
    try:
        run.train()
    finally:
        run.close()


def agent_tree(model_dir, rewards_py, out, steps, function, **agent):
    """:func:`tree_of` with ``agent.function`` = ``function`` (and other agent options)."""
    return tree_of(model_dir, rewards_py, out, steps=steps, agent={"function": function, **agent})


def tree_of(model_dir, rewards_py, out, steps=5, **extra):
    tree = tiny_overrides(model_dir, f"{rewards_py}:digit_fraction", out, steps=steps, save_every=2)
    tree["reward"] = {"functions": []}
    tree["rollout"] = {**tree["rollout"], "max_turns": 3, "max_new_tokens": 4}
    tree.update(extra)
    return tree


VOLATILE = ("time/", "perf/", "memory/")
DIGITS_AGENT = "tests.envs.test_agent_training:digits_agent"
DIGITS_ENV = "tests.envs.test_agent_training:Digits"


def assert_same_training(env_dir, agent_dir, steps: int) -> None:
    a, b = metrics(env_dir), metrics(agent_dir)
    assert len(a) == len(b) == steps
    compared = 0
    for row_a, row_b in zip(a, b):
        for key, value in row_a.items():
            if key.startswith(VOLATILE):
                continue
            same = value == row_b[key] or (
                isinstance(value, float) and math.isnan(value) and math.isnan(row_b[key])
            )
            assert same, (row_a["step"], key, value, row_b[key])
            compared += 1
        # What the agent logs beyond the environment: its tool-call counts (none here).
        extra = {"env/tool_calls", "env/malformed_tool_calls", "env/history_rewrites"}
        assert {k for k in row_b if k not in row_a} == extra
        assert row_b["env/tool_calls"] == row_b["env/history_rewrites"] == 0.0
    assert compared > steps * 40
    assert any(row["reward/std"] > 0 for row in a)  # the reward varied: the updates were not empty
    assert 1.0 < a[-1]["episode/turns_mean"] <= 3.0  # several turns, observations included
    final = f"checkpoints/step_{steps}/model/model.safetensors"
    wa, wb = load_file(env_dir / final), load_file(agent_dir / final)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_agent_trains_bit_for_bit_like_its_environment(eos_model_dir, rewards_py, tmp_path):
    train(tree_of(eos_model_dir, rewards_py, tmp_path / "env", env={"name": DIGITS_ENV}))
    train(
        tree_of(
            eos_model_dir,
            rewards_py,
            tmp_path / "agent",
            agent={"function": DIGITS_AGENT, "timeout_s": 60},
        )
    )
    assert_same_training(tmp_path / "env", tmp_path / "agent", 5)
    saved = (tmp_path / "agent" / "config.yaml").read_text()
    assert "digits_agent" in saved and "policygrad.envs.agent:AgentEnv" in saved
    # 2 + resume + 3 == 5, from the saved config (env.name and the agent's limits already applied)
    cut = agent_tree(eos_model_dir, rewards_py, tmp_path / "resumed", 2, DIGITS_AGENT, timeout_s=60)
    train(cut)
    run = Run(load_config(None, {**cut, "steps": 5}), resume_from=str(tmp_path / "resumed"))
    try:
        run.train()
    finally:
        run.close()
    assert_same_training(tmp_path / "env", tmp_path / "resumed", 5)


def test_the_api_takes_an_agent_function(eos_model_dir, rewards_py, tmp_path):
    import policygrad  # the public entry point

    train(tree_of(eos_model_dir, rewards_py, tmp_path / "env", steps=2, env={"name": DIGITS_ENV}))
    api = tree_of(eos_model_dir, rewards_py, tmp_path / "api", steps=2)
    summary = policygrad.train(agent=digits_agent, config=api)
    assert summary["steps"] == 2
    assert_same_training(tmp_path / "env", tmp_path / "api", 2)


async def fails_on_some_rows(client, row):
    """:func:`digits_agent`, but raising on rows whose answer ends in 3 or 7 (every try: its group
    leaves)."""
    if str(row["answer"]).strip()[-1] in "37":
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["prompt"]}]
        )
        raise RuntimeError("the agent's tool service refused this row")
    return await digits_agent(client, row)


def test_a_failing_agent_costs_its_groups_and_past_the_budget_stops_the_run(
    eos_model_dir, rewards_py, tmp_path, capsys
):
    from policygrad.cli import main  # the command's exit status and its one error line

    some = agent_tree(eos_model_dir, rewards_py, tmp_path / "some", 3, f"{__name__}:fails_on_some_rows")
    some["rollout"] = {**some["rollout"], "env_error_budget": 1.0, "prompts_per_step": 4}
    train(some)
    rows = metrics(tmp_path / "some")
    assert len(rows) == 3
    assert any(r["env/groups_dropped"] > 0 for r in rows)  # the failing rows' groups left whole
    assert all(r["episode/stop_error"] < 1.0 for r in rows)
    tree = agent_tree(eos_model_dir, rewards_py, tmp_path / "all", 2, "tests.envs.agents:raises", retries=0)
    path = tmp_path / "all.yaml"
    path.write_text(__import__("yaml").safe_dump(tree))
    assert main(["train", str(path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1
    assert (
        "100% of this step's episodes failed in the environment agent.function=tests.envs.agents:raises"
        in err[0]
    )
    assert "after agent.retries=0 retries" in err[0]
    assert (
        "first error: step() failed: the agent raised ValueError: the agent's own bug"
        in err[0]
    )


def test_agent_episodes_sampled_ahead_are_the_same_in_a_thread_and_inline(
    eos_model_dir, rewards_py, tmp_path
):
    # The agents' sessions run in the producer (k = 1): on its thread or inline, bit for bit.
    rows = {}
    for executor in ("thread", "inline"):
        tree = tree_of(
            eos_model_dir,
            rewards_py,
            tmp_path / executor,
            steps=3,
            agent={"function": DIGITS_AGENT},
        )
        tree["rollout"] = {**tree["rollout"], "max_staleness": 1, "async_executor": executor}
        train(tree)
        rows[executor] = [
            {
                k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
                for k, v in r.items()
                if not k.startswith((*VOLATILE, "async/overlap", "async/queue"))
            }
            for r in metrics(tmp_path / executor)
        ]
    assert rows["thread"] == rows["inline"]
    assert [r["async/staleness"] for r in rows["thread"]] == [0.0, 1.0, 1.0]


async def window_agent(client, row):
    """:func:`digits_agent` keeping only its last turn: its third call does not extend its second,
    so an episode of three turns restarts once (a segment row, then the episode's own row)."""
    return await digits_agent(client, row, window=True)


def test_an_agent_that_rewrites_its_history_trains_each_segment_with_its_episodes_advantage(
    eos_model_dir, rewards_py, tmp_path
):
    tree = agent_tree(eos_model_dir, rewards_py, tmp_path / "window", 2, f"{__name__}:window_agent")
    run = Run(load_config(None, tree))
    seen = []
    experience = run.trainer.experience

    def record(batch, *args, **kwargs):
        exp = experience(batch, *args, **kwargs)
        seen.append((batch, exp))
        return exp

    run.trainer.experience = record
    try:
        run.train()
    finally:
        run.close()
    rows = metrics(tmp_path / "window")
    assert len(rows) == 2 and all(math.isfinite(r["policy/loss"]) for r in rows)
    assert any(r["episode/restarts_mean"] > 0 for r in rows)
    segments = 0
    for batch, exp in seen:
        B, S = batch.rollout.batch_size, batch.segments
        segments += S
        assert exp.batch_size == B + S and S == int(batch.episodes.restarts.sum())
        owner = batch.episodes.segments.owner
        mask = exp.rollout.response_mask > 0
        # The group baseline counts each episode once: its rows' advantages sum to 0 per group.
        first = exp.advantages[:B].gather(-1, mask[:B].float().argmax(-1, keepdim=True)).squeeze(-1)
        groups = exp.rollout.group_index[:B]
        sums = torch.zeros(B // 2, dtype=torch.float64).index_add_(0, groups, first.double())
        assert sums.abs().max() < 1e-6, sums
        for s in range(S):
            row, episode = B + s, int(owner[s])
            assert exp.rollout.group_index[row] == exp.rollout.group_index[episode]
            assert torch.equal(exp.advantages[row][mask[row]], first[episode].expand(int(mask[row].sum())))
            assert not exp.advantages[row][~mask[row]].any()
            valid = float(batch.scores.valid[episode])
            assert torch.equal(exp.loss_mask[row], exp.rollout.response_mask[row] * valid)
            # A segment's prompt is the conversation it was sampled from: never its episode's last.
            assert not torch.equal(exp.rollout.prompt_ids[row], exp.rollout.prompt_ids[episode])
        # Each row carries its episode's loss tokens over all its rows: GRPO's seq-mean-token-mean
        # counts the episode once (tests/core/test_masking.py: as the unsplit episode).
        tokens = exp.loss_mask.sum(-1)
        episode_tokens = tokens[:B].index_add(0, owner, tokens[B:])
        assert torch.equal(exp.sample_tokens, torch.cat([episode_tokens, episode_tokens[owner]]))
    assert segments > 0
