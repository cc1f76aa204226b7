"""The rollout stages of an RL step that go beyond one call each: sampling with DAPO's dynamic
sampling, and the providers of an advantage estimator's extra inputs.

- :class:`SampledBatch`: n prompts, their B = n x G completions and their scores.
- :func:`groups_with_signal`: which groups a round keeps under dynamic sampling (Yu et al.
  2025, DAPO, section 3.2: a group whose task reward is the same for every sample gives a group
  baseline no signal), judged on a named reward component before normalisation and the truncation
  penalty.
- :class:`EstimatorInput`: the provider of an input an estimator declares, in two halves that
  receive the producer's parts (:class:`ProducerParts`) and the trainer thread's
  (:class:`FinishParts`); ReMax's ``baseline_rewards`` (the score of a greedy response to each
  prompt, Li et al. 2023, eq. 6) is here, VinePPO's Monte-Carlo values in
  :mod:`policygrad.produce.vine`, and :data:`policygrad.produce.inputs.ESTIMATOR_INPUTS` names them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policygrad.core.groups import fill_with_group_mean, varied_group_rows
from policygrad.envs.episodes import Episodes
from policygrad.rewards.scoring import Scores
from policygrad.rollout.base import Rollout, SamplingParams, decode_completions

__all__ = [
    "EstimatorInput",
    "FinishParts",
    "ProducerParts",
    "SampledBatch",
    "concat_batches",
    "finish_greedy_baseline",
    "groups_with_signal",
    "sample_greedy_baseline",
]


@dataclass(frozen=True)
class SampledBatch:
    """n dataset rows, their prompt token ids, and G scored completions each (B = n x G rows,
    the samples of prompt i in rows i*G .. i*G+G-1, ``rollout.group_index`` = the prompt)."""

    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    rollout: Rollout
    completions: list[str]
    scores: Scores
    episodes: Episodes | None = None  # multi-turn: what the environment said beyond the scores
    version: int = 0  # the policy version (updates applied) whose weights sampled it

    @property
    def group_size(self) -> int:
        """G."""
        return self.rollout.group_size

    @property
    def returns(self) -> torch.Tensor:
        """float32 [B], each sample's return as trained: its score (``scores.scores``: the reward
        functions' weighted sum and an environment's final reward, normalised, through the
        truncation policy, on the last action token) plus, with an environment, the sum of its
        turn rewards (on their own tokens). Without an environment: ``scores.scores`` itself."""
        if self.episodes is None:
            return self.scores.scores
        return self.scores.scores + self.episodes.turn_rewards.sum(-1).to(self.scores.scores)

    def shown(self) -> list[dict[str, Any]]:
        """Each sample's prompt, completion and return, for display."""
        return [
            {"prompt": self.rows[i // self.group_size]["prompt"], "completion": c, "reward": float(s)}
            for i, (c, s) in enumerate(zip(self.completions, self.returns))
        ]

    @property
    def segments(self) -> int:
        """S, the episodes' earlier segments in this batch (0 without an environment)."""
        seg = self.episodes.segments if self.episodes is not None else None
        return 0 if seg is None else seg.rollout.batch_size

    def training_rollout(self) -> Rollout:
        """The rows the update trains on: the B samples, then the episodes' S earlier segments
        (:class:`~policygrad.envs.records.Segments`), each in its episode's group and with its
        weight version. Without segments: ``rollout`` itself."""
        if not self.segments:
            return self.rollout
        seg = self.episodes.segments
        owner = seg.owner.to(self.rollout.group_index.device)
        version = self.rollout.weight_version
        rows = dataclasses.replace(
            seg.rollout,
            group_index=self.rollout.group_index[owner],
            weight_version=version[owner] if version is not None else None,
        )
        return Rollout.concat([self.rollout, rows], renumber=False)

    def select_groups(self, groups: Sequence[int]) -> SampledBatch:
        """The batch of the prompts ``groups`` (positions 0..n-1), renumbered 0..k-1."""
        G = self.group_size
        rows = torch.tensor([i * G + g for i in groups for g in range(G)], dtype=torch.long)
        rollout = self.rollout.select(rows)
        rollout = dataclasses.replace(rollout, group_index=torch.arange(len(groups)).repeat_interleave(G))
        return SampledBatch(
            [self.rows[i] for i in groups],
            [self.prompt_ids[i] for i in groups],
            rollout,
            [self.completions[r] for r in rows.tolist()],
            self.scores.select(rows),
            self.episodes.select(rows) if self.episodes is not None else None,
            self.version,
        )


def concat_batches(batches: Sequence[SampledBatch]) -> SampledBatch:
    """One batch of several (same G): prompts left-padded and responses right-padded to the
    widest, groups renumbered in order (:meth:`Rollout.concat`, :meth:`Scores.concat`). A single
    batch is returned as it is."""
    if len(batches) == 1:
        return batches[0]
    return SampledBatch(
        [row for b in batches for row in b.rows],
        [ids for b in batches for ids in b.prompt_ids],
        Rollout.concat([b.rollout for b in batches]),
        [c for b in batches for c in b.completions],
        Scores.concat([b.scores for b in batches]),
        Episodes.concat([b.episodes for b in batches]) if batches[0].episodes is not None else None,
        batches[0].version,
    )


def groups_with_signal(
    components: dict[str, torch.Tensor], group_index: torch.Tensor, n: int, group_size: int, component: str
) -> list[int]:
    """Positions of the n prompts whose G samples do not all score the same on reward
    ``component`` of ``components`` (the reward functions' raw scores: before normalisation and
    the truncation penalty; a row where the function failed, NaN, takes its group's mean, so it
    decides nothing).

    Raises:
        KeyError: ``component`` is not one of ``components``.
    """
    raw = components[component]
    missing = torch.isnan(raw)
    group_index = group_index.cpu()
    if missing.any():
        raw = fill_with_group_mean(torch.where(missing, 0.0, raw), missing, group_index)
    varied = varied_group_rows(raw, group_index)
    return [i for i in range(n) if bool(varied[i * group_size])]


# ----------------------------------------------------------------------------------------------
# Inputs that estimators declare (``register_advantage_estimator(..., inputs=(...))``); their
# providers sit in one table, :data:`policygrad.produce.inputs.ESTIMATOR_INPUTS`.


@dataclass(frozen=True)
class ProducerParts:
    """What an estimator input's sampling half may use: the producer's own parts, never the
    trainer (it may run on the producer's thread while the policy trains).

    Attributes:
        engine: the rollout engine the batch was sampled with (its weights are the batch's).
        tokenizer: the policy's tokenizer.
        score: the reward functions' raw scoring, ``score(rows, completions, repeat=K) ->
            RewardOutput`` (:meth:`~policygrad.rewards.scoring.Scorer.raw`: no normalisation).
        seeds: the run's :class:`~policygrad.seeds.Seeds`.
        params: the batch's sampling distribution (temperature, top-k, top-p).
        max_new_tokens: the most tokens of a response.
        ignore_eos: responses run to ``max_new_tokens`` (benchmarks).
        per_prompt_seeds: extra samples draw from seeds of their own (False: torch's stream).
        options: the estimator's options (``advantage.options``).
    """

    engine: Any
    tokenizer: Any
    score: Callable[..., Any]
    seeds: Any
    params: SamplingParams
    max_new_tokens: int
    ignore_eos: bool
    per_prompt_seeds: bool
    options: dict[str, Any]


@dataclass(frozen=True)
class FinishParts:
    """What an estimator input's finishing half (on the trainer's thread) may use.

    Attributes:
        scorer: the run's :class:`~policygrad.rewards.scoring.Scorer` (``finish_baseline``: the
            normaliser's running statistics, not updated, and the truncation policy).
        dist: the run's :class:`~policygrad.parallel.distributed.Dist` (``total``: sums over ranks).
        options: the estimator's options (``advantage.options``).
    """

    scorer: Any
    dist: Any
    options: dict[str, Any]


@dataclass(frozen=True)
class EstimatorInput:
    """The provider of an estimator input, in the two halves of the sample stage
    (:mod:`policygrad.produce.production`):

    - ``sample(parts, chosen) -> payload``: the producer's part, with :class:`ProducerParts` (it
      may call the rollout engine and the reward functions; nothing of the trainer's or of
      another rank); ``chosen`` has the ``rows``, ``prompt_ids`` and ``group_size`` of the
      groups trained on, the ``step``, and their ``rollout`` (B rows in the batch's order).
      The payload holds tensors, lists and numbers only (a checkpoint may keep it).
    - ``finish(parts, payload, batch) -> Tensor [B]`` (or [B, T]): the trainer's thread, with
      :class:`FinishParts` and the finished :class:`SampledBatch`.
    - ``metrics(parts, payload) -> dict``, optional: the trainer's thread, the step metrics of
      the extra sampling (it may sum over ranks).
    """

    sample: Callable[[ProducerParts, Any], Any]
    finish: Callable[[FinishParts, Any, SampledBatch], torch.Tensor]
    metrics: Callable[[FinishParts, Any], dict[str, float]] | None = None


def sample_greedy_baseline(parts: ProducerParts, chosen) -> dict[str, torch.Tensor]:
    """ReMax's sampling half: one greedy response to each chosen prompt, its raw reward and
    whether it was cut at the length limit."""
    p = parts.params
    greedy = parts.engine.generate(
        chosen.prompt_ids,
        group_size=1,
        max_new_tokens=parts.max_new_tokens,
        greedy=True,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
    )
    completions = decode_completions(parts.tokenizer, greedy)
    return {
        "rewards": parts.score(chosen.rows, completions, repeat=1).rewards,
        "truncated": greedy.truncated,
    }


def finish_greedy_baseline(parts: FinishParts, payload, batch: SampledBatch) -> torch.Tensor:
    """float32 [B]: the score of one greedy response to each row's prompt (ReMax's baseline, Li
    et al. 2023, eq. 6), normalised with the run's statistics (not updated) and through the same
    truncation policy, repeated over the prompt's G rows."""
    base = parts.scorer.finish_baseline(payload["rewards"], payload["truncated"])
    return base.repeat_interleave(batch.group_size)
