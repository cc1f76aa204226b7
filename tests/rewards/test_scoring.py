"""Scores of a batch joined over batches (dynamic sampling) and over processes: every field, the
reward metrics recomputed from the joined rows."""

from __future__ import annotations

import pytest
import torch

from policygrad.rewards.registry import RewardOutput
from policygrad.rewards.scoring import Scores
from tests.rollout.test_base import _Collective

pytestmark = pytest.mark.unit


def _scores(B: int, start: int, failed_rows=()) -> Scores:
    raw = torch.arange(B, dtype=torch.float32) + start
    failed = torch.zeros(B, dtype=torch.bool)
    failed[list(failed_rows)] = True
    f = torch.where(failed, torch.nan, raw / 2)
    raw = torch.where(failed, 0.0, raw)
    components = {"f": f, "g": raw * 3}
    return Scores(raw - 1, raw, ~failed & (raw > start), failed, components, {"stale": 1.0})


def _concat_by_hand(scores):
    """What ``policygrad.trainer.stages.concat_batches`` wrote out before Scores.concat."""
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
