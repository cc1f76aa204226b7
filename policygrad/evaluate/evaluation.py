"""Held-out evaluation, one implementation for single-turn generations and environment episodes,
for the run's in-training evaluation and ``policygrad eval``: one greedy sample per row and, from
n sampled ones, pass@k (the unbiased estimator of Chen et al. 2021) and, for answers, maj@k
(majority vote over the extracted answers) for any k <= n.

:func:`evaluate` takes a :class:`~policygrad.rollout.samplers.Sampler` (built from a run's
config by :func:`eval_sampler`, the one place the evaluation's sampling settings are read) and
scores its samples with the :mod:`~policygrad.evaluate.scoring` of their kind: single-turn
answers (correct when ``reward_fn`` gives > 0.5; maj@k over ``answer_fn``'s answers) or episodes
(successful when the final reward is > 0; turns, stop reasons, the environment's info).

Every row goes to the sampler in one call (``batch_size`` caps it): vLLM schedules the whole set
itself, the hf engine decodes it as one padded batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from policygrad.evaluate.scoring import (
    AnswerFn,
    RewardFn,
    check_finite_logits,
    check_ks,
    pass_at_k,
    scoring_for,
)
from policygrad.rewards.verifiers import extract_answer
from policygrad.rollout.base import SamplingParams, prompt_seed
from policygrad.rollout.samplers import EpisodeSampler, Sampler, Samples, SingleTurnSampler

__all__ = ["GREEDY", "draw", "eval_sampler", "evaluate", "greedy_eval", "sample_completions"]

GREEDY = SamplingParams(greedy=True)  # the argmax of each token (at temperature 1)


def eval_sampler(cfg, engine, tokenizer, runner=None) -> Sampler:
    """The evaluation's sampler for a run of ``cfg``: episodes through ``runner`` (the run's
    :class:`~policygrad.envs.episodes.EpisodeRunner`, given when ``env.name`` is set; a row's
    seed is its episodes' ``reset`` seed and their first turn's sampling seed), else one
    generation per sample by ``engine`` of at most ``rollout.max_new_tokens`` tokens, the prompts
    formatted as ``cfg.data`` says, each ``generate`` call seeded by :func:`draw`'s
    ``generator_seed``.

    Args:
        cfg: a :class:`~policygrad.config.train.TrainConfig` (``data``, ``rollout.max_new_tokens``).
    """
    if runner is not None:
        return EpisodeSampler(runner)
    return SingleTurnSampler(
        engine, tokenizer, cfg.data, max_new_tokens=cfg.rollout.max_new_tokens, per_prompt_seeds=False
    )


def draw(
    sampler: Sampler,
    rows: Sequence[dict[str, Any]],
    *,
    group_size: int,
    params: SamplingParams,
    seed: int,
    batch_size: int | None = None,
    check: Callable[[Samples], None] | None = None,
) -> list[Samples]:
    """``group_size`` samples of each row, ``batch_size`` rows per :meth:`Sampler.sample` call
    (None: all in one).

    Args:
        params: the sampling distribution (:data:`GREEDY`: the argmax).
        seed: the root of every seed: row i (of all ``rows``) draws from ``prompt_seed(seed, i)``
            (an episode sampler's per-row seeds), a sampled call starting at row ``start`` from
            ``seed * 1_000_003 + start`` (a single-turn sampler's ``generator_seed``), so the same
            seed draws the same samples whatever the global RNG holds.
        check: called on each call's samples before the next is drawn (e.g. a NaN test).

    Returns:
        the calls' :class:`Samples`, in order (rows' samples contiguous across them).
    """
    seeds = [prompt_seed(seed, i) for i in range(len(rows))]
    step = batch_size or max(len(rows), 1)
    out: list[Samples] = []
    for start in range(0, len(rows), step):
        samples = sampler.sample(
            rows[start : start + step],
            group_size=group_size,
            params=params,
            seeds=seeds[start : start + step],
            generator_seed=None if params.greedy else seed * 1_000_003 + start,
        )
        if check is not None:
            check(samples)
        out.append(samples)
    return out


@torch.inference_mode()
def evaluate(
    sampler: Sampler,
    rows: list[dict[str, Any]],
    *,
    reward_fn: RewardFn | None = None,
    answer_fn: AnswerFn | None = extract_answer,
    seed: int = 0,
    samples: int = 0,
    ks: Sequence[int] = (),
    temperature: float = 1.0,
    batch_size: int | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One greedy sample per row and, with ``samples`` = n >= 2, n sampled ones per row for
    pass@k (and maj@k of answers) for each k in ``ks``.

    Args:
        sampler: single-turn or episodes (:func:`eval_sampler`); its kind chooses the scoring
            (:func:`~policygrad.evaluate.scoring.scoring_for`).
        rows: held-out rows with ``prompt`` (and the fields ``reward_fn`` or the environment reads).
        reward_fn, answer_fn: single-turn only: the score of each completion (> 0.5 is correct;
            default answer correctness) and the answer maj@k votes on (None: no maj@k).
        seed: the root of every sampling seed (:func:`draw`): the result depends on it, not on
            the global RNG.
        samples: n sampled samples per row at ``temperature`` (0 or 1: greedy only).
        ks: the k of pass@k / maj@k, each in 1 .. n (default [1, n]).
        batch_size: rows per sampler call (None: all in one).

    Returns:
        ``(metrics, records)``. Single-turn: metrics ``accuracy`` (greedy), ``pass@k`` and
        ``maj@k``; one record per row ``{"prompt", "answer", "completion", "reward"}``.
        Episodes: metrics ``n``, the greedy episodes'
        :func:`~policygrad.evaluate.scoring.episode_metrics` (``success``, ``final_reward_mean``,
        ``turns_mean``, ``stop_<reason>``, ``failed_frac``, ``turns_to_success``, ``env/<key>``)
        and ``pass@k``; one record per row, the row's ``prompt`` and ``answer`` and its greedy
        episode's :func:`~policygrad.evaluate.scoring.episode_records` record. With samples,
        each record also holds ``samples``: its n sampled samples' records (single-turn:
        ``{"completion", "reward", "answer"}``).

    Raises:
        ValueError: a k outside 1 .. n.
        EvaluationFailed: a single-turn completion was generated from NaN logits.
    """
    scoring = scoring_for(sampler, reward_fn, answer_fn)
    if samples >= 2:
        ks = check_ks(ks, samples)
    greedy = draw(
        sampler, rows, group_size=1, params=GREEDY, seed=seed, batch_size=batch_size, check=scoring.check
    )
    records = [
        scoring.row_record(row, s) for row, s in zip(rows, scoring.records(greedy, rows, 1, vote=False))
    ]
    metrics = scoring.summary(records)
    if samples < 2 or not rows:
        return metrics, records
    batches = draw(
        sampler, rows, group_size=samples, params=SamplingParams(temperature=temperature), seed=seed,
        batch_size=batch_size, check=scoring.check,
    )
    sampled = scoring.records(batches, rows, samples, vote=True)
    votes = [f"maj@{k}" for k in ks] if scoring.answer_fn else []
    sums = dict.fromkeys([f"pass@{k}" for k in ks] + votes, 0.0)
    for i, rec in enumerate(records):
        rec["samples"] = sampled[i * samples : (i + 1) * samples]
        correct = [scoring.correct(s) for s in rec["samples"]]
        for k in ks:
            sums[f"pass@{k}"] += pass_at_k(samples, sum(correct), k)
            if votes:
                sums[f"maj@{k}"] += scoring.majority(rec["samples"], correct, k)
    metrics.update({name: total / len(records) for name, total in sums.items()})
    return metrics, records


# The single-turn pieces ``policygrad lab passk`` draws with, so a seed gives it the samples
# ``policygrad eval --samples n`` draws.


def sample_completions(
    engine, tokenizer, rows, *, data, n: int, greedy: bool, temperature: float, max_new_tokens: int,
    batch_size: int | None, seed: int,
) -> list[str]:
    """n completions per row (rows' completions contiguous), ``batch_size`` rows per call (None:
    all), drawn as :func:`evaluate` draws them (:func:`draw`'s seeds).

    Raises:
        EvaluationFailed: a completion was generated from NaN logits.
    """
    sampler = SingleTurnSampler(
        engine, tokenizer, data, max_new_tokens=max_new_tokens, per_prompt_seeds=False
    )
    params = GREEDY if greedy else SamplingParams(temperature=temperature)
    batches = draw(
        sampler, rows, group_size=n, params=params, seed=seed, batch_size=batch_size, check=_nan_check
    )
    return [text for b in batches for text in b.completions]


def greedy_eval(
    engine, tokenizer, rows: list[dict[str, Any]], *, data, max_new_tokens: int,
    batch_size: int | None = None, reward_fn: RewardFn | None = None,
) -> list[dict[str, Any]]:
    """:func:`evaluate`'s records of greedy completions only: one per row, ``{"prompt",
    "answer", "completion", "reward"}``, scored by ``reward_fn`` (default: answer correctness)."""
    sampler = SingleTurnSampler(
        engine, tokenizer, data, max_new_tokens=max_new_tokens, per_prompt_seeds=False
    )
    return evaluate(sampler, rows, reward_fn=reward_fn, batch_size=batch_size)[1]


def _nan_check(samples: Samples) -> None:
    check_finite_logits(samples.rollout)

