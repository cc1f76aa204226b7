"""Diagnostics of a training step: critic quality and group-sampling health.

Pure functions of tensors, computed without gradient. Logged names (design.md): the value of
:func:`explained_variance` is ``critic/explained_variance``. The group-sampling statistic
:func:`zero_variance_group_fraction` lives with the other group statistics in
:mod:`policygrad.core.groups` and is re-exported here.
"""

from __future__ import annotations

import math
import numbers

import torch

from .checks import as_bool_mask, check_shape_of, check_tensor
from .groups import zero_variance_group_fraction

__all__ = [
    "explained_variance",
    "group_index_from_size",
    "mean_value",
    "std_value",
    "zero_variance_group_fraction",
]


def mean_value(values: torch.Tensor) -> float:
    """``values.mean()`` as a Python float; when the tensor's own accumulation overflowed (float32
    rewards near its range: 8 x 3e38 sums to inf) and every value is finite, the mean in float64,
    which is then finite. Otherwise exactly ``values.mean().item()`` (NaN for no values)."""
    out = values.mean().item()
    if not math.isfinite(out) and values.numel() and bool(torch.isfinite(values).all()):
        out = values.double().mean().item()
    return out


def std_value(values: torch.Tensor) -> float:
    """``values.std()`` (Bessel's correction) as a Python float, recomputed in float64 when finite
    values' squares overflowed (as :func:`mean_value`); 0.0 for fewer than two values."""
    if values.numel() < 2:
        return 0.0
    out = values.std().item()
    if not math.isfinite(out) and bool(torch.isfinite(values).all()):
        out = values.double().std().item()
    return out


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Fraction of the variance of the returns that the critic explains, over valid tokens.

    ``EV = 1 - Var[returns - values] / Var[returns]``, both variances over the valid tokens of the
    whole batch (the normalisation, n or n - 1, cancels in the ratio; population variance is
    used). 1 is a perfect critic, 0 is no better than predicting the mean return, negative is
    worse than that. This is the critic diagnostic logged by CleanRL's ``ppo.py`` and Stable
    Baselines3 (``explained_variance``); the returns are the critic's regression targets (the
    lambda-returns of GAE, Schulman et al. 2015b, eq. 16 and section 5).

    If ``Var[returns] == 0`` (all valid returns equal, exactly: the centring is exact for
    all-equal inputs), or there is no valid token, the ratio is undefined and the result is NaN
    (a float tensor, not an exception), as in CleanRL; a logger should show it as missing.

    Args:
        values: [B, T] floating critic predictions V(s_t) (the values the returns were built with).
        returns: [B, T] floating value targets (e.g. GAE lambda-returns).
        response_mask: [B, T], nonzero on valid tokens. Masked positions may hold anything.

    Returns:
        0-d tensor, dtype of ``returns``, detached.

    Raises:
        TypeError: an argument is not a tensor.
        ValueError: ``values`` or ``response_mask`` differs in shape from ``returns``.
    """
    check_tensor(returns, "returns")
    check_tensor(values, "values")
    check_shape_of(values, "values", returns, "returns")
    m = as_bool_mask(returns, response_mask, "returns", "response_mask")
    with torch.no_grad():
        y = returns.detach()
        residual = y - values.detach().to(y.dtype)
        nan = torch.tensor(float("nan"), dtype=y.dtype, device=y.device)
        if not bool(m.any()):
            return nan
        var_y = _population_var(y, m)
        var_res = _population_var(residual, m)
        return torch.where(var_y == 0, nan, 1 - var_res / var_y)


def _population_var(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    valid = x[m]
    if bool(valid.amax() == valid.amin()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    centered = valid - valid.mean()
    return (centered * centered).mean()


def group_index_from_size(
    num_prompts: int, group_size: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Group ids for the contiguous layout: rows ``i*G .. i*G+G-1`` belong to prompt ``i``.

    ``group_index_from_size(2, 3) == tensor([0, 0, 0, 1, 1, 1])`` (design.md, conventions).

    Args:
        num_prompts: number of prompts (>= 1).
        group_size: G, samples per prompt (>= 1).
        device: device of the result.

    Returns:
        [num_prompts * group_size] long tensor.

    Raises:
        ValueError: ``num_prompts`` or ``group_size`` not a positive int.
    """
    for name, value in (("num_prompts", num_prompts), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return torch.arange(int(num_prompts), device=device).repeat_interleave(int(group_size))
