"""The treatment of truncated completions (``reward.truncation``): completions that hit the length
cap without an end-of-sequence token keep their reward, get a constant penalty, or leave the loss
(:func:`apply_truncation_policy`)."""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["TRUNCATION_MODES", "apply_truncation_policy"]

TRUNCATION_MODES = ("none", "penalty", "exclude")


def _as_1d(name: str, value, dtype: torch.dtype) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(tensor.shape)}")
    return tensor.to(dtype)


def apply_truncation_policy(
    rewards,
    truncated,
    *,
    mode: str = "none",
    penalty: float = -1.0,
    valid=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Treat completions that hit the length cap without an end-of-sequence token.

    Modes:

    * ``"none"``: rewards unchanged; truncated rows are scored like any other.
    * ``"penalty"``: the reward of every truncated row is replaced by the constant ``penalty``
      (the "EOS trick" of Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO",
      which gives a completion without EOS a score of -1 whatever its content).
    * ``"exclude"``: truncated rows are marked invalid, so the trainer leaves them out of the loss
      (DAPO's overlong filtering, Yu et al. 2025, Sec. 3.4); their reward is unchanged.

    Args:
        rewards: float [B] sequence-level rewards (tensor or list).
        truncated: bool [B], True where the completion has no EOS.
        mode: ``"none"``, ``"penalty"`` or ``"exclude"``.
        penalty: the constant reward of truncated rows in ``"penalty"`` mode (finite).
        valid: optional bool [B] validity mask to combine with (e.g. from :class:`CompositeReward`).

    Returns:
        (rewards float32 [B], valid bool [B]) as new tensors; inputs are not modified.

    Raises:
        ValueError: unknown ``mode`` (the valid ones are listed), shapes that are not [B] or differ,
            a non-finite ``penalty``.
    """
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"unknown truncation mode {mode!r}; valid modes: {', '.join(TRUNCATION_MODES)}")
    rewards_t = _as_1d("rewards", rewards, torch.float32).clone()
    truncated_t = _as_1d("truncated", truncated, torch.bool)
    valid_t = torch.ones_like(truncated_t) if valid is None else _as_1d("valid", valid, torch.bool).clone()
    if not (rewards_t.shape == truncated_t.shape == valid_t.shape):
        raise ValueError(
            f"rewards {tuple(rewards_t.shape)}, truncated {tuple(truncated_t.shape)} and valid "
            f"{tuple(valid_t.shape)} must all be [B] with the same B"
        )
    if (
        isinstance(penalty, bool)
        or not isinstance(penalty, numbers.Real)
        or not math.isfinite(float(penalty))
    ):
        raise ValueError(f"penalty must be a finite number, got {penalty!r}")
    if mode == "penalty":
        rewards_t = torch.where(truncated_t, torch.full_like(rewards_t, float(penalty)), rewards_t)
    elif mode == "exclude":
        valid_t = valid_t & ~truncated_t
    return rewards_t, valid_t
