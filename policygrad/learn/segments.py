"""An episode's earlier segments in the update: each trains with its episode's advantage.

An episode whose history restarted (``StepResult.restart``; an agent whose library trimmed or
rewrote its messages) leaves rows behind: its earlier segments
(:class:`~policygrad.envs.records.Segments`), each with its own prompt. The episode is one
sample of its group: its reward and its group's statistics are computed once, on the episode's
own row (its last segment), and every earlier segment's tokens take that row's advantage, as
they would as part of one row. So a segment cannot change a group's baseline. In the loss the
episode is still one sequence: each row carries its episode's token count (``sample_tokens``),
so a sequence-level aggregation (``seq-mean-token-mean``, GRPO's) divides by the episode's
tokens and counts the episode once, as if its segments were one row.

This needs one advantage per episode: an outcome estimator (``grpo``, ``rloo``, ``reinforce``);
the config refuses a critic and a KL in the reward with segments, and :func:`extend_to_segments`
refuses an episode row whose advantages vary over its tokens (e.g. ``reinforce_pp`` with turn
rewards or ``gamma`` < 1).
"""

from __future__ import annotations

import torch

from policygrad.errors import TrainingError

__all__ = ["extend_to_segments", "first_rows", "row_value"]


def first_rows(B: int, rollout, *tensors: torch.Tensor | None) -> tuple:
    """``(rollout's first B rows, each tensor's first B rows)`` (None stays None); the same
    objects when ``rollout`` has B rows (no segments)."""
    if rollout.batch_size == B:
        return (rollout, *tensors)
    return (rollout.select(slice(0, B)), *(t[:B] if t is not None else None for t in tensors))


def row_value(values: torch.Tensor, mask: torch.Tensor, *, what: str, constant: bool) -> torch.Tensor:
    """Each row's value at its first masked token: [B] (0 for a row with none).

    Args:
        values: [B, T] floating.
        mask: [B, T], nonzero on the row's tokens.
        what: names ``values`` in the error.
        constant: require every masked token of a row to hold the same value (exactly).

    Raises:
        TrainingError: ``constant`` and a row whose masked values differ.
    """
    on = mask > 0
    first = on.float().argmax(-1)  # the first masked column (0 for a row with none)
    out = values.gather(-1, first[:, None]).squeeze(-1) * on.any(-1).to(values.dtype)
    if constant and bool((on & (values != out[:, None])).any()):
        raise TrainingError(
            f"the {what} of an episode with earlier segments differ between its tokens (e.g. turn rewards "
            "under advantage.estimator=reinforce_pp); a segment trains with its episode's one advantage: "
            "use advantage.estimator=grpo, rloo or reinforce (an agent can also set "
            "agent.rewritten_history=fail)"
        )
    return out


def extend_to_segments(
    batch,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    token_rewards: torch.Tensor,
    non_score: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The B episode rows' advantages, returns, token rewards and KL part, and the loss mask,
    extended to the S segment rows that follow them, and each row's episode's loss tokens.

    Args:
        batch: the :class:`~policygrad.produce.stages.SampledBatch` (its ``scores.valid``, bool
            [B]: the episodes that carry loss; its ``episodes.segments.owner``, long [S]: each
            segment's episode, a row in 0..B-1).
        response_mask: [B + S, T] float, the policy's tokens of every row (episodes first).
        advantages, returns: [B, T] of the episode rows (the estimator's output).
        token_rewards: [B, T] the episode rows' token rewards; non_score: [B] their KL part.

    Returns:
        ``(advantages, returns, loss_mask, token_rewards, non_score, sample_tokens)``, [B + S, T]
        or [B + S]: a segment row holds its episode's advantage and its return from the first
        token (the return of everything after the segment's prompt) on its own tokens, 0
        elsewhere; its loss mask is its response mask where its episode is valid; its token
        rewards and KL part are 0 (the episode's rewards sit on the episode's row);
        ``sample_tokens`` is the loss tokens of each row's episode, over all its rows (float32).

    Raises:
        TrainingError: an episode row whose advantages differ between its tokens (:func:`row_value`).
    """
    B = advantages.shape[0]
    head, seg_mask = response_mask[:B], response_mask[B:]
    owner = batch.episodes.segments.owner.to(advantages.device)
    per_episode = row_value(advantages, head, what="advantages", constant=True)
    first_return = row_value(returns, head, what="returns", constant=False)
    valid = batch.scores.valid.to(response_mask.device)
    S = owner.shape[0]
    loss_mask = response_mask * torch.cat([valid, valid[owner]]).to(response_mask)[:, None]
    row_tokens = loss_mask.sum(-1).float()
    episode_tokens = row_tokens[:B].index_add(0, owner, row_tokens[B:])
    return (
        torch.cat([advantages, per_episode[owner][:, None] * seg_mask.to(advantages.dtype)]),
        torch.cat([returns, first_return[owner][:, None] * seg_mask.to(returns.dtype)]),
        loss_mask,
        torch.cat([token_rewards, token_rewards.new_zeros(S, token_rewards.shape[1])]),
        torch.cat([non_score, non_score.new_zeros(S)]),
        torch.cat([episode_tokens, episode_tokens[owner]]),
    )
