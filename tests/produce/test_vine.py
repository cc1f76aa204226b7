"""VinePPO (``advantage.estimator: vineppo``): the estimator by hand, the split points, the
Monte-Carlo values of a scripted engine whose continuations succeed a known number of times
out of K, and a real step on the tiny model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from policygrad.config.train import ConfigError, load_config
from policygrad.core.advantages import estimate_advantages
from policygrad.produce.stages import FinishParts, ProducerParts
from policygrad.produce.vine import (
    finish_vine_segments,
    finish_vine_values,
    newline_tokens,
    sample_vine,
    split_points,
)
from policygrad.rewards.registry import RewardOutput
from policygrad.rollout.base import SamplingParams
from policygrad.run import Run
from policygrad.seeds import Seeds
from tests.envs.scripted import ScriptedEngine
from tests.tiny import EOS_ID, make_tiny_tokenizer

TOK = make_tiny_tokenizer()


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- the estimator


@pytest.mark.unit
def test_each_segment_gets_its_value_difference():
    # Row 0: 6 tokens in segments [0, 1] [2, 3] [4, 5]; V(s_0)=0.5, V(s_1)=0.75, V(s_2)=0.25;
    # its reward R = 1 on its last token. Row 1: 3 tokens, one segment, V(s_0) = 0.5, R = 0.
    #   row 0: segment 0: V(s_1) - V(s_0) = 0.75 - 0.5  = 0.25
    #          segment 1: V(s_2) - V(s_1) = 0.25 - 0.75 = -0.5
    #          segment 2: R - V(s_2)      = 1 - 0.25    = 0.75 (the end state's value is 0)
    #   row 1: R - V(s_0) = 0 - 0.5 = -0.5
    rewards = torch.zeros(2, 6)
    rewards[0, 5], rewards[1, 2] = 1.0, 0.0
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    values = torch.tensor([[0.5, 0.5, 0.75, 0.75, 0.25, 0.25], [0.5] * 6])
    segments = torch.tensor([[0, 0, 1, 1, 2, 2], [0] * 6], dtype=torch.float32)
    adv, ret = estimate_advantages(
        "vineppo", rewards, mask, group_index=torch.tensor([0, 0]), vine_values=values, vine_segments=segments
    )
    assert adv.tolist() == [[0.25, 0.25, -0.5, -0.5, 0.75, 0.75], [-0.5, -0.5, -0.5, 0.0, 0.0, 0.0]]
    # returns = A + V(s_i): the segment's Monte-Carlo target V(s_{i+1}) (R in the last)
    assert ret.tolist() == [[0.75, 0.75, 0.25, 0.25, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]

    # A per-token term (a KL penalty in the reward, -0.125 per token) counts in its segment:
    # every segment of row 0 has two tokens, so each advantage drops by 0.25; row 1's by 0.375.
    shaped = rewards - 0.125 * mask
    adv, _ = estimate_advantages(
        "vineppo", shaped, mask, group_index=torch.tensor([0, 0]), vine_values=values, vine_segments=segments
    )
    assert adv.tolist() == [[0.0, 0.0, -0.75, -0.75, 0.5, 0.5], [-0.875, -0.875, -0.875, 0.0, 0.0, 0.0]]


@pytest.mark.unit
def test_a_per_row_value_is_one_segment_and_inputs_are_required():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    adv, _ = estimate_advantages(
        "vineppo",
        rewards,
        mask,
        group_index=torch.tensor([0, 1]),
        vine_values=torch.tensor([0.25, 0.5]),
        vine_segments=torch.zeros(2),
    )
    assert adv.tolist() == [[0.75, 0.75], [-0.5, -0.5]]
    with pytest.raises(ValueError, match="vine_values is required"):
        estimate_advantages("vineppo", rewards, mask, group_index=torch.tensor([0, 1]))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--advantage.options.rollouts=0", "advantage.options: vineppo: rollouts must be an int >= 1"),
        ("--advantage.options.split=comma", "vineppo: split must be one of newline, fixed"),
        ("--advantage.options.segment_tokens=0", "vineppo: segment_tokens must be an int >= 1"),
        ("--advantage.options.max_splits=-1", "vineppo: max_splits must be an int >= 0"),
        ("--advantage.options.prompt_value=critic", "vineppo: prompt_value must be one of rollouts, group"),
        ("--reward.whiten=true", "set reward.whiten=false"),
        ("--env.name=guess", "needs vine_values, vine_segments, which multi-turn episodes do not provide"),
    ],
)
def test_a_bad_setting_is_one_config_error_naming_it(option, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["--advantage.estimator=vineppo", option])


@pytest.mark.unit
def test_prompt_value_group_needs_two_samples_per_prompt():
    with pytest.raises(ConfigError, match="or change advantage.options.prompt_value"):
        load_config(
            None,
            [
                "--advantage.estimator=vineppo",
                "--advantage.options.prompt_value=group",
                "--rollout.group_size=1",
            ],
        )


# ----------------------------------------------------------------------------- split points


@pytest.mark.unit
def test_newline_split_points_follow_the_token_after_each_newline():
    response = torch.tensor([ids("a\nbb\nc\n") + [EOS_ID], ids("x\n\ny") + [EOS_ID, 0, 0, 0]])
    lengths = [8, 5]
    newlines = newline_tokens(TOK, response, lengths)
    assert newlines == [
        [False, True, False, False, True, False, True, False],
        [False, True, True, False, False],
    ]
    # A newline as the response's last token before EOS still opens a state (only p = length is not one).
    points = split_points(lengths, split="newline", segment_tokens=64, max_splits=8, newlines=newlines)
    assert points == [[2, 5, 7], [2, 3]]
    # The cap keeps S evenly spaced: candidates [2, 5, 7], S = 2 -> indices 0 and 1 (floor(j * 3 / 2)).
    assert split_points(lengths, split="newline", segment_tokens=1, max_splits=2, newlines=newlines) == [
        [2, 5],
        [2, 3],
    ]
    assert split_points(lengths, split="newline", segment_tokens=1, max_splits=0, newlines=newlines) == [
        [],
        [],
    ]


@pytest.mark.unit
def test_fixed_split_points_every_l_tokens_with_the_cap():
    assert split_points([10, 4, 3], split="fixed", segment_tokens=3, max_splits=8) == [[3, 6, 9], [3], []]
    # 20 tokens, L = 2: candidates 2, 4, ..., 18 (9 of them); S = 3 keeps candidates 0, 3, 6: 2, 8, 14.
    assert split_points([20], split="fixed", segment_tokens=2, max_splits=3) == [[2, 8, 14]]
    with pytest.raises(ValueError, match="needs newlines"):
        split_points([5], split="newline", segment_tokens=2, max_splits=3)


# ----------------------------------------------------------------------------- Monte-Carlo values


class _Scorer:
    """Reward 1 when the whole response (prefix + continuation) holds a Y; a truncated one
    scores -1 (standing in for the truncation policy)."""

    def raw(self, rows, completions, *, repeat):
        assert len(completions) == len(rows) * repeat
        r = torch.tensor([1.0 if "Y" in c else 0.0 for c in completions])
        return RewardOutput(r, {}, torch.ones(len(completions), dtype=torch.bool))

    def finish_baseline(self, base, truncated):
        return torch.where(truncated, -1.0, base)


def _succeeds(text_after_prompt: str, m: int) -> bool:
    # Continuation m (0..3) of a state: from the prompt 2 of 4 succeed, after "a\n" 3 of 4, after
    # "a\nb\n" 1 of 4.
    wins = {"": 2, "a\n": 3, "a\nb\n": 1}[text_after_prompt]
    return m < wins


def _fake_parts(overrides, responses):
    config = load_config(
        None,
        [
            "--advantage.estimator=vineppo",
            "--advantage.options.rollouts=4",
            "--rollout.group_size=2",
            "--rollout.max_new_tokens=8",
            "--rollout.per_prompt_seeds=false",
            *overrides,
        ],
    )
    prompt = ids("Q?")
    engine = ScriptedEngine(lambda _, k: responses[k])  # the batch: sample k of the prompt

    def script(p, k):
        after = TOK.decode(p[len(prompt) :])
        if after.startswith("x"):
            return ids("NNNNNNNNN")  # too long for any budget: cut and truncated
        return ids("Y" if _succeeds(after, k % 4) else "N") + [EOS_ID]

    sampled = engine.generate([prompt], group_size=2, max_new_tokens=8)
    vine_engine = ScriptedEngine(script)
    r = config.rollout
    scorer = _Scorer()
    parts = ProducerParts(
        engine=vine_engine,
        tokenizer=TOK,
        score=scorer.raw,
        seeds=Seeds(0),
        params=SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p),
        max_new_tokens=r.max_new_tokens,
        ignore_eos=r.ignore_eos,
        per_prompt_seeds=r.per_prompt_seeds,
        options=config.estimator_options,
    )
    finishing = FinishParts(scorer, SimpleNamespace(total=lambda x: float(x)), config.estimator_options)
    chosen = SimpleNamespace(
        rows=[{"prompt": "Q?"}], prompt_ids=[prompt], group_size=2, rollout=sampled, step=0
    )
    return parts, finishing, chosen, sampled


@pytest.mark.unit
def test_monte_carlo_values_of_a_scripted_engine_give_the_advantages_by_hand():
    # Row 0 answers "a\nb\nc" + EOS (6 tokens, split points 2 and 4), row 1 "cc" + EOS (none).
    responses = [ids("a\nb\nc") + [EOS_ID], ids("cc") + [EOS_ID]]
    parts, finishing, chosen, sampled = _fake_parts([], responses)
    payload = sample_vine(parts, chosen)
    # States: the prompt (K = 4 from it), then row 0's "a\n" and "a\nb\n": 3 x 4 continuations
    # of 2 tokens each (a letter and EOS). A call holds at most the batch's 2 sequences, so one
    # state each, with the budget its prefix leaves.
    assert payload["splits"] == [[2, 4], []]
    assert payload["prompt_states"] == 1 and payload["sequences"] == 12 and payload["tokens"] == 24
    requests = parts.engine.requests
    assert [TOK.decode(p) for r in requests for p in r.prompts] == ["Q?", "Q?a\n", "Q?a\nb\n"]
    assert [(r.group_size, r.max_new_tokens) for r in requests] == [(4, 8), (4, 6), (4, 4)]

    batch = SimpleNamespace(group_size=2, rollout=sampled)
    values = finish_vine_values(finishing, payload, batch)
    segments = finish_vine_segments(finishing, payload, batch)
    # V(prompt) = 2/4 = 0.5, V("a\n") = 3/4 = 0.75, V("a\nb\n") = 1/4 = 0.25 (row 1: the prompt's)
    assert values.tolist() == [[0.5, 0.5, 0.75, 0.75, 0.25, 0.25], [0.5] * 6]
    assert segments.tolist() == [[0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0]]
    # Row 0 scores 1, row 1 scores 0 (their rewards on their last tokens):
    #   row 0: [0.75 - 0.5] x 2, [0.25 - 0.75] x 2, [1 - 0.25] x 2;  row 1: [0 - 0.5] x 3
    rewards = torch.zeros(2, 6)
    rewards[0, 5] = 1.0
    adv, _ = estimate_advantages(
        "vineppo",
        rewards,
        sampled.response_mask,
        group_index=sampled.group_index,
        vine_values=values,
        vine_segments=segments,
        rollouts=4,
    )
    assert adv.tolist() == [[0.25, 0.25, -0.5, -0.5, 0.75, 0.75], [-0.5, -0.5, -0.5, 0.0, 0.0, 0.0]]


@pytest.mark.unit
def test_a_continuation_past_the_response_budget_is_cut_and_truncated():
    # Row 0 "x\n" + 6 letters (8 tokens = the budget, no EOS). The state "x\n" leaves 6 tokens and
    # every continuation from it runs 9: each is cut at 6 and counts as truncated (scores -1 here).
    responses = [ids("x\nzzzzzz"), ids("cc") + [EOS_ID]]
    parts, finishing, chosen, sampled = _fake_parts([], responses)
    payload = sample_vine(parts, chosen)
    assert payload["splits"] == [[2], []] and payload["prompt_states"] == 1
    assert payload["truncated"].tolist() == [False] * 4 + [True] * 4
    assert payload["tokens"] == 4 * 2 + 4 * 6
    values = finish_vine_values(finishing, payload, SimpleNamespace(group_size=2, rollout=sampled))
    assert values[0].tolist() == [0.5, 0.5] + [-1.0] * 6


@pytest.mark.unit
def test_prompt_value_group_is_the_mean_of_the_siblings():
    responses = [ids("a\nb\nc") + [EOS_ID], ids("cc") + [EOS_ID]]
    parts, finishing, chosen, sampled = _fake_parts(["--advantage.options.prompt_value=group"], responses)
    payload = sample_vine(parts, chosen)
    assert payload["prompt_states"] == 0 and payload["sequences"] == 8  # no rollouts from the prompt
    # G = 2: V(s_0) of a row is its sibling's score (leave-one-out; its own would bias it).
    scores = SimpleNamespace(scores=torch.tensor([1.0, 0.0]))
    values = finish_vine_values(
        finishing, payload, SimpleNamespace(group_size=2, rollout=sampled, scores=scores)
    )
    assert values.tolist() == [[0.0, 0.0, 0.75, 0.75, 0.25, 0.25], [1.0] * 6]


# ----------------------------------------------------------------------------- a real step


@pytest.mark.integration
def test_a_vineppo_step_trains_and_reports_the_extra_sampling(make_config):
    options = {"rollouts": 2, "split": "fixed", "segment_tokens": 2, "max_splits": 2}
    run = Run(make_config(advantage={"estimator": "vineppo", "options": options}))
    m = run.trainer.step()
    assert m["optim/steps"] >= 1 and math.isfinite(m["policy/loss"])
    # 2 prompts x 4 samples of <= 6 tokens: at most 2 split points each (2, 4), + 2 prompt states, K = 2
    assert 0 < m["vineppo/splits_mean"] <= 2
    assert m["vineppo/extra_sequences"] == 2 * (2 + 8 * m["vineppo/splits_mean"])
    assert 0 < m["vineppo/extra_tokens"] <= m["vineppo/extra_sequences"] * 6
    assert m["time/vineppo_s"] > 0


@pytest.mark.integration
def test_vineppo_with_rollouts_ahead_and_dynamic_sampling(make_config, tmp_path):
    from policygrad.produce.production import production_from_state, production_state

    options = {"rollouts": 2, "split": "fixed", "segment_tokens": 3, "max_splits": 1}
    sections = {
        "advantage": {"estimator": "vineppo", "options": options},
        "kl": {"placement": "reward", "beta": 0.1},
    }
    # Sampled ahead: the producer thread samples the value rollouts with the batch's weights.
    ahead = Run(make_config("ahead", reward_fn="length_fraction", rollout={"max_staleness": 1}, **sections))
    try:
        metrics = [ahead.trainer.step() for _ in range(2)]
    finally:
        ahead.close()
    assert all(m["vineppo/extra_sequences"] > 0 and math.isfinite(m["policy/loss"]) for m in metrics)
    # Dynamic sampling: the value rollouts are of the groups kept, in the batch's order.
    run = Run(make_config("dynamic", reward_fn="length_fraction", drop_zero_variance_groups=True, **sections))
    try:
        m = run.trainer.step()
        groups = m["dynamic_sampling/groups_kept"] or 2  # none kept: the first round's stay
        assert m["vineppo/extra_sequences"] == 2 * (groups + 4 * groups * m["vineppo/splits_mean"])
        # the payload is tensors, lists and numbers: a checkpoint of a production keeps it
        prod = run.trainer.producer.produce(1, 1)
        path = tmp_path / "state.pt"
        torch.save(production_state(prod), path)
        back = production_from_state(torch.load(path, weights_only=True))
        assert back.inputs["vine_values"]["splits"] == prod.inputs["vine_values"]["splits"]
        assert torch.equal(back.inputs["vine_values"]["rewards"], prod.inputs["vine_values"]["rewards"])
    finally:
        run.close()
