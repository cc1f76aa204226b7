"""Sequence-score normalisation: a fixed offset from the initial policy's samples, or running
mean/std with optional clipping (Huang et al. 2024, detail 15; Zheng et al. 2023)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["REWARD_NORMALIZATIONS", "RewardNormalizer"]

REWARD_NORMALIZATIONS = ("none", "fixed_offset", "running")


class RewardNormalizer:
    """Sequence-score normalisation, applied to the reward functions' scores before the EOS
    penalty and the KL shaping.

    Modes:

    - ``none``: scores unchanged.
    - ``fixed_offset``: the first batch it sees (samples of the initial policy) sets
      ``offset = mean(scores)`` over its valid rows; every batch, that one included, becomes
      ``scores - offset``, so samples of the initial policy score 0 on average. This is N+ detail
      15 (Huang et al. 2024), which sets the reward head's bias so a reference distribution has
      mean reward 0; here the reference distribution is the initial policy's samples.
    - ``running``: running mean and population variance over every valid score seen so far
      (Chan et al. parallel update, the current batch included), then
      ``(scores - mean) / (std + eps)`` ("Secrets of RLHF", reward normalisation with running
      statistics).

    With ``clip`` set, the result is clamped to ``[-clip, clip]`` ("Secrets of RLHF" clips the
    normalised reward).

    Args:
        mode: one of :data:`REWARD_NORMALIZATIONS`.
        clip: None or a number > 0.
        eps: added to the running std, > 0.
        reduce: None, or a data-parallel ``reduce(tensor, op) -> tensor`` (sum over ranks): the
            offset and the running statistics then come from every rank's valid scores, as if
            the whole batch had been scored in one process.

    Raises:
        ValueError: unknown ``mode`` (lists the valid ones), ``clip`` <= 0, ``eps`` <= 0.
    """

    def __init__(self, mode: str = "none", *, clip: float | None = None, eps: float = 1e-8, reduce=None):
        if mode not in REWARD_NORMALIZATIONS:
            raise ValueError(
                f"unknown reward normalisation {mode!r}; valid: {', '.join(REWARD_NORMALIZATIONS)}"
            )
        if clip is not None and not clip > 0:
            raise ValueError(f"reward normalisation clip must be > 0 or None, got {clip!r}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        self.mode = mode
        self.clip = clip
        self.eps = eps
        self.reduce = reduce
        self.offset: float | None = None
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        """Population std of the scores seen so far (0 before any)."""
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def _batch_moments(self, values: torch.Tensor) -> tuple[int, float, float]:
        """Count, mean and sum of squared deviations of the batch (over every rank's values)."""
        if self.reduce is None:
            n = values.numel()
            if n == 0:
                return 0, 0.0, 0.0
            batch_mean = values.double().mean().item()
            return n, batch_mean, ((values.double() - batch_mean) ** 2).sum().item()
        total = self.reduce(torch.tensor([values.numel(), values.double().sum().item()], dtype=torch.float64))
        n = int(total[0])
        if n == 0:
            return 0, 0.0, 0.0
        batch_mean = float(total[1]) / n
        m2 = self.reduce(((values.double() - batch_mean) ** 2).sum().reshape(1))
        return n, batch_mean, float(m2[0])

    def _update(self, values: torch.Tensor) -> None:
        n, batch_mean, batch_m2 = self._batch_moments(values)
        if n == 0:
            return
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def __call__(
        self, scores: torch.Tensor, valid: torch.Tensor | None = None, *, update: bool = True
    ) -> torch.Tensor:
        """Normalise a batch of scores.

        Args:
            scores: float [B] sequence scores.
            valid: bool [B]; only valid rows update the statistics (all rows when None). Every
                row is transformed.
            update: False transforms with the current statistics without updating them (e.g. the
                greedy baseline's scores of ReMax); the fixed offset is still set by the first
                batch that updates.

        Returns:
            float32 [B].

        Raises:
            ValueError: ``scores`` not 1-D, or ``valid`` of another shape.
        """
        scores = torch.as_tensor(scores, dtype=torch.float32)
        if scores.dim() != 1:
            raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
        if valid is None:
            valid = torch.ones_like(scores, dtype=torch.bool)
        valid = torch.as_tensor(valid, dtype=torch.bool)
        if valid.shape != scores.shape:
            raise ValueError(
                f"valid must have the shape of scores {tuple(scores.shape)}, got {tuple(valid.shape)}"
            )
        if self.mode == "none":
            out = scores.clone()
        elif self.mode == "fixed_offset":
            if self.offset is None and update:
                n, mean, _ = self._batch_moments(scores[valid])
                self.offset = mean if n else None
            out = scores - (self.offset or 0.0)
        else:
            if update:
                self._update(scores[valid])
            out = (scores - self.mean) / (self.std + self.eps)
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        return out.float()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: offset, count, mean, m2."""
        return {"offset": self.offset, "count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.offset = state["offset"]
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])
