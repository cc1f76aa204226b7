"""The rollout stages of an RL step that go beyond one call each: sampling with DAPO's dynamic
sampling, and the providers of an advantage estimator's extra inputs.

- :class:`SampledBatch`: n prompts, their B = n x G completions and their scores.
- :func:`keep_groups_with_signal`: which groups a batch keeps under dynamic sampling (Yu et al.
  2025, DAPO, section 3.2: a group whose task reward is the same for every sample gives a group
  baseline no signal), judged on a named reward component before normalisation and the truncation
  penalty.
- :data:`ESTIMATOR_INPUTS`: registered providers of the inputs an estimator declares (ReMax's
  ``baseline_rewards``: the score of a greedy response to each prompt, Li et al. 2023, eq. 6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policygrad.core.groups import fill_with_group_mean, varied_group_rows
from policygrad.envs.episodes import Episodes
from policygrad.rewards.scoring import EnvironmentScores, Scores
from policygrad.rollout.base import Rollout, decode_completions
from policygrad.trainer.errors import TrainingError

__all__ = [
    "ESTIMATOR_INPUTS",
    "SampledBatch",
    "concat_batches",
    "keep_groups_with_signal",
    "register_estimator_input",
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

    @property
    def group_size(self) -> int:
        """G."""
        return self.rollout.group_size

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
    )


def episode_batch(trainer, rows: list[dict[str, Any]], seeds: list[int]) -> SampledBatch:
    """The sample stage with an environment: G multi-turn episodes of each row
    (:class:`~policygrad.envs.episodes.EpisodeRunner`), scored: the environment's final rewards
    with the reward functions' scores of the final answers; a row cut short goes through
    ``reward.truncation`` as a whole (under ``penalty`` its turn rewards are dropped too).

    Raises:
        TrainingError: more than ``rollout.env_error_budget`` of the episodes failed.
    """
    r = trainer.config.rollout
    prompt_ids, rollout, episodes, finals = trainer.environment.run(
        rows,
        group_size=r.group_size,
        seeds=seeds,
        per_prompt_seeds=r.per_prompt_seeds,
        sampling={"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k},
    )
    failed = float(trainer.dist.total(episodes.failed.sum())) / max(trainer.dist.total(len(finals)), 1)
    if failed > r.env_error_budget:
        first = next((e for e in episodes.errors if e is not None), "on another rank")
        raise TrainingError(
            f"{failed:.0%} of this step's episodes failed in the environment (rollout.env_error_budget="
            f"{r.env_error_budget}); first error: {first}"
        )
    if trainer.scorer.truncation == "penalty":
        episodes.turn_rewards[episodes.truncated] = 0.0
    env = EnvironmentScores(
        final_rewards=episodes.final_rewards,
        returns=episodes.final_rewards + episodes.turn_rewards.sum(-1),
        failed=episodes.failed,
        fields={"transcript": episodes.transcripts},
    )
    scores = trainer.scorer(
        rows, finals, rollout.truncated, rollout.group_index, group_size=r.group_size, env=env
    )
    return SampledBatch(rows, prompt_ids, rollout, finals, scores, episodes)


def keep_groups_with_signal(batch: SampledBatch, component: str) -> list[int]:
    """Positions of the prompts whose samples do not all score the same on reward ``component``
    (its raw score: before normalisation and the truncation penalty; a row where the function
    failed takes its group's mean, so it decides nothing).

    Raises:
        KeyError: ``component`` is not one of the batch's reward components.
    """
    raw = batch.scores.components[component]
    missing = torch.isnan(raw)
    group_index = batch.rollout.group_index.cpu()
    if missing.any():
        raw = fill_with_group_mean(torch.where(missing, 0.0, raw), missing, group_index)
    varied = varied_group_rows(raw, group_index)
    G = batch.group_size
    return [i for i in range(len(batch.rows)) if bool(varied[i * G])]


# ----------------------------------------------------------------------------------------------
# Inputs that estimators declare (``register_advantage_estimator(..., inputs=(...))``).

EstimatorInput = Callable[[Any, SampledBatch], torch.Tensor]
ESTIMATOR_INPUTS: dict[str, EstimatorInput] = {}


def register_estimator_input(name: str) -> Callable[[EstimatorInput], EstimatorInput]:
    """Register the provider of an estimator input: ``fn(trainer, batch) -> Tensor [B]``.

    Raises:
        ValueError: ``name`` already has a provider.
    """

    def decorator(fn: EstimatorInput) -> EstimatorInput:
        if name in ESTIMATOR_INPUTS:
            raise ValueError(f"estimator input {name!r} already has a provider")
        ESTIMATOR_INPUTS[name] = fn
        return fn

    return decorator


@register_estimator_input("baseline_rewards")
def greedy_baseline_rewards(trainer, batch: SampledBatch) -> torch.Tensor:
    """float32 [B]: the score of one greedy response to each row's prompt (ReMax's baseline, Li
    et al. 2023, eq. 6), normalised with the run's statistics (not updated) and through the same
    truncation policy, repeated over the prompt's G rows."""
    r = trainer.config.rollout
    greedy = trainer.engine.generate(
        batch.prompt_ids,
        group_size=1,
        max_new_tokens=r.max_new_tokens,
        greedy=True,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
    )
    completions = decode_completions(trainer.tokenizer, greedy)
    return trainer.scorer.baseline(batch.rows, completions, greedy.truncated).repeat_interleave(
        batch.group_size
    )
