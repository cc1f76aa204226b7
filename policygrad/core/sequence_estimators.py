"""The sequence-level advantage estimators: REINFORCE, RLOO, GRPO (and Dr.GRPO), ReMax.

Each puts the sequence's advantage on every valid token and its reward ``R_i`` as the return on
every valid token. These are the bare functions: :mod:`policygrad.core.advantages` registers
each under its name against its declaration in :mod:`policygrad.specs.estimators`, and the
registered callable (:func:`~policygrad.core.advantages.get_advantage_estimator`) validates the
shared arguments, passes ``response_mask`` as a bool tensor, checks the group sizes, runs under
``torch.no_grad()`` and zeroes masked positions; call them through it. See that module for the
shared signature.

Sources, cited on each estimator: REINFORCE with a baseline (Williams 1992); RLOO (Kool et al.
2019; Ahmadian et al. 2024); GRPO (Shao et al. 2024) and Dr.GRPO (Liu et al. 2025); ReMax (Li
et al. 2023).
"""

from __future__ import annotations

import numbers

import torch

from policygrad.specs.estimators import GRPO_SCALES

from .groups import group_mean_std, group_stats
from .masking import masked_sum

__all__ = [
    "grpo_advantages",
    "reinforce_advantages",
    "remax_advantages",
    "rloo_advantages",
    "sequence_rewards",
]


