"""Scoring a batch of completions: reward functions, normalisation and the truncation policy.

:class:`Scorer` turns the B completions of a step into the sequence scores the advantage
estimator reads, in this order:

1. the reward functions (:class:`~policygrad.rewards.registry.CompositeReward`): weighted sum,
   per-function components, rows whose function failed marked invalid;
2. normalisation (:class:`~policygrad.rewards.normalize.RewardNormalizer`), before the EOS
   penalty so a truncated completion gets exactly the penalty (Huang et al. 2024, detail 4);
3. the truncation policy (:func:`~policygrad.rewards.registry.apply_truncation_policy`);
4. a row whose reward function failed (``on_error=skip``) gets its group's mean score (with an
   environment: the score that makes its return its group's mean return, its turn rewards
   dropped), so it moves no group statistic (it is out of the loss in any case).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from policygrad.core.groups import fill_with_group_mean
from policygrad.rewards.normalize import RewardNormalizer
from policygrad.rewards.registry import (
    CompositeReward,
    RewardOutput,
    apply_truncation_policy,
    row_fields_from_rows,
)

__all__ = ["EnvironmentScores", "Scorer", "Scores"]


# How a Scores field is laid out, declared once per field and read by select, concat and gather.
_ROW = "row"  # a tensor [B]
_ROW_DICT = "row_dict"  # name -> tensor [B]
_DERIVED = "derived"  # computed from the row fields (the reward metrics)


@dataclass(frozen=True)
class Scores:
    """The scores of one batch of B completions.

    Attributes:
        scores: float32 [B], the sequence score after normalisation, the truncation policy and
            the group-mean fill of failed rows: what the token rewards carry.
        raw: float32 [B], the raw return: the weighted sum of the reward functions plus, with an
            environment, its final and turn rewards; before normalisation and the truncation
            policy (0 on failed rows).
        valid: bool [B], rows that may take part in the loss (reward computed, not excluded by
            the truncation policy).
        failed: bool [B], rows on which a reward function failed (``on_error=skip``).
        components: function name -> float32 [B] raw score of that function (NaN where it failed).
        metrics: ``reward/invalid_frac`` and the per-function ``reward_fn/<name>/...`` metrics.
    """

    scores: torch.Tensor = field(metadata={"layout": _ROW})
    raw: torch.Tensor = field(metadata={"layout": _ROW})
    valid: torch.Tensor = field(metadata={"layout": _ROW})
    failed: torch.Tensor = field(metadata={"layout": _ROW})
    components: dict[str, torch.Tensor] = field(metadata={"layout": _ROW_DICT})
    metrics: dict[str, float] = field(metadata={"layout": _DERIVED})

    def select(self, rows: torch.Tensor) -> Scores:
        """The scores of the rows ``rows`` (LongTensor of row ids), in that order (``metrics``
        kept as they are)."""
        return Scores._build(self, lambda name, key: _entry(self, name, key)[rows], keep_derived=True)

    @classmethod
    def concat(cls, scores: Sequence[Scores]) -> Scores:
        """One batch of several, rows in order; ``metrics`` recomputed from the joined ``raw``,
        ``components`` and ``failed`` (the reward metrics of every row). A single batch is
        returned as it is.

        Raises:
            ValueError: no batches.
        """
        if not scores:
            raise ValueError("Scores.concat needs at least one batch")
        if len(scores) == 1:
            return scores[0]
        return cls._build(scores[0], lambda name, key: torch.cat([_entry(s, name, key) for s in scores]))

    def gather(self, gather_rows: Callable[[torch.Tensor], torch.Tensor]) -> Scores:
        """Every process's rows as one batch, from a collective row gather ``gather_rows(tensor)``
        (the rows of every process's tensor in rank order, e.g.
        ``policygrad.parallel.distributed.Dist.gather_rows``; called once per tensor, fields in
        declaration order and components in their order, on every process); ``metrics``
        recomputed from the gathered rows as in :meth:`concat`."""
        return Scores._build(self, lambda name, key: gather_rows(_entry(self, name, key)))

    @classmethod
    def _build(cls, template: Scores, row, *, keep_derived: bool = False) -> Scores:
        """A Scores whose row field ``name`` is ``row(name, None)`` and whose dict-of-rows entry
        ``name[key]`` is ``row(name, key)`` (keys of ``template``), fields in declaration order;
        derived fields are ``template``'s with ``keep_derived``, else recomputed."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            layout = f.metadata["layout"]
            if layout == _ROW:
                values[f.name] = row(f.name, None)
            elif layout == _ROW_DICT:
                values[f.name] = {k: row(f.name, k) for k in getattr(template, f.name)}
        for f in dataclasses.fields(cls):
            if f.metadata["layout"] == _DERIVED:
                values[f.name] = (
                    getattr(template, f.name) if keep_derived else _DERIVED_FIELDS[f.name](values)
                )
        return cls(**values)


