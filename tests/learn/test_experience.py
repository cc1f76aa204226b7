"""The record an RL step hands to the update: row views keep every field aligned, trimming cuts
only all-masked columns, minibatches of a shard are those a single process would use, and
micro-batches cover the rows in order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policygrad.learn.experience import PER_ROW_FIELDS, PER_TOKEN_FIELDS, Experience
from policygrad.rollout.base import Rollout

pytestmark = pytest.mark.unit


def _experience(B=6, P=3, T=5, lengths=None, *, first=0, with_optional=True) -> Experience:
    """B rows whose every value encodes (row, column): row r of the step's batch is ``first + r``;
    prompts have one column of padding in every row; response r holds ``lengths[r]`` tokens."""
    lengths = lengths or [1 + (r % 3) for r in range(B)]
    rows = torch.arange(first, first + B)
    cols = torch.arange(T)
    mask = (cols[None, :] < torch.tensor(lengths)[:, None]).float()
    token = rows[:, None].float() * 100 + cols[None, :]
    rollout = Rollout(
        prompt_ids=torch.cat([torch.zeros(B, 1, dtype=torch.long), 10 + rows[:, None].repeat(1, P - 1)], 1),
        prompt_mask=torch.cat(
            [torch.zeros(B, 1, dtype=torch.long), torch.ones(B, P - 1, dtype=torch.long)], 1
        ),
        response_ids=(20 + token.long()) * mask.long(),
        response_mask=mask,
        truncated=torch.zeros(B, dtype=torch.bool),
        sampler_logprobs=-token,
        group_index=rows // 2,
        group_size=2,
    )
    optional = {name: token + k / 10 for k, name in enumerate(PER_TOKEN_FIELDS[2:])} if with_optional else {}
    return Experience(
        rows=rows,
        rollout=rollout,
        loss_mask=mask,
        advantages=token + 0.5,
        non_score_rewards=rows.float() * -1 if with_optional else None,
        kl_coef=0.25,
        **optional,
    )


def _assert_rows(view: Experience, whole: Experience, index):
    index = torch.as_tensor(index, dtype=torch.long)
    assert torch.equal(view.rows, whole.rows[index])
    assert torch.equal(view.rollout.response_ids, whole.rollout.response_ids[index])
    assert torch.equal(view.rollout.group_index, whole.rollout.group_index[index])
    for name in PER_TOKEN_FIELDS + PER_ROW_FIELDS:
        a, b = getattr(view, name), getattr(whole, name)
        assert (a is None and b is None) or torch.equal(a, b[index]), name


def test_select_keeps_every_field_aligned_and_the_scalars():
    exp = _experience()
    view = exp.select(torch.tensor([4, 1]))
    _assert_rows(view, exp, [4, 1])
    assert view.batch_size == 2 and view.kl_coef == 0.25 and view.train_policy
    assert view.advantages[0, 2].item() == 402.5  # row 4, column 2: 4 * 100 + 2 + 0.5
    assert view.select(torch.tensor([1])).rows.tolist() == [1]  # a view of a view: step rows kept


def test_select_keeps_absent_fields_absent():
    exp = _experience(with_optional=False)
    view = exp.select(torch.tensor([0, 2]))
    assert all(getattr(view, name) is None for name in PER_TOKEN_FIELDS[2:] + PER_ROW_FIELDS)


def test_trim_cuts_every_per_token_field_to_the_longest_response():
    exp = _experience(lengths=[1, 3, 2, 1, 2, 1])
    sub = exp.select(torch.tensor([0, 2, 3])).trim()  # longest response: 2 of the 5 columns
    assert sub.rollout.response_ids.shape == (3, 2)
    assert sub.rollout.prompt_ids.shape == (3, 2)  # the all-padding prompt column is gone
    for name in PER_TOKEN_FIELDS:
        assert getattr(sub, name).shape == (3, 2), name
    assert torch.equal(sub.advantages, exp.advantages[[0, 2, 3], :2])
    assert torch.equal(sub.non_score_rewards, exp.non_score_rewards[[0, 2, 3]])  # per row: untouched
    assert sub.loss_mask.sum() == exp.loss_mask[[0, 2, 3]].sum()  # no token that carries loss is lost


def test_one_minibatch_is_the_whole_batch_in_order_and_draws_nothing():
    exp = _experience()
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    views = list(exp.minibatches(epochs=2, num_minibatches=1, generator=gen))
    assert [v.rows.tolist() for v in views] == [list(range(6))] * 2
    assert torch.equal(gen.get_state(), state)


def test_minibatches_split_one_fresh_permutation_per_epoch():
    exp = _experience()
    views = list(exp.minibatches(epochs=2, num_minibatches=3, generator=torch.Generator().manual_seed(3)))
    ref = torch.Generator().manual_seed(3)
    perms = [torch.randperm(6, generator=ref), torch.randperm(6, generator=ref)]
    assert [v.rows.tolist() for v in views] == [p[i : i + 2].tolist() for p in perms for i in (0, 2, 4)]
    for v in views:
        _assert_rows(v, exp, v.rows)


def test_minibatches_are_drawn_lazily():
    exp = _experience()
    gen = torch.Generator().manual_seed(0)
    it = exp.minibatches(epochs=3, num_minibatches=2, generator=gen)
    next(it)
    next(it)  # the first epoch: one permutation drawn
    ref = torch.Generator().manual_seed(0)
    torch.randperm(6, generator=ref)
    assert torch.equal(gen.get_state(), ref.get_state())


@pytest.mark.parametrize("world", [2, 3])
def test_minibatches_of_shards_are_those_of_a_single_process(world):
    whole = _experience(B=6, lengths=[1, 2, 3, 4, 5, 1])
    epochs, n = 2, 4
    single = list(whole.minibatches(epochs, n, torch.Generator().manual_seed(7)))
    per = 6 // world
    shards = [
        list(
            whole.select(torch.arange(r * per, (r + 1) * per)).minibatches(
                epochs, n, torch.Generator().manual_seed(7), shard=(r * per, 6)
            )
        )
        for r in range(world)
    ]
    assert all(len(s) == len(single) == epochs * n for s in shards)
    for k, view in enumerate(single):
        # The ranks' views of minibatch k hold its rows between them, each rank only its own.
        got = sorted(r for s in shards for r in s[k].rows.tolist())
        assert got == sorted(view.rows.tolist())
        for rank, s in enumerate(shards):
            rows = s[k].rows
            assert all(rank * per <= r < (rank + 1) * per for r in rows.tolist())
            _assert_rows(s[k], whole, rows)
            # each rank keeps the single-process order of its rows
            assert rows.tolist() == [r for r in view.rows.tolist() if rank * per <= r < (rank + 1) * per]


def test_micro_batches_are_consecutive_views_of_at_most_size_rows():
    exp = _experience(B=5)
    micros = list(exp.micro_batches(2))
    assert [m.rows.tolist() for m in micros] == [[0, 1], [2, 3], [4]]
    assert micros[0].rollout.response_ids.shape[1] == 5  # untrimmed
    empty = exp.select(torch.tensor([], dtype=torch.long))
    assert empty.batch_size == 0 and list(empty.micro_batches(2)) == []


def test_an_experience_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _experience().kl_coef = 1.0
