"""Statistics of the groups of a batch: the G samples drawn for one prompt.

Rows of a group share a group id (``group_index[B]``, integer). Ids need not be 0..K-1 and rows
of a group need not be contiguous; every statistic here is accumulated over the ids with
``index_add`` / ``scatter_reduce``, so rows of different prompts are never mixed. This module is
the one place where group statistics are computed: the group-relative advantage estimators
(RLOO, Kool et al. 2019 and Ahmadian et al. 2024; GRPO, Shao et al. 2024), the sampling
diagnostics and the trainer's dynamic sampling (DAPO, Yu et al. 2025, section 3.2) use it.
"""

from __future__ import annotations

import math

import torch

from .checks import check_group_index_dtype, check_shape_of

__all__ = [
    "fill_with_group_mean",
    "group_inverse",
    "group_mean_std",
    "group_stats",
    "varied_group_rows",
    "zero_variance_group_fraction",
]


def group_inverse(group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map arbitrary group ids to 0..K-1.

    Args:
        group_index: [B] integer tensor of group (prompt) ids, in any order.

    Returns:
        ``(inverse[B] long, sizes[K] long)``: ``inverse[i]`` is row i's group in 0..K-1 (groups
        numbered in increasing id order) and ``sizes[k]`` the number of rows in group k.
    """
    _, inverse, sizes = torch.unique(group_index, return_inverse=True, return_counts=True)
    return inverse, sizes


def group_stats(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group bookkeeping in one pass: numbering, sizes, sums and an all-equal flag.

    Args:
        rewards: [B] floating, one value per row.
        group_index: [B] integer group ids, any order, on ``rewards``' device.

    Returns:
        ``(inverse[B] long, sizes[K] long, sums[K], constant[K] bool)``: row i's group in 0..K-1
        (as :func:`group_inverse`), each group's size, the sum of its rewards (``rewards``'
        dtype) and whether all its rewards are exactly equal (max == min; a group of one row is
        all-equal).
    """
    inverse, sizes = group_inverse(group_index)
    k = sizes.shape[0]
    dtype, device = rewards.dtype, rewards.device
    sums = torch.zeros(k, dtype=dtype, device=device).index_add_(0, inverse, rewards)
    gmax = torch.full((k,), float("-inf"), dtype=dtype, device=device).scatter_reduce(
        0, inverse, rewards, reduce="amax"
    )
    gmin = torch.full((k,), float("inf"), dtype=dtype, device=device).scatter_reduce(
        0, inverse, rewards, reduce="amin"
    )
    return inverse, sizes, sums, gmax == gmin


def group_mean_std(
    rewards: torch.Tensor, group_index: torch.Tensor, *, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row statistics of the row's group: centred value, std and size, each [B].

    Means and squared deviations are accumulated with ``index_add`` over the group ids, so only
    rows with the same id are ever combined. A group whose values are all equal gets a centred
    value and a std of exactly 0 (detected with max == min, since the mean of equal float values
    can differ from them by a rounding error: 0.1 three times in float32).

    Args:
        rewards: [B] floating, one value per row (e.g. a sequence reward).
        group_index: [B] integer group ids, any order.
        unbiased: std with Bessel's correction (divide by n - 1; a group of size 1 then has std
            NaN, so callers that divide by it must reject such groups) or population std (n).

    Returns:
        ``(centered[B], std[B], size[B])``: ``rewards - group mean``, the group's std (both in
        ``rewards``' dtype), and the group's size (long), each gathered back to the rows.
    """
    inverse, sizes, sums, constant = group_stats(rewards, group_index)
    dtype, device = rewards.dtype, rewards.device
    means = sums / sizes.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=device)
    centered = torch.where(constant[inverse], zero, rewards - means[inverse])
    sq = torch.zeros(sizes.shape[0], dtype=dtype, device=device).index_add_(0, inverse, centered * centered)
    std = torch.sqrt(sq / (sizes - 1 if unbiased else sizes).to(dtype))
    return centered, std[inverse], sizes[inverse]


def zero_variance_group_fraction(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Fraction of groups whose rewards are all equal (exact equality).

    Such a group gives every group-relative estimator (RLOO, GRPO) an advantage of 0: it costs
    generation and contributes no gradient (DAPO's "dynamic sampling", Yu et al. 2025, section
    3.2, filters these groups). A group of one row counts as all-equal.

    Args:
        rewards: [B] floating sequence rewards.
        group_index: [B] integer group ids, any order.

    Returns:
        0-d float32 tensor in [0, 1] (0 for an empty batch).

    Raises:
        TypeError: an argument is not a tensor, or ``group_index`` is not integer.
        ValueError: ``rewards`` not 1-D, or ``group_index`` of a different shape.
    """
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a [B] torch.Tensor, got {type(rewards).__name__}")
    if not isinstance(group_index, torch.Tensor):
        raise TypeError(f"group_index must be a [B] integer torch.Tensor, got {type(group_index).__name__}")
    if rewards.dim() != 1:
        raise ValueError(
            f"rewards must be 1-D [B] (one reward per sequence), got shape {tuple(rewards.shape)}"
        )
    check_shape_of(group_index, "group_index", rewards, "rewards")
    check_group_index_dtype(group_index)
    if rewards.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=rewards.device)
    with torch.no_grad():
        gidx = group_index.to(device=rewards.device, dtype=torch.long)
        _, _, _, constant = group_stats(rewards.detach(), gidx)
        return constant.float().mean()


def fill_with_group_mean(
    scores: torch.Tensor, missing: torch.Tensor, group_index: torch.Tensor
) -> torch.Tensor:
    """[B] scores with ``missing`` rows replaced by the mean of their group's other rows (0 when
    the whole group is missing), so they change neither the group mean nor any advantage.

    A row whose reward could not be computed is left out of the loss; standing in the mean of
    the present rows of its group keeps every group statistic (the mean exactly; RLOO's and
    GRPO's baselines, Kool et al. 2019, Shao et al. 2024) as the present rows alone give it.

    Args:
        scores: [B] floating scores, on the CPU (missing rows may hold anything, NaN too).
        missing: [B] bool, True where the score is missing.
        group_index: [B] long group ids >= 0 on the CPU (any order; the accumulators have
            ``max + 1`` slots).

    Returns:
        [B] tensor of ``scores``' dtype: ``scores`` where present; where missing, the mean of the
        present scores of the row's group, or 0 when none of the group is present.
    """
    n = int(group_index.max()) + 1
    present = (~missing).to(scores.dtype)
    sums = torch.zeros(n, dtype=scores.dtype).index_add(0, group_index, torch.where(missing, 0.0, scores))
    counts = torch.zeros(n, dtype=scores.dtype).index_add(0, group_index, present)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return torch.where(missing, means[group_index], scores)


def varied_group_rows(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose group has at least two different scores (dynamic sampling, DAPO).

    A group whose scores are all equal gives every group-relative advantage exactly 0 and so no
    gradient; DAPO (Yu et al. 2025, section 3.2) keeps only the groups with
    ``0 < #correct < G``, i.e. the rows this returns True for.

    Args:
        scores: [B] float32 scores on the CPU (the accumulators are float32).
        group_index: [B] long group ids >= 0, any order (moved to the CPU).

    Returns:
        [B] bool, True where the row's group has max > min.
    """
    n = int(group_index.max()) + 1
    g = group_index.cpu()
    hi = torch.full((n,), -math.inf).scatter_reduce(0, g, scores, "amax")
    lo = torch.full((n,), math.inf).scatter_reduce(0, g, scores, "amin")
    return (hi > lo)[g]