def _entry(scores: Scores, name: str, key: str | None) -> torch.Tensor:
    value = getattr(scores, name)
    return value if key is None else value[key]


# How each derived field is computed from the row fields.
_DERIVED_FIELDS = {
    "metrics": lambda v: RewardOutput(v["raw"], v["components"], ~v["failed"]).metrics(),
}


@dataclasses.dataclass(frozen=True)
class EnvironmentScores:
    """What an environment says of B episodes, for :meth:`Scorer.__call__`.

    Attributes:
        final_rewards: float32 [B], ``final_reward(stop_reason)`` (0 on failed episodes).
        returns: float32 [B], the final reward plus the turn rewards, before the truncation
            policy (the ``env`` component).
        failed: bool [B], episodes whose environment failed.
        fields: extra row fields for the reward functions, one value per episode.
        turn_rewards: float32 [B], the sum of each episode's turn rewards as its token rewards
            carry them (0 where the row is left out: failed, or cut under ``reward.truncation=
            penalty``), or None (taken as 0): a failed row's score is filled so that its return
            (score plus these) is its group's mean return.
    """

    final_rewards: torch.Tensor
    returns: torch.Tensor
    failed: torch.Tensor
    fields: Mapping[str, list] = dataclasses.field(default_factory=dict)
    turn_rewards: torch.Tensor | None = None


