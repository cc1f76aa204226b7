"""``Scorer``: reward functions, then normalisation, then the truncation policy, then failed rows
filled with their group's mean; its ``baseline`` scores through the same steps without updating
the statistics; ``Scores.select`` picks rows."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.rewards.normalize import RewardNormalizer
from policygrad.rewards.registry import CompositeReward, RewardFunctionError, RewardOutput
from policygrad.rewards.scoring import EnvironmentScores, Scorer, Scores
from tests.rollout.test_base import _Collective

pytestmark = pytest.mark.unit

ROWS = [{"prompt": "p0", "answer": "a"}, {"prompt": "p1", "answer": "b"}]
# Two prompts x G = 2: rows 0, 1 are p0's group, rows 2, 3 p1's.
COMPLETIONS = ["x", "yy", "zzz", "w"]
GROUPS = torch.tensor([0, 0, 1, 1])
NO_TRUNCATION = torch.tensor([False, False, False, False])


def length(_prompts, completions, **_fields):
    """The completion's length: 1, 2, 3, 1 on COMPLETIONS."""
    return [len(c) for c in completions]


def length_but_not_zzz(_prompts, completions, **_fields):
    """As :func:`length`, but no score (None) for ``zzz``: that row fails."""
    return [None if c == "zzz" else len(c) for c in completions]


def scorer(fn=length, mode="none", **kwargs):
    return Scorer(CompositeReward([fn], on_error="skip"), RewardNormalizer(mode), **kwargs)


def test_plain_scores_are_the_reward_functions_sum():
    seen = {}

    def recording(prompts, completions, **fields):
        seen.update(prompts=prompts, completions=completions, **fields)
        return length(prompts, completions)

    out = scorer(recording)(ROWS, COMPLETIONS, NO_TRUNCATION, GROUPS, group_size=2)
    # Each row's prompt and fields repeated once per sample of its group.
    assert seen == {
        "prompts": ["p0", "p0", "p1", "p1"],
        "completions": COMPLETIONS,
        "answer": ["a", "a", "b", "b"],
    }
    assert out.scores.tolist() == out.raw.tolist() == [1.0, 2.0, 3.0, 1.0]
    assert out.scores.dtype == out.raw.dtype == torch.float32
    assert out.valid.tolist() == [True] * 4 and out.failed.tolist() == [False] * 4
    assert {k: v.tolist() for k, v in out.components.items()} == {"recording": [1.0, 2.0, 3.0, 1.0]}
    assert out.metrics["reward/invalid_frac"] == 0.0
    assert out.metrics["reward_fn/recording/mean"] == pytest.approx(7 / 4, abs=1e-7)


def test_normalisation_comes_before_the_eos_penalty():
    s = scorer(mode="fixed_offset", truncation="penalty", truncation_penalty=-1.0)
    truncated = torch.tensor([False, True, False, False])
    out = s(ROWS, COMPLETIONS, truncated, GROUPS, group_size=2)
    # offset = mean(1, 2, 3, 1) = 1.75 -> [-0.75, 0.25, 1.25, -0.75]; row 1 then gets exactly -1.
    assert out.scores.tolist() == pytest.approx([-0.75, -1.0, 1.25, -0.75], abs=1e-7)
    assert out.raw.tolist() == [1.0, 2.0, 3.0, 1.0]  # the raw sum is before both
    assert out.valid.tolist() == [True] * 4  # a penalised row still takes part


def test_truncation_exclude_leaves_rows_out_of_the_loss_unchanged():
    truncated = torch.tensor([True, False, False, True])
    out = scorer(truncation="exclude")(ROWS, COMPLETIONS, truncated, GROUPS, group_size=2)
    assert out.scores.tolist() == [1.0, 2.0, 3.0, 1.0]
    assert out.valid.tolist() == [False, True, True, False]
    assert out.failed.tolist() == [False] * 4  # excluded is not failed


def test_a_failed_row_gets_its_groups_mean_and_leaves_the_loss():
    out = scorer(length_but_not_zzz)(ROWS, COMPLETIONS, NO_TRUNCATION, GROUPS, group_size=2)
    # Row 2 failed: raw 0, component NaN; its score is the mean of its group's other row (row 3: 1).
    assert out.scores.tolist() == [1.0, 2.0, 1.0, 1.0]
    assert out.raw.tolist() == [1.0, 2.0, 0.0, 1.0]
    assert out.valid.tolist() == [True, True, False, True]
    assert out.failed.tolist() == [False, False, True, False]
    component = out.components["length_but_not_zzz"]
    assert math.isnan(component[2]) and component[[0, 1, 3]].tolist() == [1.0, 2.0, 1.0]
    assert out.metrics["reward/invalid_frac"] == 0.25
    assert out.metrics["reward_fn/length_but_not_zzz/mean"] == pytest.approx(4 / 3, abs=1e-6)
    assert out.metrics["reward_fn/length_but_not_zzz/invalid"] == 1.0


