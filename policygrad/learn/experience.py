"""The record one RL step hands from its rollout stages to the update.

An :class:`Experience` holds everything the update needs for B sequences: the rollout, which
tokens carry loss, advantages, and the log-probs and values computed before any weight moved.
It is immutable; a minibatch or a micro-batch is a view of it (:meth:`Experience.select`,
:meth:`Experience.trim`), and ``rows`` says which rows of the step's batch a view holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from policygrad.rollout.base import Rollout

__all__ = ["PER_ROW_FIELDS", "PER_TOKEN_FIELDS", "Experience"]

PER_TOKEN_FIELDS = (  # the [B, T] fields (or None), e.g. for gathering over ranks
    "loss_mask",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "values",
    "returns",
    "critic_mask",
    "behaviour_logprobs",
    "cov_selected",
)
PER_ROW_FIELDS = ("non_score_rewards", "positive", "sample_tokens")  # the [B] fields (or None)


@dataclass(frozen=True)
class Experience:
    """B sequences ready for the update; every [B, T] tensor is float32 and right-padded like
    ``rollout.response_ids``.

    Attributes:
        rows: long [B], the rows of the step's batch this record holds (``arange(B)`` for the
            whole batch; a minibatch's ids in its order).
        rollout: the sampled sequences.
        loss_mask: [B, T] the response mask of rows that take part in the policy loss.
        advantages: [B, T].
        old_logprobs: [B, T] the trainer's log-probs of the sampled tokens before the update, or
            None when the update is exactly on-policy (the ratio is then exactly 1).
        ref_logprobs: [B, T] the reference's log-probs, or None without a KL.
        values: [B, T] the critic's values at rollout time, or None without a critic.
        returns: [B, T] the estimator's returns (the critic's targets; Monte-Carlo returns while
            the critic is pretrained).
        critic_mask: [B, T] tokens that train the critic.
        behaviour_logprobs: [B, T] the log-probs the KL placement shaped the rewards with (the
            old ones, or the sampler's when the update is on-policy), or None.
        non_score_rewards: [B] the KL part of each sequence's reward (its token rewards' sum
            minus the score), or None.
        cov_selected: [B, T] bool, the tokens a covariance loss (``clip_cov``, ``kl_cov``) acts on,
            selected over the step's whole batch; None for the other losses.
        positive: [B] float, 1 on the samples VAPO's positive-example LM loss trains on
            (``loss.positive_lm_coef``); None when it is off.
        sample_tokens: [B] float, the loss tokens of the sample each row belongs to, over every
            row it spans (an episode and its earlier segments), so a sequence-level aggregation
            counts a sample once (:func:`~policygrad.core.masking.aggregate`); None when every
            sample is one row.
        kl_coef: beta of this step (the KL controller's value when it was sampled).
        train_policy: False in the critic-pretraining steps (the policy is frozen).
    """

    rows: torch.Tensor
    rollout: Rollout
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    critic_mask: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    non_score_rewards: torch.Tensor | None = None
    cov_selected: torch.Tensor | None = None
    positive: torch.Tensor | None = None
    sample_tokens: torch.Tensor | None = None
    kl_coef: float = 0.0
    train_policy: bool = True

    @property
    def batch_size(self) -> int:
        """B."""
        return self.rollout.batch_size

    def select(self, index: torch.Tensor) -> Experience:
        """A view of the rows ``index`` (LongTensor of positions in this record), in that order."""
        changes = {name: _rows(getattr(self, name), index) for name in PER_TOKEN_FIELDS + PER_ROW_FIELDS}
        return dataclasses.replace(self, rows=self.rows[index], rollout=self.rollout.select(index), **changes)

    def trim(self) -> Experience:
        """The same rows cut to their longest response and prompt (:meth:`Rollout.trim`): columns
        masked in every row carry no loss and need no forward."""
        rollout = self.rollout.trim()
        T = rollout.response_ids.shape[1]
        changes = {name: _columns(getattr(self, name), T) for name in PER_TOKEN_FIELDS}
        return dataclasses.replace(self, rollout=rollout, **changes)

    def minibatches(
        self,
        epochs: int,
        num_minibatches: int,
        generator: torch.Generator,
        shard: tuple[int, int] | None = None,
    ) -> Iterator[Experience]:
        """``epochs`` passes of ``num_minibatches`` views each. Each epoch draws a fresh row
        permutation from ``generator`` when there is more than one minibatch (drawn lazily, one per
        epoch, so an update that stops early draws no more).

        ``shard = (offset, global_rows)``: this record holds rows ``offset .. offset + B - 1`` of a
        global batch of ``global_rows`` split over data-parallel ranks; the permutation is of the
        global batch (every rank draws the same one) and each view holds this record's rows of a
        global minibatch (possibly none), so minibatches are those of a single-process run."""
        B = self.batch_size
        offset, total = shard if shard is not None else (0, B)
        for _ in range(epochs):
            order = torch.randperm(total, generator=generator) if num_minibatches > 1 else torch.arange(total)
            for rows in torch.tensor_split(order, num_minibatches):
                if shard is not None:
                    rows = rows[(rows >= offset) & (rows < offset + B)] - offset
                yield self.select(rows)

    def micro_batches(self, size: int) -> Iterator[Experience]:
        """Consecutive views of at most ``size`` rows (untrimmed); none for an empty record."""
        if self.batch_size == 0:
            return
        for index in torch.split(torch.arange(self.batch_size), size):
            yield self.select(index)


def _rows(value: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if value is None else value[index.to(value.device)]


def _columns(value: torch.Tensor | None, T: int) -> torch.Tensor | None:
    return None if value is None else value[:, :T]
