"""The token-level advantage estimators: REINFORCE++, VinePPO and GAE.

Each gives every valid token its own advantage: REINFORCE++ from the reward-to-go, VinePPO from
Monte-Carlo values of the states between a response's steps, GAE from a critic's values. These
are the bare functions: :mod:`policygrad.core.advantages` registers each under its name against
its declaration in :mod:`policygrad.specs.estimators` (capabilities, minimum group size), and
the registered callable validates the shared arguments, passes ``response_mask`` as a bool
tensor, checks the group sizes, runs under ``torch.no_grad()`` and zeroes masked positions; call
them through it. See that module for the shared signature.

Sources, cited on each estimator: REINFORCE++ (Hu 2025); VinePPO (Kazemnejad et al. 2024); GAE
(Schulman et al. 2015b).
"""

from __future__ import annotations

import numbers

import torch

from policygrad.specs.estimators import VINEPPO_DEFAULTS, VINEPPO_PROMPT_VALUES, VINEPPO_SPLITS

from .checks import check_unit_interval
from .groups import group_mean_std
from .masking import masked_whiten
from .sequence_estimators import sequence_rewards

__all__ = ["gae_advantages", "reinforce_pp_advantages", "vineppo_advantages"]

_VINE = VINEPPO_DEFAULTS  # vineppo's defaults, declared once in policygrad.specs.estimators