class Scorer:
    """Scores completions of dataset rows; see the module docstring for the order of operations.

    Args:
        reward_fn: the weighted reward functions (None: none, an environment scores alone).
        normalizer: the run's score normaliser (its statistics are updated by :meth:`__call__`).
        truncation: ``none``, ``penalty`` or ``exclude`` (``reward.truncation``).
        truncation_penalty: the score of a completion without EOS in ``penalty`` mode.
        worker: the :class:`~policygrad.rewards.isolation.RewardWorker` running the isolated
            reward functions, stopped by :meth:`close`; None when there is none.
    """

    def __init__(
        self,
        reward_fn: CompositeReward,
        normalizer: RewardNormalizer,
        *,
        truncation: str = "none",
        truncation_penalty: float = -1.0,
        worker=None,
    ):
        self.reward_fn = reward_fn
        self.normalizer = normalizer
        self.truncation = truncation
        self.truncation_penalty = truncation_penalty
        self.worker = worker

    def close(self) -> None:
        """Stop the reward worker process, if any (idempotent)."""
        if self.worker is not None:
            self.worker.close()

    @property
    def names(self) -> list[str]:
        """Names of the reward functions' components, in call order."""
        return self.reward_fn.names if self.reward_fn is not None else []

    def raw(
        self,
        rows: Sequence[Mapping[str, Any]],
        completions: Sequence[str],
        *,
        repeat: int,
        fields: Mapping[str, list] | None = None,
    ):
        """The reward functions' output (:class:`~policygrad.rewards.registry.RewardOutput`) for
        ``completions``, ``repeat`` consecutive completions per row of ``rows``; ``fields``: more
        row fields, one value per completion (an episode's ``transcript``). Without reward
        functions (an environment scores alone): zeros, every row valid."""
        if self.reward_fn is None:
            count = len(completions)
            return RewardOutput(torch.zeros(count), {}, torch.ones(count, dtype=torch.bool))
        prompts = [r["prompt"] for r in rows for _ in range(repeat)]
        row_fields = row_fields_from_rows(rows, repeat=repeat)
        row_fields.update(fields or {})
        return self.reward_fn(prompts, completions, **row_fields)

    def __call__(
        self,
        rows: Sequence[Mapping[str, Any]],
        completions: Sequence[str],
        truncated: torch.Tensor,
        group_index: torch.Tensor,
        *,
        group_size: int,
        env: EnvironmentScores | None = None,
    ) -> Scores:
        """Score B = len(rows) x ``group_size`` completions (rows of a prompt contiguous).

        Args:
            rows: the n dataset rows.
            completions: B decoded completions (an episode's final answer).
            truncated: bool [B], completions without EOS (episodes cut short).
            group_index: long [B], the prompt of each row.
            group_size: G.
            env: an environment's scores of B episodes: the final rewards join the weighted sum
                of the reward functions (before normalisation), the returns are the ``env``
                component, failed episodes count as rows whose reward failed.

        Raises:
            RewardFunctionError, ValueError: from the reward functions (``on_error=raise``).
        """
        out = self.raw(rows, completions, repeat=group_size, fields=env.fields if env is not None else None)
        return self.finish(out, truncated, group_index, env=env)

    def finish(
        self, out: RewardOutput, truncated: torch.Tensor, group_index: torch.Tensor, *, env=None
    ) -> Scores:
        """The second half of :meth:`__call__`: the reward functions' output ``out`` (from
        :meth:`raw`) with the environment's scores, normalised (the normaliser's statistics
        updated: with several processes a collective), through the truncation policy, failed rows
        filled with their group's mean. Split from :meth:`raw` so that an asynchronous producer
        calls the reward functions and the trainer's thread does the rest."""
        raw = out.rewards.clone()
        turns = None
        if env is not None:
            ok = ~env.failed
            valid = out.valid & ok
            components = {"env": torch.where(ok, env.returns, float("nan")), **out.components}
            # The final reward is normalised with the functions' sum (it sits on the last token as
            # they do); the turn rewards stay on their tokens, unnormalised, and join the raw return.
            raw = torch.where(valid, out.rewards + env.returns, 0.0)
            out = RewardOutput(torch.where(valid, out.rewards + env.final_rewards, 0.0), components, valid)
            turns = env.turn_rewards
        scores = self.normalizer(out.rewards, out.valid)
        scores, valid = apply_truncation_policy(
            scores, truncated, mode=self.truncation, penalty=self.truncation_penalty, valid=out.valid
        )
        failed = ~out.valid
        if failed.any():
            if turns is None:
                scores = fill_with_group_mean(scores, failed, group_index.cpu())
            else:  # the group's mean return, so the failed row moves no group statistic of returns
                filled = fill_with_group_mean(scores + turns, failed, group_index.cpu())
                scores = torch.where(failed, filled, scores)
        return Scores(scores, raw, valid, failed, out.components, out.metrics())

    def baseline(
        self, rows: Sequence[Mapping[str, Any]], completions: Sequence[str], truncated
    ) -> torch.Tensor:
        """float32 [n] scores of one completion per row (e.g. ReMax's greedy responses), through
        the same normalisation (its statistics not updated) and truncation policy."""
        return self.finish_baseline(self.raw(rows, completions, repeat=1).rewards, truncated)

    def finish_baseline(self, base: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """:meth:`baseline` from the reward functions' weighted sums ``base`` (float32 [n])."""
        base = self.normalizer(base, update=False)
        base, _ = apply_truncation_policy(
            base, truncated, mode=self.truncation, penalty=self.truncation_penalty
        )
        return base
