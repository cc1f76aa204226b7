"""The rollout batch itself: its sampling params, and the operations that list its fields."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from policygrad.rollout.base import Rollout, SamplingParams, check_sampling_args

pytestmark = pytest.mark.unit


def test_sampling_params_normalise_the_off_values():
    assert SamplingParams(1, 0, 1.0) == SamplingParams(1.0, None, None) == SamplingParams()
    p = SamplingParams(0.7, 5, 0.9, greedy=1)
    assert (p.temperature, p.top_k, p.top_p, p.greedy) == (0.7, 5, 0.9, True)
    assert type(p.temperature) is float and p.truncates and not SamplingParams(0.7).truncates
    assert p.tempered() == SamplingParams(0.7)  # the reference's distribution: no truncation
    assert hash(p) == hash(SamplingParams(0.7, 5, 0.9, True))
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # frozen
    # The same normalisation as the engines' argument check.
    _, temperature, top_k, top_p = check_sampling_args([[1]], 1, 0.7, 1.0, 0, 4)
    assert SamplingParams(0.7, 0, 1.0) == SamplingParams(temperature, top_k, top_p)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": 0.0}, ValueError, "temperature must be a finite number > 0"),
        ({"top_k": -1}, ValueError, "top_k must be >= 0"),
        ({"top_k": 2.0}, TypeError, "top_k must be an int or None"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
    ],
)
def test_sampling_params_reject_what_the_engines_reject(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


# ------------------------------------------------------------------------------------------
# Operations over every field: concat, gather, trim, select.


def _hand_rollout(prompt_lengths, response_lengths, G=2, first_token=10, sampling=None) -> Rollout:
    """n prompts x G rows, prompt i of prompt_lengths[i] tokens (left-padded), row r's response of
    response_lengths[r] tokens (right-padded); every value distinct so a misplaced one shows."""
    n, P, T = len(prompt_lengths), max(prompt_lengths), max(response_lengths)
    B = n * G
    prompt_mask = torch.tensor([[0] * (P - k) + [1] * k for k in prompt_lengths]).repeat_interleave(G, 0)
    response_mask = torch.tensor([[1.0] * k + [0.0] * (T - k) for k in response_lengths])
    ids = torch.arange(B * (P + T)).reshape(B, P + T) + first_token
    return Rollout(
        prompt_ids=ids[:, :P] * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=(ids[:, P:] * response_mask).long(),
        response_mask=response_mask,
        truncated=torch.tensor([k == T for k in response_lengths]),
        sampler_logprobs=-response_mask * (ids[:, P:] / 100),
        group_index=torch.arange(n).repeat_interleave(G),
        group_size=G,
        sampling=sampling or SamplingParams(0.7, 5),
    )


def _pad(t, width, *, left):
    extra = width - t.shape[1]
    return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra))


def _concat_by_hand(rollouts):
    """The field list ``policygrad.produce.stages.concat_batches`` wrote out before Rollout.concat."""
    P = max(r.prompt_ids.shape[1] for r in rollouts)
    T = max(r.response_ids.shape[1] for r in rollouts)
    offsets, total = [], 0
    for r in rollouts:
        offsets.append(total)
        total += int(r.group_index.max()) + 1 if r.batch_size else 0
    return dataclasses.replace(
        rollouts[0],
        prompt_ids=torch.cat([_pad(r.prompt_ids, P, left=True) for r in rollouts]),
        prompt_mask=torch.cat([_pad(r.prompt_mask, P, left=True) for r in rollouts]),
        response_ids=torch.cat([_pad(r.response_ids, T, left=False) for r in rollouts]),
        response_mask=torch.cat([_pad(r.response_mask, T, left=False) for r in rollouts]),
        sampler_logprobs=torch.cat([_pad(r.sampler_logprobs, T, left=False) for r in rollouts]),
        truncated=torch.cat([r.truncated for r in rollouts]),
        group_index=torch.cat([r.group_index + o for r, o in zip(rollouts, offsets)]),
    )


def _assert_same(a, b):
    """Every field equal: tensors in dtype, shape and value; None where None."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), f.name
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f.name
        else:
            assert x == y, f.name


BATCHES = [
    ((3, 5), (2, 4, 1, 1)),  # P = 5, T = 4
    ((7,), (6, 3)),  # the widest prompt and response
    ((2, 2, 4), (1, 1, 2, 1, 3, 1)),
]


def test_concat_equals_the_hand_listed_fields_and_renumbers_groups():
    rollouts = [_hand_rollout(p, r, first_token=100 * i) for i, (p, r) in enumerate(BATCHES)]
    joined = Rollout.concat(rollouts)
    _assert_same(joined, _concat_by_hand(rollouts))
    assert joined.group_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert joined.prompt_ids.shape == (12, 7) and joined.response_ids.shape == (12, 6)
    assert Rollout.concat(rollouts[:1]) is rollouts[0]
    with pytest.raises(ValueError, match="sampling differs"):
        Rollout.concat([rollouts[0], dataclasses.replace(rollouts[1], sampling=SamplingParams(1.0))])
    with pytest.raises(ValueError, match="at least one"):
        Rollout.concat([])