def test_with_an_environment_a_failed_row_gets_its_groups_mean_return():
    # One group of 4: the environment's final rewards 0, 1, 2, 0 and turn rewards 1, 0, 0, 5;
    # row 3's episode failed (its turn rewards dropped by the trainer: 0 here). The reward
    # functions: none (zeros). Returns of the present rows: 0+1, 1+0, 2+0 = 1, 1, 2: mean 4/3,
    # which row 3's score is, so its return (score + 0) is its group's mean return.
    env = EnvironmentScores(
        final_rewards=torch.tensor([0.0, 1.0, 2.0, 0.0]),
        returns=torch.tensor([1.0, 1.0, 2.0, 5.0]),
        failed=torch.tensor([False, False, False, True]),
        turn_rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]),
    )
    s = Scorer(None, RewardNormalizer("none"))
    out = s.finish(
        s.raw(ROWS[:1], ["a"] * 4, repeat=4),
        torch.zeros(4, dtype=torch.bool),
        torch.zeros(4, dtype=torch.long),
        env=env,
    )
    # the final rewards: the turn rewards stay on their tokens
    assert out.scores[:3].tolist() == [0.0, 1.0, 2.0]
    assert out.scores[3].item() == pytest.approx(4 / 3, abs=1e-7)
    assert out.raw.tolist() == [1.0, 1.0, 2.0, 0.0]  # the raw return: final + turn rewards (0 failed)
    assert out.failed.tolist() == [False, False, False, True]
    env_component = out.components["env"]
    assert env_component[:3].tolist() == [1.0, 1.0, 2.0] and math.isnan(env_component[3])


def test_running_statistics_come_from_the_valid_rows_only():
    s = scorer(length_but_not_zzz, mode="running")
    out = s(ROWS, COMPLETIONS, NO_TRUNCATION, GROUPS, group_size=2)
    # Valid scores 1, 2, 1: mean 4/3, population variance ((1/3)^2 * 2 + (2/3)^2) / 3 = 2/9, std
    # sqrt(2)/3. Rows 0, 3: (-1/3) / (sqrt(2)/3) = -1/sqrt(2); row 1: (2/3) / (sqrt(2)/3) = sqrt(2);
    # failed row 2 takes row 3's -1/sqrt(2).
    r = 1 / math.sqrt(2)
    assert (s.normalizer.count, s.normalizer.mean) == (3, pytest.approx(4 / 3, abs=1e-12))
    assert out.scores.tolist() == pytest.approx([-r, math.sqrt(2), -r, -r], abs=1e-6)


def test_baseline_uses_the_statistics_without_updating_them():
    s = scorer(length_but_not_zzz, mode="running", truncation="penalty", truncation_penalty=-1.0)
    s(ROWS, COMPLETIONS, NO_TRUNCATION, GROUPS, group_size=2)  # mean 4/3, std sqrt(2)/3 (above)
    base = s.baseline(ROWS, ["x", "yyyy"], torch.tensor([False, True]))
    # Row 0: (1 - 4/3) / (sqrt(2)/3) = -1/sqrt(2); row 1 is truncated: exactly -1.
    assert base.tolist() == pytest.approx([-1 / math.sqrt(2), -1.0], abs=1e-6)
    assert s.normalizer.count == 3  # not updated


def test_baseline_of_a_fresh_fixed_offset_sets_no_offset():
    s = scorer(mode="fixed_offset")
    assert s.baseline(ROWS, ["abc", "a"], torch.tensor([False, False])).tolist() == [3.0, 1.0]
    assert s.normalizer.offset is None  # the first training batch still sets it
    out = s(ROWS, COMPLETIONS, NO_TRUNCATION, GROUPS, group_size=2)
    assert out.scores.tolist() == pytest.approx([-0.75, 0.25, 1.25, -0.75], abs=1e-7)


def test_on_error_raise_lets_the_reward_error_through():
    s = Scorer(CompositeReward([length_but_not_zzz], on_error="raise"), RewardNormalizer("none"))
    with pytest.raises(RewardFunctionError, match="length_but_not_zzz"):
        s(ROWS, COMPLETIONS, NO_TRUNCATION, GROUPS, group_size=2)