def _reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` backwards over valid tokens (masked tokens skipped), [B, T]."""
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    out = [running] * rewards.shape[1]
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t]
        step = torch.where(valid, rewards[:, t], zero) + gamma * running
        running = torch.where(valid, step, running)
        out[t] = torch.where(valid, step, zero)
    return torch.stack(out, dim=1) if out else torch.zeros_like(rewards)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    gamma: float = 1.0,
    group_baseline: bool = False,
    batch_reduce=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs").

    1. Reward-to-go over the token rewards, ``G_t = r_t + gamma * G_{t+1}`` backwards over valid
       tokens, so a per-token KL penalty reaches the tokens before it.
    2. With ``group_baseline=True`` (REINFORCE++-baseline), subtract the group mean of the
       sequence rewards R from every valid token's ``G_t``.
    3. Whiten over all valid tokens of the batch with
       :func:`~policygrad.core.masking.masked_whiten` (mean 0, unbiased std 1, eps 1e-8).

    This is the one estimator whose definition includes whitening (global batch normalisation
    is part of REINFORCE++; it is also why the batch must hold at least 2 valid tokens).

    Args:
        gamma: discount in [0, 1], default 1.0.
        group_baseline: subtract the group mean of R first, default False.
        batch_reduce: supplied by the trainer, not the user: None in one process, or the
            cross-rank ``reduce`` of :func:`~policygrad.core.masking.masked_whiten`, so a batch
            split over data-parallel ranks is whitened as one.

    Returns:
        advantages [B, T] (whitened, 0 on masked tokens); returns [B, T] = the unwhitened
        reward-to-go ``G_t`` (without the group baseline) on valid tokens.

    Raises:
        ValueError: ``gamma`` outside [0, 1]; fewer than 2 valid tokens in the batch.
        TypeError: ``group_baseline`` not a bool.

    Capabilities: the minimum group size is 2 with ``group_baseline=True`` (with one sample per
    prompt the group mean is the row's own reward and every advantage is exactly 0), else 1.
    """
    gamma = check_unit_interval(gamma, "gamma", "reinforce_pp")
    if not isinstance(group_baseline, bool):
        raise TypeError(f"reinforce_pp: group_baseline must be True or False, got {group_baseline!r}")
    n_valid = int(response_mask.sum().item())
    if batch_reduce is not None:
        n_valid = int(batch_reduce(response_mask.sum().to(torch.float64)).item())
    if n_valid < 2:
        raise ValueError(
            f"reinforce_pp whitens over all valid tokens of the batch and needs at least 2, got {n_valid}"
        )
    returns = _reward_to_go(token_rewards, response_mask, gamma)
    shifted = returns
    if group_baseline:
        rewards = sequence_rewards(token_rewards, response_mask)
        centered, _, _ = group_mean_std(rewards, group_index)
        group_mean = rewards - centered
        shifted = returns - group_mean[:, None]
    return masked_whiten(shifted, response_mask, reduce=batch_reduce), returns


def _check_vineppo_options(rollouts, split, segment_tokens, max_splits, prompt_value) -> None:
    def whole(value, name, low, why):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"vineppo: {name} must be an int >= {low} ({why}), got {value!r}")

    whole(rollouts, "rollouts", 1, "K continuations sampled from each split point; the paper uses 9")
    if split not in VINEPPO_SPLITS:
        raise ValueError(
            f"vineppo: split must be one of {', '.join(VINEPPO_SPLITS)} (steps end at a newline, or "
            f"every segment_tokens tokens), got {split!r}"
        )
    whole(segment_tokens, "segment_tokens", 1, "the length of a step with split=fixed")
    whole(max_splits, "max_splits", 0, "the most split points in one response; 0: the prompt's value only")
    if prompt_value not in VINEPPO_PROMPT_VALUES:
        raise ValueError(
            f"vineppo: prompt_value must be one of {', '.join(VINEPPO_PROMPT_VALUES)} (K rollouts from the "
            f"prompt, or the mean reward of the group's other samples), got {prompt_value!r}"
        )


def vineppo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,  # noqa: ARG001 (the estimator signature)
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    rollouts: int = _VINE["rollouts"],
    split: str = _VINE["split"],
    segment_tokens: int = _VINE["segment_tokens"],
    max_splits: int = _VINE["max_splits"],
    prompt_value: str = _VINE["prompt_value"],
    vine_values: torch.Tensor | None = None,
    vine_segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """VinePPO: advantages from Monte-Carlo values of the states between a response's steps
    (Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential for LLM Reasoning Through Refined
    Credit Assignment", eq. 5 for the value estimate and the one-step advantage of eq. 2 with
    gamma = 1).

    A response is cut at split points ``0 = s_0 < s_1 < ... < s_n`` (token offsets) into
    segments; ``V(s_i)`` is the mean reward of K continuations the policy samples from the
    prompt plus the response's first ``s_i`` tokens (the trainer supplies them, see
    :mod:`policygrad.produce.vine`). Every token of segment i gets the segment's advantage::

        A_i = sum_{t in segment i} r_t + V(s_{i+1}) - V(s_i),   V(s_{n+1}) = 0 (the end)

    so without per-token terms ``A_i = V(s_{i+1}) - V(s_i)`` and the last segment gets
    ``R - V(s_n)`` (its outcome reward sits on its last token). Per-token terms (a KL penalty in
    the reward) count in the segment they fall in. The returns are ``A + V(s_i)``.

    The options decide how the trainer samples (they are checked here, and the computation reads
    the inputs only):

    Args:
        rollouts: K >= 1 continuations per split point, default 9 (the paper's).
        split: ``"newline"`` (a step ends after a token whose text holds a newline, the paper's
            reasoning steps) or ``"fixed"`` (every ``segment_tokens`` tokens).
        segment_tokens: the step length with ``split="fixed"``, default 64.
        max_splits: at most this many split points inside a response (evenly spaced over the
            candidates), default 8; 0 keeps only the prompt's value.
        prompt_value: ``"rollouts"`` (V(s_0) from K continuations of the prompt, once per prompt)
            or ``"group"`` (the mean score of the row's G - 1 siblings; needs G >= 2).
        vine_values: [B, T] float, ``V(s_i)`` on every token of segment i (supplied by the
            trainer); a [B] tensor is the one-segment case (the value of the prompt).
        vine_segments: [B, T], the segment index i of every token (0, 1, ... along the row,
            integer-valued); a [B] tensor means one segment.

    Returns:
        advantages [B, T] and returns [B, T] in ``token_rewards``' dtype, 0 on masked tokens.

    Raises:
        ValueError: a bad option (names it and the valid values); ``vine_values`` or
            ``vine_segments`` missing or of a shape other than [B, T] or [B].
        TypeError: an input that is not a tensor.
    """
    _check_vineppo_options(rollouts, split, segment_tokens, max_splits, prompt_value)
    B, T = token_rewards.shape
    dtype, device = token_rewards.dtype, token_rewards.device
    inputs = {"vine_values": vine_values, "vine_segments": vine_segments}
    for name, tensor in inputs.items():
        if tensor is None:
            raise ValueError(f"vineppo: {name} is required (the trainer supplies it: a [B, T] tensor)")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"vineppo: {name} must be a tensor [B, T], got {type(tensor).__name__}")
        if tensor.shape not in ((B, T), (B,)):
            raise ValueError(
                f"vineppo: {name} must have shape [B, T] = {(B, T)} or [B], got {tuple(tensor.shape)}"
            )
    v = vine_values.to(device=device, dtype=dtype)
    seg = vine_segments.to(device=device)
    if v.dim() == 1:
        v = v[:, None].expand(B, T)
    seg = torch.zeros(B, T, dtype=torch.long, device=device) if seg.dim() == 1 else seg.round().long()
    seg = torch.where(response_mask, seg.clamp_min(0), torch.zeros_like(seg))
    n = int(seg.max().item()) + 1 if seg.numel() else 1
    # Columns: the n segments, the end state (never written: value 0), and one that masked tokens
    # write to, so that nothing at a masked position reaches a segment.
    index = torch.where(response_mask, seg, torch.full_like(seg, n + 1))
    zero = torch.zeros((), dtype=dtype, device=device)
    sums = torch.zeros(B, n + 2, dtype=dtype, device=device)
    sums.scatter_add_(1, index, torch.where(response_mask, token_rewards, zero))
    start = torch.zeros(B, n + 2, dtype=dtype, device=device)  # V(s_i): every token of i holds it
    start.scatter_(1, index, torch.where(response_mask, v, zero))
    seen = torch.zeros(B, n + 2, dtype=torch.bool, device=device)
    seen.scatter_(1, index, response_mask)
    # V(s_{i+1}): the next segment's value, 0 after the row's last segment (the response ended).
    following = torch.where(seen[:, 1 : n + 1], start[:, 1 : n + 1], zero)
    per_segment = sums[:, :n] + following - start[:, :n]
    advantages = per_segment.gather(1, seg)
    returns = advantages + start.gather(1, seg)
    return torch.where(response_mask, advantages, zero), torch.where(response_mask, returns, zero)


def gae_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,  # noqa: ARG001 (the estimator signature)
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    critic_lam: float | None = None,
    length_adaptive_alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation, GAE(gamma, lam) (Schulman et al. 2015b, eq. 16).

    The recursion runs backwards over the valid tokens of each row, all rows at once::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next

    where ``V_next`` / ``A_next`` are those of the next VALID token of the row, and 0 after the
    last valid token (the terminal state has value 0: no bootstrapping from padding). Masked
    positions are skipped, so neither the value nor the reward at a masked position is ever read.
    ``returns = A + V`` are the lambda-return targets for the critic (Schulman et al. 2015b,
    section 5: ``A + V`` is the TD(lambda) return).

    Args:
        values: [B, T] critic values V(s_t), required.
        gamma: discount in [0, 1], default 1.0 (no discount within a response, as in
            Ouyang et al. 2022 and the N+ details of Huang et al. 2024).
        lam: GAE lambda in [0, 1], default 0.95. lam = 1 gives ``sum of future rewards - V``,
            lam = 0 gives the TD error.
        critic_lam: if set, decoupled GAE of VC-PPO (Yuan et al. 2025, "What's Behind PPO's
            Collapse in Long-CoT?"): the returns are ``GAE(gamma, critic_lam) + V`` while the
            advantages use ``lam`` (or the length-adaptive lambda).
        length_adaptive_alpha: if set (> 0), VAPO's length-adaptive GAE (Yue et al. 2025):
            the advantages of row i use ``lam_i = 1 - 1 / (alpha * n_i)`` with ``n_i`` the row's
            number of valid tokens, clamped to [0, 1] (a sequence shorter than 1/alpha tokens
            gets lam 0, the TD error). This replaces ``lam``.

    Returns:
        advantages [B, T] and returns [B, T], 0 on masked tokens.

    Raises:
        ValueError: ``values`` is None; ``gamma``, ``lam`` or ``critic_lam`` outside [0, 1];
            ``length_adaptive_alpha`` not > 0.
    """
    if values is None:
        raise ValueError(
            "gae needs values=[B, T] critic values; got values=None (use a critic-free estimator)"
        )
    gamma = check_unit_interval(gamma, "gamma", "gae")
    lam = check_unit_interval(lam, "lam", "gae")
    if critic_lam is not None:
        critic_lam = check_unit_interval(critic_lam, "critic_lam", "gae")
    dtype, device = token_rewards.dtype, token_rewards.device
    batch, steps = token_rewards.shape
    if length_adaptive_alpha is not None:
        alpha = length_adaptive_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
            raise ValueError(f"gae: length_adaptive_alpha must be a number > 0, got {alpha!r}")
        lengths = response_mask.sum(dim=-1).clamp_min(1).to(dtype)
        lam_rows = (1.0 - 1.0 / (float(alpha) * lengths)).clamp(0.0, 1.0)
    else:
        lam_rows = torch.full((batch,), lam, dtype=dtype, device=device)

    zero = torch.zeros((), dtype=dtype, device=device)
    next_value = torch.zeros(batch, dtype=dtype, device=device)
    next_adv = torch.zeros(batch, dtype=dtype, device=device)
    next_critic_adv = torch.zeros(batch, dtype=dtype, device=device)
    advantages = [next_adv] * steps
    critic_advantages = [next_adv] * steps
    for t in reversed(range(steps)):
        valid = response_mask[:, t]
        v_t = torch.where(valid, values[:, t], zero)
        r_t = torch.where(valid, token_rewards[:, t], zero)
        delta = r_t + gamma * next_value - v_t
        adv = delta + gamma * lam_rows * next_adv
        next_adv = torch.where(valid, adv, next_adv)
        advantages[t] = torch.where(valid, adv, zero)
        if critic_lam is not None:
            critic_adv = delta + (gamma * critic_lam) * next_critic_adv
            next_critic_adv = torch.where(valid, critic_adv, next_critic_adv)
            critic_advantages[t] = torch.where(valid, critic_adv, zero)
        next_value = torch.where(valid, v_t, next_value)
    if steps == 0:
        empty = torch.zeros_like(token_rewards)
        return empty, empty
    adv_matrix = torch.stack(advantages, dim=1)
    masked_values = torch.where(response_mask, values, zero)
    critic_matrix = torch.stack(critic_advantages, dim=1) if critic_lam is not None else adv_matrix
    return adv_matrix, critic_matrix + masked_values
