"""Importance weights for the train/inference mismatch: the ratio of the trainer's probability of
a sampled token to the rollout engine's, per token or per sequence, truncated or masked above a cap
(and optionally below a floor)."""

from __future__ import annotations

import math

import torch

from .checks import check_number, check_same_shape, check_tensor
from .masking import masked_sum

__all__ = ["IMPORTANCE_LEVELS", "IMPORTANCE_MODES", "truncated_importance_weights"]

IMPORTANCE_LEVELS: tuple[str, ...] = ("token", "sequence")
"""Valid ``level`` values of :func:`truncated_importance_weights`."""

IMPORTANCE_MODES: tuple[str, ...] = ("truncate", "mask")
"""Valid ``mode`` values of :func:`truncated_importance_weights`."""


def truncated_importance_weights(
    behavior_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
    mode: str = "truncate",
    floor: float | None = None,
) -> torch.Tensor:
    """Importance weights pi_train / pi_behavior correcting the train/inference mismatch, capped.

    The rollout engine's probabilities (``behavior_logprobs``) differ from the trainer's
    (``logprobs``) even at identical weights, so a nominally on-policy update is off-policy
    (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
    truncated importance sampling). With ``log w_t = logprobs_t - behavior_logprobs_t``:

    - ``level="token"``: ``w_t = exp(log w_t)`` per token.
    - ``level="sequence"``: ``W_i = exp(sum over valid t of log w_it)``, the product of the
      sequence's token ratios, broadcast to each of its valid tokens.

    then ``mode="truncate"``: ``min(w, cap)`` (truncated IS), or ``mode="mask"``: ``w`` where
    ``w <= cap`` and 0 where ``w > cap`` (the sample is dropped). Both are computed in log
    space (``exp(min(log w, log cap))``), so a sequence ratio that would overflow float32 is
    still exact: it is capped or masked, never inf. With ``floor``, a weight below it is 0 in
    either mode (the two-sided mask of IcePop, Ling team 2025: tokens whose ratio leaves
    [floor, cap] carry no gradient). Multiply the per-token policy loss by the result.

    Args:
        behavior_logprobs: [B, T] log-probs of the sampled tokens under the rollout engine.
        logprobs: [B, T] log-probs under the training policy (any floating dtype).
        response_mask: [B, T], nonzero = valid token.
        level: one of :data:`IMPORTANCE_LEVELS`.
        cap: upper bound on the weight, > 0 (2.0 is a common choice).
        mode: one of :data:`IMPORTANCE_MODES`.
        floor: None, or a lower bound in (0, ``cap``) below which a weight is 0.

    Returns:
        [B, T] detached weights in ``logprobs``' dtype (promoted with ``behavior_logprobs``),
        in [0, cap]; exactly 0 at masked positions (NaN there never leaks).

    Raises:
        TypeError: an argument is not a tensor, ``cap`` not a number.
        ValueError: shapes differ (names the argument); unknown ``level``/``mode`` (lists the
            valid ones); ``cap`` <= 0 or not finite.
    """
    logprobs = check_tensor(logprobs, "logprobs")
    check_tensor(behavior_logprobs, "behavior_logprobs")
    check_tensor(response_mask, "response_mask")
    check_same_shape(logprobs, "logprobs", behavior_logprobs=behavior_logprobs, response_mask=response_mask)
    if level not in IMPORTANCE_LEVELS:
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(IMPORTANCE_LEVELS)}")
    if mode not in IMPORTANCE_MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(IMPORTANCE_MODES)}")
    cap = check_number(cap, "cap")
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"cap must be a finite number > 0, got {cap}")
    if floor is not None and not 0 < check_number(floor, "floor") < cap:
        raise ValueError(f"floor must be in (0, cap={cap}), got {floor}")
    with torch.no_grad():
        mask = response_mask != 0
        dtype = torch.promote_types(logprobs.dtype, behavior_logprobs.dtype)
        zero = torch.zeros((), dtype=dtype, device=logprobs.device)
        log_w = torch.where(mask, logprobs.to(dtype) - behavior_logprobs.to(dtype), zero)
        if level == "sequence":
            log_w = masked_sum(log_w, mask, dim=-1)[..., None].expand_as(log_w)
        log_cap = math.log(cap)
        if mode == "truncate":
            weights = torch.exp(torch.clamp(log_w, max=log_cap))
        else:
            weights = torch.where(log_w > log_cap, zero, torch.exp(torch.clamp(log_w, max=log_cap)))
        if floor is not None:  # IcePop's lower bound: tokens the sampler overrated are dropped
            weights = torch.where(log_w < math.log(floor), zero, weights)
        return torch.where(mask, weights, zero)