def test_select_picks_rows_in_the_given_order():
    out = scorer(length_but_not_zzz)(ROWS, COMPLETIONS, NO_TRUNCATION, GROUPS, group_size=2)
    picked = out.select(torch.tensor([3, 2, 0]))
    assert isinstance(picked, Scores)
    assert picked.scores.tolist() == [1.0, 1.0, 1.0] and picked.raw.tolist() == [1.0, 0.0, 1.0]
    assert picked.valid.tolist() == [True, False, True] and picked.failed.tolist() == [False, True, False]
    assert math.isnan(picked.components["length_but_not_zzz"][1])
    assert picked.metrics is out.metrics  # the batch's metrics, not recomputed


def test_names_and_close():
    class Worker:
        closed = 0

        def close(self):
            Worker.closed += 1

    s = Scorer(CompositeReward([length, (length_but_not_zzz, 0.5)]), RewardNormalizer(), worker=Worker())
    assert s.names == ["length", "length_but_not_zzz"]
    s.close()
    assert Worker.closed == 1
    scorer().close()  # no worker: nothing to stop


# Joined over batches (dynamic sampling) and over processes: every field, the reward metrics
# recomputed from the joined rows.


def _scores(B: int, start: int, failed_rows=()) -> Scores:
    raw = torch.arange(B, dtype=torch.float32) + start
    failed = torch.zeros(B, dtype=torch.bool)
    failed[list(failed_rows)] = True
    f = torch.where(failed, torch.nan, raw / 2)
    raw = torch.where(failed, 0.0, raw)
    components = {"f": f, "g": raw * 3}
    return Scores(raw - 1, raw, ~failed & (raw > start), failed, components, {"stale": 1.0})


def _concat_by_hand(scores):
    """What ``policygrad.produce.stages.concat_batches`` wrote out before Scores.concat."""
    raw, failed = torch.cat([s.raw for s in scores]), torch.cat([s.failed for s in scores])
    components = {k: torch.cat([s.components[k] for s in scores]) for k in scores[0].components}
    return Scores(
        torch.cat([s.scores for s in scores]),
        raw,
        torch.cat([s.valid for s in scores]),
        failed,
        components,
        RewardOutput(raw, components, ~failed).metrics(),
    )


def _gather_by_hand(gather_rows, s):
    """What ``Dist.gather_batch`` wrote out before Scores.gather."""
    raw, failed = gather_rows(s.raw), gather_rows(s.failed)
    components = {k: gather_rows(v) for k, v in s.components.items()}
    return Scores(
        gather_rows(s.scores),
        raw,
        gather_rows(s.valid),
        failed,
        components,
        RewardOutput(raw, components, ~failed).metrics(),
    )


def _assert_same(a: Scores, b: Scores):
    for name in ("scores", "raw", "valid", "failed"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert list(a.components) == list(b.components)
    for k in a.components:
        assert torch.equal(a.components[k].nan_to_num(-99), b.components[k].nan_to_num(-99)), k
    assert a.metrics.keys() == b.metrics.keys()
    for k in a.metrics:  # NaN-safe exact comparison
        assert a.metrics[k] == b.metrics[k] or (
            a.metrics[k] != a.metrics[k] and b.metrics[k] != b.metrics[k]
        ), k


BATCHES = [(4, 0, (1,)), (2, 10, ()), (6, 20, (0, 5))]


def test_concat_and_gather_equal_the_hand_listed_fields_with_metrics_of_every_row():
    parts = [_scores(*b) for b in BATCHES]
    joined = Scores.concat(parts)
    _assert_same(joined, _concat_by_hand(parts))
    assert joined.metrics != parts[0].metrics and "stale" not in joined.metrics
    assert Scores.concat(parts[:1]) is parts[0]
    collective = _Collective(3)
    new = collective.run(lambda rank, s: s.gather(collective.gather_rows(rank)), parts)
    old = collective.run(lambda rank, s: _gather_by_hand(collective.gather_rows(rank), s), parts)
    for a, b in zip(new, old):
        _assert_same(a, b)
        _assert_same(a, joined)
    rows = torch.tensor([5, 0, 2])
    picked = joined.select(rows)
    assert torch.equal(picked.raw, joined.raw[rows]) and picked.metrics is joined.metrics
    assert torch.equal(picked.components["g"], joined.components["g"][rows])