def sequence_rewards(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence reward ``R_i = sum_t mask_it * r_it`` over valid tokens, [B], rewards' dtype.

    Raises:
        ValueError: ``response_mask`` shape differs from ``token_rewards``.
    """
    return masked_sum(token_rewards, response_mask, dim=-1)


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put a [B] value on every valid token of [B, T]; 0 elsewhere."""
    zero = torch.zeros((), dtype=per_seq.dtype, device=per_seq.device)
    return torch.where(mask, per_seq[:, None].expand(mask.shape), zero)


def _per_seq_tensor(value: object, name: str, estimator: str, like: torch.Tensor) -> torch.Tensor:
    """Validate a float or [B] tensor option and return it as a [B] tensor like ``like``."""
    batch = like.shape[0]
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.expand(batch)
        if value.shape != (batch,):
            raise ValueError(
                f"{estimator}: {name} must be a float or a [B] = ({batch},) tensor, "
                f"got shape {tuple(value.shape)}"
            )
        return value.to(device=like.device, dtype=like.dtype)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return torch.full((batch,), float(value), dtype=like.dtype, device=like.device)
    raise TypeError(f"{estimator}: {name} must be a float or a [B] tensor, got {type(value).__name__}")


def reinforce_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,  # noqa: ARG001 (the estimator signature)
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    baseline: float | torch.Tensor = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a baseline: ``A_i = R_i - b_i`` on every valid token (Williams 1992, eq. 11).

    Args:
        token_rewards, response_mask, group_index, values: see the module docstring
            (``group_index`` and ``values`` are not used).
        baseline: a float, or a [B] tensor (one baseline per row; it must not depend on the row's
            own sample to keep the gradient unbiased, Williams 1992). Default 0.

    Returns:
        advantages [B, T] = R - b on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError / TypeError: ``baseline`` of the wrong shape or type.
    """
    rewards = sequence_rewards(token_rewards, response_mask)
    b = _per_seq_tensor(baseline, "baseline", "reinforce", rewards)
    return _broadcast(rewards - b, response_mask), _broadcast(rewards, response_mask)


def rloo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: ``A_i = R_i - mean_{j != i, same group} R_j``.

    Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!"); Ahmadian et al. 2024
    ("Back to Basics", eq. for the RLOO estimator). The baseline uses only the other samples of
    the same prompt, so the estimator is exactly unbiased. Computed as
    ``k/(k-1) * (R_i - group mean)``, which equals the leave-one-out difference exactly in real
    arithmetic (``R_i - (S - R_i)/(k-1) = k/(k-1) * (R_i - S/k)`` with S the group's sum) and is
    exactly 0 for an all-equal group.

    Returns:
        advantages [B, T] on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError: a group of size 1 (group_size must be >= 2).
    """
    rewards = sequence_rewards(token_rewards, response_mask)
    inverse, sizes, sums, constant = group_stats(rewards, group_index)
    if bool((sizes < 2).any()):
        lone = torch.unique(group_index)[sizes < 2][:5].tolist()
        raise ValueError(
            f"rloo: group_size must be >= 2 (the leave-one-out baseline needs another sample of the "
            f"same prompt); group id(s) {lone} have a single row"
        )
    others_mean = (sums[inverse] - rewards) / (sizes[inverse] - 1).to(rewards.dtype)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    advantages = torch.where(constant[inverse], zero, rewards - others_mean)
    return _broadcast(advantages, response_mask), _broadcast(rewards, response_mask)


def _safe_ratio(centered: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``centered / scale``, exactly 0 where ``centered`` is 0 (an all-equal group, even with eps 0)."""
    zero = torch.zeros((), dtype=centered.dtype, device=centered.device)
    return torch.where(centered == 0, zero, centered / scale)


def grpo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage ``A_i = (R_i - mean_group R) / (std + eps)``.

    Shao et al. 2024 (DeepSeekMath, section 4.1.2, outcome supervision). ``scale`` picks the
    divisor:

    - ``"group"``: the std of R within the row's group (needs every group of size >= 2).
    - ``"batch"``: the std of R over the whole batch (all B rows), one number.
    - ``"none"``: no division, the centred advantage ``R_i - mean_group R`` of Dr.GRPO
      (Liu et al. 2025, "Understanding R1-Zero-Like Training", section 3.1).

    A group whose rewards are all equal gets exactly 0 in every scale (never NaN, never a large
    number from a rounding-error std). Dividing by a per-group std is a per-prompt reweighting,
    not a baseline (Liu et al. 2025, section 3.1: the question-level difficulty bias).

    Args:
        scale: ``"group"`` (default), ``"batch"`` or ``"none"``.
        eps: added to the std, default 1e-6.
        unbiased: std with Bessel's correction (n - 1), default True as in the GRPO reference
            implementations; False for the population std.

    Returns:
        advantages [B, T] on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError: unknown ``scale`` (lists the valid ones); a group of size 1 with
            ``scale="group"``; fewer than 2 rows with ``scale="batch"`` and ``unbiased=True``;
            ``eps < 0``.
        TypeError: ``unbiased`` not a bool.
    """
    if scale not in GRPO_SCALES:
        raise ValueError(f"grpo: unknown scale {scale!r}; valid scales: {', '.join(GRPO_SCALES)}")
    if not isinstance(unbiased, bool):
        raise TypeError(f"grpo: unbiased must be True or False, got {unbiased!r}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or eps < 0:
        raise ValueError(f"grpo: eps must be a number >= 0, got {eps!r}")
    rewards = sequence_rewards(token_rewards, response_mask)
    centered, std, sizes = group_mean_std(rewards, group_index, unbiased=unbiased)
    if scale == "group":
        if bool((sizes < 2).any()):
            lone = group_index[sizes < 2][:5].tolist()
            raise ValueError(
                f"grpo: group_size must be >= 2 with scale='group' (a group std needs two samples); "
                f"group id(s) {lone} have a single row; use scale='batch' or 'none', or sample more"
            )
        advantages = _safe_ratio(centered, std + eps)
    elif scale == "batch":
        n = rewards.shape[0]
        if n < (2 if unbiased else 1):
            raise ValueError(f"grpo: scale='batch' with unbiased={unbiased} needs at least 2 rows, got {n}")
        _, batch_std, _ = group_mean_std(rewards, torch.zeros_like(group_index), unbiased=unbiased)
        advantages = _safe_ratio(centered, batch_std + eps)
    else:
        advantages = centered
    return _broadcast(advantages, response_mask), _broadcast(rewards, response_mask)


def remax_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,  # noqa: ARG001 (the estimator signature)
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    baseline_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: ``A_i = R_i - R(greedy response to row i's prompt)`` (Li et al. 2023, eq. 6).

    The greedy decode does not depend on the sampled response, so the baseline keeps the
    gradient unbiased (Williams 1992: any baseline independent of the sampled action). The
    greedy rewards are an input the trainer supplies (``inputs=("baseline_rewards",)``), not a
    user option.

    Args:
        baseline_rewards: [B] tensor, the reward of the greedy response for each row's prompt
            (required).

    Returns:
        advantages [B, T] on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError: ``baseline_rewards`` missing or not of shape [B].
    """
    if baseline_rewards is None:
        raise ValueError(
            "remax: baseline_rewards is required: a [B] tensor holding, for each row, the reward of "
            "the greedy response to the same prompt"
        )
    if not isinstance(baseline_rewards, torch.Tensor):
        raise TypeError(
            f"remax: baseline_rewards must be a [B] tensor, got {type(baseline_rewards).__name__}"
        )
    rewards = sequence_rewards(token_rewards, response_mask)
    if baseline_rewards.shape != rewards.shape:
        raise ValueError(
            f"remax: baseline_rewards must have shape [B] = {tuple(rewards.shape)}, "
            f"got {tuple(baseline_rewards.shape)}"
        )
    b = baseline_rewards.to(device=rewards.device, dtype=rewards.dtype)
    return _broadcast(rewards - b, response_mask), _broadcast(rewards, response_mask)
