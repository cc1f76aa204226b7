"""What an evaluation scores, by the kind of sample: the part of
:func:`~policygrad.evaluate.evaluation.evaluate` that differs between single-turn generations and
environment episodes.

- :class:`AnswerScoring` (single-turn): a completion is correct when ``reward_fn`` gives it > 0.5
  (default :func:`~policygrad.rewards.verifiers.answer_correctness`); the summary is the greedy
  ``accuracy``, and maj@k votes on ``answer_fn``'s extracted answers.
- :class:`EpisodeScoring` (episodes): an episode succeeds when its final reward is > 0; the
  summary is the greedy episodes' success, turns, stop reasons and the environment's info.

Both give pass@k, the unbiased estimator of Chen et al. 2021 (:func:`pass_at_k`), over the
correct samples of each row.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from policygrad.envs.base import STOP_REASONS
from policygrad.errors import TrainingError
from policygrad.rewards.registry import row_fields_from_rows
from policygrad.rewards.verifiers import answer_correctness
from policygrad.rollout.samplers import EpisodeSampler, Sampler, Samples

__all__ = [
    "AnswerFn",
    "AnswerScoring",
    "EpisodeScoring",
    "EvaluationFailed",
    "RewardFn",
    "Scoring",
    "check_finite_logits",
    "check_ks",
    "episode_metrics",
    "failed_episodes",
    "majority_at_k",
    "pass_at_k",
    "score_completions",
    "scoring_for",
]

RewardFn = Callable[..., Sequence[float]]
AnswerFn = Callable[[str], "str | None"]


class EvaluationFailed(TrainingError):
    """Every item of an evaluation failed (e.g. every episode's environment raised): there is no
    result to report, so ``policygrad eval`` ends with one ``error:`` line and status 2 instead of
    a summary of zeros."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1).

    Raises:
        ValueError: k > n, or c outside [0, n].
    """
    if not 0 <= c <= n:
        raise ValueError(f"c={c} must be in [0, n={n}]")
    if k > n:
        raise ValueError(f"k={k} must be <= n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """maj@k of one problem from n >= k samples: the mean, over the n // k disjoint blocks of k
    consecutive samples (each an independent draw of k samples), of whether the block's most
    frequent answer is correct. A tie goes to the answer seen first; samples without an answer
    do not vote; a block where none answers counts as wrong.

    Args:
        answers: the n extracted answers (None: no answer).
        correct: the n verdicts; samples with the same answer share it.

    Raises:
        ValueError: k < 1 or k > n, or the lengths differ.
    """
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"{n} answers but {len(correct)} verdicts")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in 1 .. n={n}")
    blocks = n // k
    hits = 0
    for b in range(blocks):
        votes = [(a, ok) for a, ok in zip(answers[b * k : (b + 1) * k], correct[b * k : (b + 1) * k])]
        counts = Counter(a for a, _ in votes if a is not None)
        if not counts:
            continue
        best = max(counts.values())
        winner = next(a for a, _ in votes if a is not None and counts[a] == best)
        hits += next(ok for a, ok in votes if a == winner)
    return hits / blocks


def check_ks(ks: Sequence[int], samples: int) -> list[int]:
    """The k of pass@k / maj@k, sorted and unique (none given: [1, n]).

    Raises:
        ValueError: a k outside 1 .. n (named with the ``--k`` and ``--samples`` flags).
    """
    ks = sorted(set(ks)) if ks else [1, samples]
    for k in ks:
        if not 1 <= k <= samples:
            raise ValueError(f"--k {k}: each k must be in 1 .. --samples {samples}")
    return ks


def check_finite_logits(rollout) -> None:
    """A greedy completion picked from NaN logits is an arbitrary token (sampling from them fails
    in the engine): an evaluation of such completions would report a score of a model that
    produced nothing.

    Raises:
        EvaluationFailed: a generated token's log-probability is NaN.
    """
    logprobs = getattr(rollout, "sampler_logprobs", None)
    if logprobs is None:
        return
    generated = rollout.response_mask.bool()
    bad = int(torch.isnan(logprobs[generated]).sum())
    if bad:
        raise EvaluationFailed(
            f"the model's logits were not finite: {bad} of {int(generated.sum())} generated tokens have a "
            "NaN log-probability (its weights or activations overflow), so nothing was evaluated; evaluate a "
            "checkpoint from before it diverged or repair the model"
        )


def score_completions(reward_fn: RewardFn, rows, completions: list[str], repeat: int) -> list[float]:
    """``reward_fn``'s score of each completion, ``repeat`` contiguous completions per row."""
    prompts = [r["prompt"] for r in rows for _ in range(repeat)]
    return [float(x) for x in reward_fn(prompts, completions, **row_fields_from_rows(rows, repeat=repeat))]


class AnswerScoring:
    """Single-turn samples: each completion scored by ``reward_fn`` (> 0.5 is correct), maj@k
    voting on ``answer_fn``'s answers (None: no maj@k).

    In-run names: every metric under ``eval/`` (``eval/accuracy``, ``eval/pass@k``, ``eval/maj@k``).
    """

    def __init__(self, reward_fn: RewardFn | None = None, answer_fn: AnswerFn | None = None):
        self.reward_fn = reward_fn or answer_correctness
        self.answer_fn = answer_fn

    def check(self, samples: Samples) -> None:
        """Raises :class:`EvaluationFailed` when a generated token came from NaN logits."""
        check_finite_logits(samples.rollout)

    def records(self, batches: Sequence[Samples], rows, repeat: int, *, vote: bool) -> list[dict[str, Any]]:
        """One record per sample, ``{"completion", "reward"}`` (plus ``"answer"`` with ``vote``),
        ``repeat`` contiguous per row; every completion scored in one ``reward_fn`` call."""
        texts = [t for b in batches for t in b.completions]
        rewards = score_completions(self.reward_fn, rows, texts, repeat) if rows else []
        if not vote:
            return [{"completion": t, "reward": r} for t, r in zip(texts, rewards)]
        answers = [self.answer_fn(t) for t in texts] if self.answer_fn else [None] * len(texts)
        return [{"completion": t, "reward": r, "answer": a} for t, r, a in zip(texts, rewards, answers)]

    @staticmethod
    def correct(record: dict[str, Any]) -> bool:
        return record["reward"] > 0.5

    @staticmethod
    def row_record(row, sample: dict[str, Any]) -> dict[str, Any]:
        """A row's record: ``{"prompt", "answer", "completion", "reward"}`` of its greedy sample."""
        return {"prompt": row["prompt"], "answer": row.get("answer"), **sample}

    def summary(self, records: Sequence[dict[str, Any]]) -> dict[str, float]:
        """``accuracy``: the fraction of rows whose greedy completion is correct."""
        return {"accuracy": sum(self.correct(r) for r in records) / max(len(records), 1)}

    def majority(self, samples: Sequence[dict[str, Any]], correct: list[bool], k: int) -> float | None:
        """maj@k of one row's samples (None without ``answer_fn``)."""
        return majority_at_k([s["answer"] for s in samples], correct, k) if self.answer_fn else None

    @staticmethod
    def run_metrics(metrics: dict[str, float]) -> dict[str, float]:
        return {f"eval/{name}": value for name, value in metrics.items()}

    @staticmethod
    def outcome(records: Sequence[dict[str, Any]]) -> dict[str, Any]:  # noqa: ARG004
        """Nothing more to report (a failed generation raises before it is scored)."""
        return {}


class EpisodeScoring:
    """Episodes: a sample is an episode's record (:func:`episode_record`), correct when its final
    reward is > 0; no maj@k (an episode has no extracted answer to vote on).

    In-run names: ``eval/accuracy`` (the greedy episodes' success), ``eval/turns_mean``,
    ``eval/turns_to_success``, ``eval/env/<key>`` and ``eval/pass@k``.
    """

    answer_fn = None

    @staticmethod
    def check(samples: Samples) -> None:  # noqa: ARG004
        """Nothing: a failed episode is recorded (``failed``, ``error``) and counted by :meth:`outcome`."""

    @staticmethod
    def records(batches: Sequence[Samples], rows, repeat: int, *, vote: bool) -> list[dict[str, Any]]:  # noqa: ARG004
        return [rec for b in batches for rec in episode_records(b.episodes, b.completions)]

    @staticmethod
    def correct(record: dict[str, Any]) -> bool:
        return record["success"]

    @staticmethod
    def row_record(row, sample: dict[str, Any]) -> dict[str, Any]:
        """A row's record: the row's ``prompt`` and ``answer``, then its greedy episode's."""
        return {"prompt": row.get("prompt"), "answer": row.get("answer"), **sample}

    @staticmethod
    def summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """``n`` (rows) and the greedy episodes' :func:`episode_metrics`."""
        return {"n": len(records), **episode_metrics(records)}

    @staticmethod
    def majority(samples, correct, k) -> None:  # noqa: ARG004
        return None

    @staticmethod
    def run_metrics(metrics: dict[str, Any]) -> dict[str, float]:
        scores = {
            "eval/accuracy": metrics["success"],
            "eval/turns_mean": metrics["turns_mean"],
            "eval/turns_to_success": metrics["turns_to_success"],
        }
        scores.update({f"eval/{k}": v for k, v in metrics.items() if k.startswith(("env/", "pass@"))})
        return scores

    @staticmethod
    def outcome(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """:func:`failed_episodes` (raises :class:`EvaluationFailed` when every episode failed)."""
        return failed_episodes(records)


Scoring = AnswerScoring | EpisodeScoring


def scoring_for(
    sampler: Sampler, reward_fn: RewardFn | None = None, answer_fn: AnswerFn | None = None
) -> Scoring:
    """The scoring of ``sampler``'s kind of sample: episodes for an :class:`EpisodeSampler`
    (``reward_fn`` and ``answer_fn`` unused: the environment's final reward is the score), else
    single-turn answers."""
    if isinstance(sampler, EpisodeSampler):
        return EpisodeScoring()
    return AnswerScoring(reward_fn, answer_fn)


def episode_records(episodes, finals: list[str]) -> list[dict[str, Any]]:
    """One JSON-ready record per episode of a batch (info: NaN, never given, as None):
    ``transcript``, ``final_answer`` (the last turn's text), ``final_reward``, ``success``,
    ``stop_reason``, ``turns``, ``failed``, ``error`` and ``info`` (the episode's mean of each key)."""
    stops = episodes.stop_reasons
    records = []
    for i, final in enumerate(finals):
        reward = float(episodes.final_rewards[i])
        info = {}
        for key, values in episodes.info.items():
            v = float(values[i])
            info[key] = None if math.isnan(v) else v
        records.append({
            "transcript": episodes.transcripts[i] if episodes.transcripts else None,
            "final_answer": final,
            "final_reward": reward,
            "success": reward > 0,
            "stop_reason": stops[i],
            "turns": int(episodes.turns[i]),
            "failed": bool(episodes.failed[i]),
            "error": episodes.errors[i] if episodes.errors else None,
            "info": info,
        })
    return records


def episode_metrics(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The summary of episode records: ``success`` (fraction with final reward > 0),
    ``final_reward_mean``, ``turns_mean``, ``stop_<reason>`` for every reason of
    :data:`~policygrad.envs.base.STOP_REASONS` (they add up to 1), ``failed_frac`` and
    ``env/<key>``, the mean of each ``info`` key over the episodes that gave it, and
    ``turns_to_success`` (mean turns of the successful episodes; NaN when none succeeded)."""
    n = max(len(records), 1)
    won = [r["turns"] for r in records if r["success"]]
    metrics = {
        "success": sum(r["success"] for r in records) / n,
        "final_reward_mean": sum(r["final_reward"] for r in records) / n,
        "turns_mean": sum(r["turns"] for r in records) / n,
        **{f"stop_{s}": sum(r["stop_reason"] == s for r in records) / n for s in STOP_REASONS},
        "failed_frac": sum(r["failed"] for r in records) / n,
        "turns_to_success": sum(won) / len(won) if won else float("nan"),
    }
    for key in sorted({k for r in records for k in r["info"]}):
        given = [r["info"][key] for r in records if r["info"].get(key) is not None]
        if given:
            metrics[f"env/{key}"] = sum(given) / len(given)
    return metrics


def failed_episodes(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How many of an episode evaluation's episodes failed in the environment (raised or timed
    out): ``failed`` of the greedy ones and, with samples, ``samples_failed`` of the sampled ones;
    ``first_error``: the first failed episode's error (greedy ones first), None when none failed.
    A failed episode counts as unsuccessful in ``success`` and pass@k. Every greedy episode failed
    (or every sampled one): there is nothing to report.

    Raises:
        EvaluationFailed: every greedy episode failed, or every sampled one did.
    """
    sampled = [s for r in records for s in r.get("samples", [])]
    out: dict[str, Any] = {"failed": sum(r["failed"] for r in records)}
    if sampled:
        out["samples_failed"] = sum(s["failed"] for s in sampled)
    out["first_error"] = next((r["error"] for r in [*records, *sampled] if r["failed"]), None)
    for what, group in (("greedy", records), ("sampled", sampled)):
        count = sum(r["failed"] for r in group)
        if group and count == len(group):
            first = next(r["error"] for r in group if r["failed"])
            raise EvaluationFailed(
                f"every one of the {count} {what} episodes failed in the environment, so there is no result "
                f"(the first: {first}); fix the environment (each episode's error is in the output file)"
            )
    return out
