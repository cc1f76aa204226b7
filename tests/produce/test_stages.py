"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2) in the trainer: which groups it keeps,
judged on the task outcome rather than the shaped score, and the refill of the batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policygrad.core.groups import varied_group_rows
from policygrad.envs.records import Episodes, Segments
from policygrad.produce.stages import SampledBatch, concat_batches
from policygrad.rewards.scoring import Scores
from policygrad.rollout.base import Rollout
from policygrad.run import Run
from tests.training import write_jsonl


class TruncatingEngine:
    """The producer's engine, except that the completions in ``rows`` are reported as cut at the
    length limit (the scorer reads only the flag)."""

    def __init__(self, engine, rows: list[int]):
        self.engine, self.rows = engine, rows
        self.shares_policy_weights = engine.shares_policy_weights

    def generate(self, *args, **kwargs):
        rollout = self.engine.generate(*args, **kwargs)
        truncated = torch.zeros_like(rollout.truncated)
        truncated[self.rows] = True
        return dataclasses.replace(rollout, truncated=truncated)

    def sync_weights(self, model):
        self.engine.sync_weights(model)


@pytest.mark.integration
def test_the_filter_reads_the_outcome_not_the_shaped_score(make_config):
    # Every answer scores 0 (the outcome), but the last sample of prompt 0 is cut off, so the
    # truncation penalty makes that group's shaped scores [0, 0, 0, -1]: it varies, and a filter
    # on the shaped score would keep it and train on advantages [0.5, 0.5, 0.5, -1.5] of a group
    # that carries no task signal. Filtered on the outcome, both groups go.
    cfg = make_config(
        reward_fn="zero",
        drop_zero_variance_groups=True,
        reward={"truncation": "penalty", "truncation_penalty": -1.0},
    )
    run = Run(cfg)
    sampler = run.trainer.producer.sampler  # what the producer samples with
    sampler.engine = TruncatingEngine(sampler.engine, [3])
    m = run.trainer.step()
    shaped = torch.tensor([s["reward"] for s in run.trainer.last_samples])
    assert shaped.tolist() == [0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    assert varied_group_rows(shaped, torch.arange(2).repeat_interleave(4))[0]  # the shaped score varies
    assert m["dynamic_sampling/groups_sampled"] == 2 and m["dynamic_sampling/groups_kept"] == 0
    assert m["optim/steps"] == 0 and m["reward/zero_variance_group_frac"] == 0.5


def _same_then_varied(tmp_path) -> str:
    # Rows 0-1: "same" prompts (every sample scores 1.0: no signal); rows 2-3: length_fraction.
    rows = [{"prompt": f"the same {k}: 2+2?", "answer": "4"} for k in range(2)]
    rows += [{"prompt": f"What is {a}+1?", "answer": str(a + 1)} for a in (3, 8)]
    return write_jsonl(tmp_path / "same_then_varied.jsonl", rows)


@pytest.mark.integration
@pytest.mark.parametrize("extra_rounds", [0, 1])
def test_refill_reaches_the_configured_number_of_groups(extra_rounds, make_config, tmp_path):
    cfg = make_config(
        reward_fn="constant_if_same",
        drop_zero_variance_groups=True,
        dynamic_sampling={"max_extra_rounds": extra_rounds},
        data={"dataset": _same_then_varied(tmp_path), "shuffle": False},
        loss={"entropy_coef": 0.01},
    )
    run = Run(cfg)
    trained = []
    forward = run.trainer.policy_step.forward

    def record(model, rollout, **kwargs):
        trained.append(rollout.prompt_ids.clone())
        return forward(model, rollout, **kwargs)

    run.trainer.policy_step.forward = record
    m = run.trainer.step()
    if extra_rounds == 0:
        # The first round's two groups have no signal, and no round is left to refill: no update.
        assert (m["dynamic_sampling/rounds"], m["dynamic_sampling/groups_kept"]) == (1, 0)
        assert m["optim/steps"] == 0 and not trained
        return
    # A second round samples rows 2-3, whose groups vary: the batch is full again (2 groups).
    assert m["dynamic_sampling/rounds"] == 2
    assert (m["dynamic_sampling/groups_sampled"], m["dynamic_sampling/groups_kept"]) == (4, 2)
    assert m["optim/steps"] == 1 and run.trainer.stream.position == 4
    assert [s["prompt"] for s in run.trainer.last_samples[::4]] == ["What is 3+1?", "What is 8+1?"]
    assert sum(p.shape[0] for p in trained) == 8  # the 2 kept groups x G = 4, nothing else


def _batch(prompt_lengths: list[int], response_lengths: list[int], G: int, first_token: int) -> SampledBatch:
    """A hand-made batch: prompt i has prompt_lengths[i] tokens (left-padded with 0), row r a
    response of response_lengths[r] tokens (right-padded), token ids counting from first_token."""
    n, P, T = len(prompt_lengths), max(prompt_lengths), max(response_lengths)
    B = n * G
    prompt_mask = torch.tensor([[0] * (P - k) + [1] * k for k in prompt_lengths]).repeat_interleave(G, 0)
    response_mask = torch.tensor([[1.0] * k + [0.0] * (T - k) for k in response_lengths])
    ids = torch.arange(B * (P + T)).reshape(B, P + T) + first_token
    rollout = Rollout(
        prompt_ids=ids[:, :P] * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=(ids[:, P:] * response_mask).long(),
        response_mask=response_mask,
        truncated=torch.zeros(B, dtype=torch.bool),
        sampler_logprobs=-response_mask,
        group_index=torch.arange(n).repeat_interleave(G),
        group_size=G,
    )
    raw = torch.arange(B, dtype=torch.float32) + first_token
    scores = Scores(
        raw, raw, torch.ones(B, dtype=torch.bool), torch.zeros(B, dtype=torch.bool), {"f": raw}, {}
    )
    rows = [{"prompt": f"p{first_token + i}"} for i in range(n)]
    return SampledBatch(rows, [[1] * k for k in prompt_lengths], rollout, [f"c{r}" for r in range(B)], scores)


@pytest.mark.unit
def test_select_and_concat_keep_rows_aligned_and_pad_to_the_widest():
    a = _batch([2, 3], [1, 2, 2, 1], G=2, first_token=100)  # P = 3, T = 2
    b = _batch([4], [3, 1], G=2, first_token=500)  # P = 4, T = 3
    kept = a.select_groups([1])  # rows 2, 3 of a
    assert kept.rows == [{"prompt": "p101"}] and kept.completions == ["c2", "c3"]
    assert kept.rollout.group_index.tolist() == [0, 0] and kept.scores.scores.tolist() == [102.0, 103.0]
    both = concat_batches([kept, b])
    r = both.rollout
    assert r.prompt_ids.shape == (4, 4) and r.response_ids.shape == (4, 3)
    assert r.group_index.tolist() == [0, 0, 1, 1]  # renumbered in order
    # a's prompts gain one column of left padding, its responses one of right padding: the real
    # tokens keep their order, and every padded position is masked.
    assert torch.equal(r.prompt_ids[:2, 1:], a.rollout.prompt_ids[2:]) and r.prompt_mask[:2, 0].sum() == 0
    assert (
        torch.equal(r.response_ids[:2, :2], a.rollout.response_ids[2:]) and r.response_mask[:2, 2].sum() == 0
    )
    assert torch.equal(r.response_ids[2:], b.rollout.response_ids)
    assert both.scores.scores.tolist() == [102.0, 103.0, 500.0, 501.0]
    assert both.completions == ["c2", "c3", "c0", "c1"] and [x["prompt"] for x in both.rows] == [
        "p101",
        "p500",
    ]
    assert both.scores.metrics["reward/invalid_frac"] == 0.0  # recomputed over every row


@pytest.mark.unit
def test_the_training_rollout_appends_the_segments_in_their_episodes_groups():
    """Episodes 1 and 2 (groups 0 and 1 of a 2-prompt batch, G = 2) have earlier segments; after
    select_groups([1]) only episode 2's is left, renumbered with its episode."""
    batch = _batch([2, 3], [1, 2, 2, 1], G=2, first_token=100)
    B = batch.rollout.batch_size
    seg_rows = _batch([4], [3, 1], G=2, first_token=500).rollout  # two rows that stand for segments
    episodes = Episodes(
        turn_rewards=torch.zeros(B, 2),
        final_rewards=torch.zeros(B),
        stop=torch.zeros(B, dtype=torch.long),
        turns=torch.ones(B, dtype=torch.long),
        failed=torch.zeros(B, dtype=torch.bool),
        restarts=torch.tensor([0, 1, 1, 0]),
        segments=Segments(seg_rows, torch.tensor([1, 2])),
    )
    versioned = dataclasses.replace(batch.rollout, weight_version=torch.arange(4))
    batch = dataclasses.replace(batch, rollout=versioned, episodes=episodes)
    assert batch.segments == 2
    rows = batch.training_rollout()
    assert rows.batch_size == 6 and rows.prompt_ids.shape == (6, 4) and rows.response_ids.shape == (6, 3)
    assert rows.group_index.tolist() == [0, 0, 1, 1, 0, 1]  # episode 1 is in group 0, episode 2 in group 1
    assert rows.weight_version.tolist() == [0, 1, 2, 3, 1, 2]  # each segment sampled with its episode
    assert torch.equal(rows.response_ids[4:], seg_rows.response_ids)
    assert torch.equal(rows.response_ids[:4, :2], batch.rollout.response_ids)
    kept = batch.select_groups([1])  # episodes 2, 3 become rows 0, 1
    assert kept.segments == 1 and kept.episodes.segments.owner.tolist() == [0]
    assert kept.training_rollout().group_index.tolist() == [0, 0, 0]
    plain = _batch([2], [1, 1], G=2, first_token=1)
    assert plain.training_rollout() is plain.rollout and plain.segments == 0