class _Collective:
    """``world`` threads acting as ranks: ``all_gather(rank, value)`` returns every rank's value."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots = [None] * world

    def all_gather(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def gather_rows(self, rank):
        """What ``Dist.gather_rows`` does: rows in rank order, dim 1 zero-padded to the widest."""

        def gather(value, *, left=False):
            parts = self.all_gather(rank, value)
            if value.dim() > 1:
                widest = max(p.shape[1] for p in parts)
                parts = [_pad(p, widest, left=left) for p in parts]
            return torch.cat(parts)

        return gather

    def run(self, fn, inputs):
        """``fn(rank, inputs[rank])`` on every rank at once; the results in rank order."""
        results = [None] * len(inputs)

        def target(rank):
            results[rank] = fn(rank, inputs[rank])

        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(len(inputs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r is not None for r in results)
        return results


def _gather_by_hand(gather_rows, rollout, offset):
    """The field list ``Dist.gather_rollout`` wrote out before Rollout.gather."""
    return dataclasses.replace(
        rollout,
        prompt_ids=gather_rows(rollout.prompt_ids, left=True),
        prompt_mask=gather_rows(rollout.prompt_mask, left=True),
        response_ids=gather_rows(rollout.response_ids),
        response_mask=gather_rows(rollout.response_mask),
        sampler_logprobs=gather_rows(rollout.sampler_logprobs),
        truncated=gather_rows(rollout.truncated),
        group_index=gather_rows(rollout.group_index + offset),
    )


def test_gather_equals_the_hand_listed_fields_and_the_concat():
    rollouts = [_hand_rollout(p, r, first_token=100 * i) for i, (p, r) in enumerate(BATCHES)]
    offsets = [0, rollouts[0].num_groups, rollouts[0].num_groups + rollouts[1].num_groups]
    collective = _Collective(3)
    new = collective.run(lambda rank, r: r.gather(collective.gather_rows(rank), offsets[rank]), rollouts)
    old = collective.run(
        lambda rank, r: _gather_by_hand(collective.gather_rows(rank), r, offsets[rank]), rollouts
    )
    for a, b in zip(new, old):
        _assert_same(a, b)
        _assert_same(a, Rollout.concat(rollouts))  # every rank holds the whole batch


def test_every_tensor_field_declares_its_layout_and_trim_select_follow_it():
    rollout = _hand_rollout((3, 5), (2, 4, 1, 1))
    for f in dataclasses.fields(Rollout):
        if f.metadata.get("layout") is None:
            assert not isinstance(getattr(rollout, f.name), torch.Tensor), f.name
    sub = rollout.select([2, 3]).trim()  # prompt 1 has 5 tokens: nothing to cut; T 4 -> 1
    assert sub.prompt_ids.shape == (2, 5) and sub.response_ids.shape == (2, 1)
    assert sub.sampler_logprobs.shape == sub.response_mask.shape == (2, 1)
    assert sub.group_index.tolist() == [1, 1] and sub.sampling == rollout.sampling
    sub = rollout.select([0, 1]).trim()  # 2 all-pad prompt columns go
    assert sub.prompt_ids.shape == (2, 3) and sub.response_ids.shape == (2, 4)
    assert torch.equal(sub.input_ids()[:, 3:], rollout.response_ids[:2])


def _observing(rollout: Rollout) -> Rollout:
    """``rollout`` with its chosen tokens 1 .. 2 of each row turned into observed ones."""
    observed = torch.zeros_like(rollout.response_mask)
    observed[:, 1:3] = rollout.response_mask[:, 1:3]
    return dataclasses.replace(
        rollout,
        response_mask=rollout.response_mask - observed,
        sampler_logprobs=rollout.sampler_logprobs * (1 - observed),
        observation_mask=observed,
    )


def test_concat_and_gather_carry_the_observation_mask():
    plain = [_hand_rollout(p, r, first_token=100 * i) for i, (p, r) in enumerate(BATCHES)]
    rollouts = [_observing(r) for r in plain]
    T = max(r.response_ids.shape[1] for r in rollouts)
    # The hand-listed concat knows no observation_mask (it would keep the first batch's: a shape
    # error); listed by hand here too.
    by_hand = dataclasses.replace(
        _concat_by_hand([dataclasses.replace(r, observation_mask=None) for r in rollouts]),
        observation_mask=torch.cat([_pad(r.observation_mask, T, left=False) for r in rollouts]),
    )
    joined = Rollout.concat(rollouts)
    _assert_same(joined, by_hand)
    assert joined.observation_mask.sum() == sum(r.observation_mask.sum() for r in rollouts) > 0
    assert torch.equal(joined.seen_mask(), Rollout.concat(plain).response_mask > 0)
    offsets = [0, rollouts[0].num_groups, rollouts[0].num_groups + rollouts[1].num_groups]
    collective = _Collective(3)
    for gathered in collective.run(
        lambda rank, r: r.gather(collective.gather_rows(rank), offsets[rank]), rollouts
    ):
        _assert_same(gathered, by_hand)
    # A batch without observations joins one with: zeros in its rows.
    mixed = Rollout.concat([plain[0], rollouts[1]])
    assert mixed.observation_mask.dtype == torch.float32
    assert mixed.observation_mask[: plain[0].batch_size].sum() == 0
    assert Rollout.concat(plain[:2]).observation_mask is None
