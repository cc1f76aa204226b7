"""Scoring by hand: pass@k (unbiased, any k <= n), maj@k over the extracted answers, the k checked,
the scoring chosen by the sampler's kind, and each kind's records, summaries and in-run names."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.envs.base import STOP_REASONS
from policygrad.evaluate.scoring import (
    AnswerScoring,
    EpisodeScoring,
    EvaluationFailed,
    check_finite_logits,
    check_ks,
    episode_metrics,
    failed_episodes,
    majority_at_k,
    pass_at_k,
    scoring_for,
)
from policygrad.rollout.samplers import EpisodeSampler, Samples, SingleTurnSampler

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 1, 1, 0.2),  # pass@1 = c/n
        (10, 3, 1, 0.3),
        (4, 0, 2, 0.0),  # nothing correct
        (4, 3, 2, 1.0),  # n - c = 1 < k: every draw of 2 holds a correct sample
        (6, 2, 3, 0.8),  # 1 - C(4,3)/C(6,3) = 1 - 4/20
        (3, 3, 3, 1.0),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"k=3 must be <= n=2"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match=r"c=5 must be in \[0, n=4\]"):
        pass_at_k(4, 5, 1)


def test_majority_at_k_by_hand():
    answers = ["4", "5", "4", None, "5", "5"]
    correct = [True, False, True, False, False, False]
    # k=1: each sample alone: 2 of 6 right.
    assert majority_at_k(answers, correct, 1) == pytest.approx(2 / 6)
    # k=3: blocks ["4","5","4"] -> 4 (right), [None,"5","5"] -> 5 (wrong).
    assert majority_at_k(answers, correct, 3) == 0.5
    # k=2: ["4","5"] tie -> first seen "4" right; ["4",None] -> "4" right; ["5","5"] wrong.
    assert majority_at_k(answers, correct, 2) == pytest.approx(2 / 3)
    assert majority_at_k([None, None], [False, False], 2) == 0.0
    with pytest.raises(ValueError, match="k=7 must be in 1 .. n=6"):
        majority_at_k(answers, correct, 7)


def test_check_ks_sorts_defaults_and_names_the_flags():
    assert check_ks([4, 1, 4, 2], 4) == [1, 2, 4]
    assert check_ks((), 6) == [1, 6]  # none given: pass@1 and pass@n
    with pytest.raises(ValueError, match=r"^--k 0: each k must be in 1 .. --samples 3$"):
        check_ks([0, 1], 3)


def test_the_sampler_kind_chooses_the_scoring():
    def reward(_prompts, completions, **_):
        return [1.0] * len(completions)

    single = scoring_for(SingleTurnSampler(None, None, None, max_new_tokens=1), reward, str.strip)
    assert isinstance(single, AnswerScoring) and single.reward_fn is reward and single.answer_fn is str.strip
    episodes = scoring_for(EpisodeSampler(runner=None), reward, str.strip)
    assert isinstance(episodes, EpisodeScoring) and episodes.answer_fn is None  # no maj@k of episodes


def test_answer_records_score_every_completion_in_one_call():
    calls = []

    def reward(prompts, completions, *, answer):
        calls.append((list(prompts), list(completions), list(answer)))
        return [float(c == f"#### {a}") for c, a in zip(completions, answer)]

    rows = [{"prompt": "p0", "answer": "1"}, {"prompt": "p1", "answer": "2"}]
    batches = [Samples([[0]], None, ["#### 1", "#### 3"]), Samples([[0]], None, ["x", "#### 2"])]
    scoring = AnswerScoring(reward, lambda t: t[5:] or None)
    records = scoring.records(batches, rows, 2, vote=True)
    # Two rows, two samples each, contiguous: the rows' fields repeated to match, one reward call.
    assert calls == [(["p0", "p0", "p1", "p1"], ["#### 1", "#### 3", "x", "#### 2"], ["1", "1", "2", "2"])]
    assert records == [
        {"completion": "#### 1", "reward": 1.0, "answer": "1"},
        {"completion": "#### 3", "reward": 0.0, "answer": "3"},
        {"completion": "x", "reward": 0.0, "answer": None},
        {"completion": "#### 2", "reward": 1.0, "answer": "2"},
    ]
    assert [scoring.correct(r) for r in records] == [True, False, False, True]
    # maj@2 of row 0: "1" and "3" tie, "1" seen first is right.
    assert scoring.majority(records[:2], [True, False], 2) == 1.0
    assert AnswerScoring(reward, None).majority(records[:2], [True, False], 2) is None
    greedy = AnswerScoring(reward).records([Samples([[0]], None, ["#### 1", "#### 9"])], rows, 1, vote=False)
    assert [scoring.row_record(row, r) for row, r in zip(rows, greedy)] == [
        {"prompt": "p0", "answer": "1", "completion": "#### 1", "reward": 1.0},
        {"prompt": "p1", "answer": "2", "completion": "#### 9", "reward": 0.0},
    ]
    assert scoring.summary([{"reward": 1.0}, {"reward": 0.5}]) == {"accuracy": 0.5}  # 0.5 is not > 0.5
    assert scoring.run_metrics({"accuracy": 0.5, "pass@2": 1.0}) == {"eval/accuracy": 0.5, "eval/pass@2": 1.0}


def _episode(success: bool, turns: int, stop: str, *, failed: bool = False, hit=None) -> dict:
    return {
        "final_reward": 1.0 if success else 0.0, "success": success, "turns": turns, "stop_reason": stop,
        "failed": failed, "error": "boom" if failed else None, "info": {"hit": hit},
    }


def test_episode_summary_and_in_run_names_by_hand():
    records = [
        _episode(True, 2, "done", hit=0.5),
        _episode(False, 3, "max_turns", hit=0.0),
        _episode(True, 4, "done"),
    ]
    metrics = EpisodeScoring.summary(records)
    # 2 of 3 succeed; turns 9/3; the successful ones took (2 + 4)/2 turns; hit given by two: 0.25.
    assert metrics["n"] == 3 and metrics["success"] == pytest.approx(2 / 3)
    assert metrics["turns_mean"] == 3.0 and metrics["turns_to_success"] == 3.0
    assert metrics["stop_done"] == pytest.approx(2 / 3) and metrics["stop_max_turns"] == pytest.approx(1 / 3)
    assert sum(metrics[f"stop_{s}"] for s in STOP_REASONS) == pytest.approx(1.0)
    assert metrics["env/hit"] == 0.25 and metrics["failed_frac"] == 0.0
    assert math.isnan(episode_metrics([_episode(False, 1, "done")])["turns_to_success"])
    named = EpisodeScoring.run_metrics({**metrics, "pass@2": 0.75})
    assert named == {
        "eval/accuracy": metrics["success"],
        "eval/turns_mean": 3.0,
        "eval/turns_to_success": 3.0,
        "eval/env/hit": 0.25,
        "eval/pass@2": 0.75,
    }


def test_failed_episodes_are_counted_and_all_failed_is_an_error():
    greedy = [_episode(True, 1, "done"), _episode(False, 1, "error", failed=True)]
    greedy[0]["samples"] = [_episode(False, 1, "error", failed=True), _episode(True, 1, "done")]
    greedy[1]["samples"] = [_episode(True, 1, "done"), _episode(True, 1, "done")]
    assert EpisodeScoring.outcome(greedy) == {"failed": 1, "samples_failed": 1, "first_error": "boom"}
    assert AnswerScoring.outcome(greedy) == {}
    with pytest.raises(EvaluationFailed, match=r"^every one of the 2 greedy episodes failed in the environ"):
        failed_episodes([_episode(False, 1, "error", failed=True)] * 2)


def test_completions_from_nan_logits_are_an_error():
    class Rollout:
        response_mask = torch.tensor([[1.0, 1.0, 0.0]])
        sampler_logprobs = torch.tensor([[-1.0, float("nan"), float("nan")]])  # the padding's NaN is no token

    with pytest.raises(EvaluationFailed, match=r"^the model's logits were not finite: 1 of 2 generated"):
        check_finite_logits(Rollout())
    Rollout.sampler_logprobs = torch.tensor([[-1.0, -2.0, float("nan")]])
    check_finite_logits(Rollout())  # only padding is NaN: fine
